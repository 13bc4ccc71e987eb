"""Runs ``jaxkv-serve`` from a checkout: see :mod:`jaxkv.commands.serve` (``--help``)."""

from jaxkv.commands.serve import run

if __name__ == "__main__":
    run()
