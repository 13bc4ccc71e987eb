"""``jaxkv-server --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--memory 1GiB] [--max_model_len 2048]``.

Serves one Hugging Face-format checkpoint directory over OpenAI's API on loopback
unless told otherwise. Bad flags are one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from jaxkv.errors import JaxkvError

PROG = "jaxkv-server"
_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


def fail(message: str) -> NoReturn:
    """One line on stderr, exit status 2."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_bytes(text: str) -> int:
    """``512MiB``, ``1GiB``, ``100000``: a byte count."""
    digits = text.rstrip("KkMmGgIiBb")
    unit = text[len(digits) :].upper()
    if not digits.isdigit() or unit not in _UNITS or int(digits) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 512MiB or 1GiB")
    return int(digits) * _UNITS[unit]


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description="An OpenAI-compatible server over one jaxkv engine.")
    p.add_argument("--checkpoint", required=True, help="a local Hugging Face-format checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--memory", type=parse_bytes, default=parse_bytes("256MiB"), help="KV cache memory, e.g. 1GiB")
    p.add_argument("--max_model_len", type=int, default=2048, help="the longest prompt + output, in tokens")
    p.add_argument("--max_num_seqs", type=int, default=16, help="sequences per step")
    p.add_argument("--max_requests", type=int, default=256, help="unfinished requests before 429")
    p.add_argument("--max_body_bytes", type=parse_bytes, default=parse_bytes("1MiB"))
    p.add_argument("--no_prefix_caching", action="store_true", help="turn the prefix cache off")
    p.add_argument("--served_model_name", default=None, help="the model id clients name (the directory's name)")
    p.add_argument("--api_key", default=os.environ.get("JAXKV_API_KEY"), help="require this bearer key")
    return p


def build_app(args: argparse.Namespace) -> Any:
    """The app for parsed ``args`` (the engine is built when the app starts)."""
    from jaxkv.models.text import load_tokenizer
    from jaxkv.server.app import ServerConfig, create_app
    from jaxkv.serving.engine import Engine

    directory = Path(args.checkpoint)
    if not (directory / "config.json").exists():
        fail(f"--checkpoint={args.checkpoint} has no config.json")
    for name in ("port", "max_model_len", "max_num_seqs", "max_requests"):
        if getattr(args, name) <= 0 or (name == "port" and args.port > 65535):
            fail(f"--{name}={getattr(args, name)} is out of range")

    def build() -> Engine:
        return Engine.from_pretrained(
            directory,
            memory_bytes=args.memory,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            enable_caching=not args.no_prefix_caching,
        )

    try:
        tokenizer = load_tokenizer(directory)
    except JaxkvError as err:
        fail(str(err))
    config = ServerConfig(
        model_name=args.served_model_name or directory.resolve().name,
        build_engine=build,
        tokenizer=tokenizer,
        api_key=args.api_key,
        max_requests=args.max_requests,
        max_body_bytes=args.max_body_bytes,
    )
    return create_app(config)


class ServerThread:
    """``app`` served by uvicorn on a free loopback port, on a daemon thread: a live server
    inside a test or benchmark process. ``url`` answers once the constructor returns."""

    def __init__(self, app: Any, *, timeout_s: float = 300.0) -> None:
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.app = app
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise JaxkvError(f"the server at {self.url} did not start within {timeout_s} s")
            time.sleep(0.05)

    def close(self) -> None:
        """Stop serving (the app's engine closes with it) and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(60)


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        fail("the server needs its extra: pip install 'jaxkv[server]'")
    uvicorn.run(build_app(args), host=args.host, port=args.port, log_level="warning")
