"""uvicorn's h11 protocol with a header read timeout (the ``server`` extra).

uvicorn times out only an idle keep-alive connection, and only until its next byte: a
client that connects and sends nothing, or part of a request line or headers and then
stalls (slowloris), holds its connection and file descriptor for as long as it likes.
Here a connection waiting for a request's headers (just opened, or after a response) is
closed once ``header_timeout_s`` pass without a request under way; a request whose
headers have arrived is never cut (its body has the app's own timeout).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """An h11 protocol class (uvicorn's ``Config(http=...)``) closing connections whose
    request headers do not arrive within ``header_timeout_s`` seconds."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._wait_for_headers()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._wait_for_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _wait_for_headers(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_timed_out)

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            waiting = self.cycle is None or self.cycle.response_complete  # no request under way
            if waiting and not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11Protocol
