"""The root of every typed error jaxkv raises.

Catch :class:`JaxkvError` to handle anything jaxkv refused; each module's errors
subclass it (most also subclass ``ValueError`` or ``KeyError``, as the standard
library would raise for the same bad input). A refused call changes nothing.
"""

import threading
from typing import NoReturn


class JaxkvError(Exception):
    """A jaxkv call was refused; the message names the offending value."""


class WrongThreadError(JaxkvError, RuntimeError):
    """A single-owner object was called from a thread other than its owner's."""


class OwnerThread:
    """Remembers the thread that created a single-owner object and refuses the others.

    The manager, the engine and the transfer engine mutate plain Python state (and the
    donated device cache) without locks: one thread drives them, as one scheduler
    thread drives vLLM's. Calling from another thread raises instead of corrupting.
    """

    __slots__ = ("ident", "what")

    def __init__(self, what: str) -> None:
        self.ident = threading.get_ident()
        self.what = what

    def check(self) -> None:
        """Raise :class:`WrongThreadError` unless called from the owner thread."""
        if threading.get_ident() != self.ident:
            raise WrongThreadError(
                f"{self.what} is single-owner: created on thread {self.ident}, called from {threading.get_ident()}"
            )


class ExtraNotInstalledError(JaxkvError, ModuleNotFoundError):
    """A module needs a package of an optional extra that is not installed; the message
    names the ``pip install 'jaxkv[...]'`` that brings it (``name`` is the missing module)."""


def raise_missing_extra(err: ModuleNotFoundError, packages: tuple[str, ...], hint: str) -> NoReturn:
    """Raise ``err`` again as an :class:`ExtraNotInstalledError` saying ``hint`` (what to
    install) when the module it misses is one of ``packages`` (or inside one); else ``err``
    itself, unchanged (a broken install, not a missing extra)."""
    if (err.name or "").split(".")[0] not in packages:
        raise err
    raise ExtraNotInstalledError(f"{hint} (no module named {err.name!r})", name=err.name) from err
