"""Runs ``jaxkv-simulate`` from a checkout: see :mod:`jaxkv.commands.simulate` (``--help``)."""

from jaxkv.commands.simulate import run

if __name__ == "__main__":
    run()
