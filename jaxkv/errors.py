"""The root of every typed error jaxkv raises.

Catch :class:`JaxkvError` to handle anything jaxkv refused; each module's errors
subclass it (most also subclass ``ValueError`` or ``KeyError``, as the standard
library would raise for the same bad input). A refused call changes nothing.
"""

import threading


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
