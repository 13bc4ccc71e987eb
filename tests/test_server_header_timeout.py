"""A client that never finishes its headers is dropped; a request under way never is (raw sockets)."""

import asyncio
import socket
import time

import pytest

pytest.importorskip("uvicorn")
fastapi = pytest.importorskip("fastapi")

from fastapi.responses import PlainTextResponse, StreamingResponse  # noqa: E402

from jaxkv.server.cli import ServerThread  # noqa: E402

TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def server():
    app = fastapi.FastAPI()

    @app.get("/ok")
    async def ok():
        return PlainTextResponse("ok")

    @app.get("/slow")
    async def slow():  # a stream that outlasts the header timeout several times over
        async def parts():
            for _ in range(4):
                await asyncio.sleep(TIMEOUT_S)
                yield "x"

        return StreamingResponse(parts())

    live = ServerThread(app, header_timeout_s=TIMEOUT_S)
    yield live
    live.close()


def connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    start, got = time.monotonic(), b""
    while part := sock.recv(4096):
        got += part
    return got, time.monotonic() - start


@pytest.mark.parametrize("sent", [b"", b"GET /ok HTTP/1.1\r\nHost: x\r\n"])
def test_headers_that_never_arrive_close_the_connection(server, sent):
    with connect(server) as sock:
        sock.sendall(sent)
        got, waited = read_until_closed(sock)
    assert got == b"" and TIMEOUT_S * 0.8 <= waited < TIMEOUT_S + 5


def test_a_stalled_second_request_on_a_kept_alive_connection_is_closed(server):
    with connect(server) as sock:
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\nGET /ok HTTP/1.1\r\nHost: x\r\n")
        got, waited = read_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"ok") and got.count(b"HTTP/1.1") == 1
    assert waited < TIMEOUT_S + 5


def test_a_request_longer_than_the_timeout_is_answered_whole(server):
    with connect(server) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        got, waited = read_until_closed(sock)
    assert got.startswith(b"HTTP/1.1 200") and waited >= 4 * TIMEOUT_S
    assert got.replace(b"\r\n", b"").endswith(b"1x1x1x1x0"), "all four chunks, then the last chunk"
