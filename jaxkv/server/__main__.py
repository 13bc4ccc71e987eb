"""``python -m jaxkv.server --checkpoint DIR``: see :mod:`jaxkv.server.cli`."""

from jaxkv.server.cli import main

main()
