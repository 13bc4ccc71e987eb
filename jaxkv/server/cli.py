"""``jaxkv-server --checkpoint DIR [--host 127.0.0.1] [--port 8000] [--memory 1GiB] [--max_model_len N]``
``[--kv_offloading_size 4GiB [--kv_offloading_path FILE [--kv_offloading_peers GLOB]]]``.

Serves one Hugging Face-format checkpoint directory over OpenAI's API on loopback
unless told otherwise. ``--max_model_len`` defaults to the checkpoint's positions. The
engine is built before the port is bound: bad flags, a bad checkpoint or a memory that
cannot hold one request of ``max_model_len`` tokens (the message names the largest
length that fits) are one line on stderr and exit status 2; once serving, one line says
where, what and in which plan. ``--kv_offloading_size`` adds a host tier of that much
CPU memory (:class:`~jaxkv.serving.offload_connector.OffloadConfig`); with
``--kv_offloading_path`` it lives in a file a restarted server reloads
(:mod:`jaxkv.offload.persistent`) and announces in its KV events; with
``--kv_offloading_peers`` it also copies prefix hits from the other replicas' files on
this machine (:mod:`jaxkv.offload.peers`).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from jaxkv.errors import JaxkvError
from jaxkv.offload.catalog import STORE_POLICIES

if TYPE_CHECKING:
    from jaxkv.models.protocol import ServedModel
    from jaxkv.planner import KVCacheConfig
    from jaxkv.serving.offload_connector import OffloadConfig

PROG = "jaxkv-server"
HEADER_TIMEOUT_S = 10.0
"""A connection waiting longer for a request's headers is closed (a stalled client holds nothing)."""
_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(message)


class _DefaultsShown(argparse.HelpFormatter):
    """``--help`` names each flag's default, where it has one to name."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, argparse.SUPPRESS):
            return action.help
        return f"{action.help} (default: %(default)s)"


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
    p = _Parser(
        prog=PROG,
        description="An OpenAI-compatible server over one jaxkv engine.",
        formatter_class=_DefaultsShown,
    )
    p.add_argument("--checkpoint", required=True, help="a local Hugging Face-format checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--memory", type=parse_bytes, default="256MiB", help="KV cache memory, e.g. 1GiB")
    p.add_argument(
        "--max_model_len",
        type=int,
        default=None,
        help="the longest prompt + output, in tokens (default: the checkpoint's positions)",
    )
    p.add_argument("--max_num_seqs", type=int, default=16, help="sequences per step")
    p.add_argument("--max_requests", type=int, default=256, help="unfinished sequences (n per request) before 429")
    p.add_argument("--max_body_bytes", type=parse_bytes, default="1MiB", help="the largest request body")
    p.add_argument(
        "--header_timeout_s",
        type=float,
        default=HEADER_TIMEOUT_S,
        help="close a connection whose request headers take longer to arrive (seconds)",
    )
    p.add_argument("--no_prefix_caching", action="store_true", help="turn the prefix cache off")
    p.add_argument(
        "--served_model_name", default=None, help="the model id clients name (default: the directory's name)"
    )
    p.add_argument("--api_key", default=os.environ.get("JAXKV_API_KEY"), help="require this bearer key")
    p.add_argument("--access_log", action="store_true", help="log one line per HTTP request")
    host = p.add_argument_group("Host tier (KV blocks offloaded to CPU memory, as vLLM's --kv-offloading-size)")
    host.add_argument(
        "--kv_offloading_size", type=parse_bytes, default=None, help="host memory for offloaded KV blocks, e.g. 4GiB"
    )
    host.add_argument(
        "--kv_offloading_policy", choices=("lru", "arc"), default="lru", help="which host blocks are evicted first"
    )
    host.add_argument(
        "--kv_offloading_store",
        choices=STORE_POLICIES,
        default=None,
        help="when device blocks go to host: as the device evicts them, or once computed "
        "(default: write_through with --kv_offloading_path, which then holds what a restart loses; else on_eviction)",
    )
    host.add_argument(
        "--kv_offloading_path",
        default=None,
        help="keep the host tier in this file (and PATH.journal): a restarted server reloads it and announces it",
    )
    host.add_argument(
        "--kv_offloading_peers",
        default=None,
        metavar="GLOB",
        help="other replicas' --kv_offloading_path files on this machine (this server's own excluded, found again "
        "every second) whose blocks a prefix hit copies into this server's host tier, e.g. '/dev/shm/kv/*.kv' "
        "(through staging rows of up to a quarter of the size, allocated on top of it)",
    )
    events = p.add_argument_group("KV cache events (vLLM's ZeroMQ wire format, for KV-aware routers)")
    events.add_argument("--kv_events_endpoint", default=None, help="publish on this ZeroMQ PUB address")
    events.add_argument("--kv_events_replay_endpoint", default=None, help="answer replays on this ROUTER address")
    events.add_argument("--kv_events_topic", default="", help="the topic frame of every batch")
    events.add_argument(
        "--kv_events_curve_dir",
        default=os.environ.get("JAXKV_CURVE_DIR"),
        help="CURVE keys (zmq.auth files) that authenticate tcp subscribers",
    )
    events.add_argument(
        "--kv_events_plaintext_tcp", action="store_true", help="allow tcp without keys, on loopback only"
    )
    events.add_argument(
        "--kv_events_idle_batch_s",
        type=float,
        default=1.0,
        help="with replay: publish an empty batch after this many idle seconds (a late router then replays)",
    )
    events.add_argument(
        "--kv_events_raw",
        action="store_true",
        help="hybrids: publish every group's blocks and checkpoints as recorded, not the blocks a hit can use",
    )
    return p


def event_publisher(args: argparse.Namespace) -> Any:
    """The KV event publisher the flags ask for, bound now; None without ``--kv_events_endpoint``."""
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint is not None:
            fail("--kv_events_replay_endpoint needs --kv_events_endpoint")
        return None
    from jaxkv.serving.kv_events import KVEventPublisher
    from jaxkv.serving.zmq_security import CurveKeys

    try:
        curve = None if args.kv_events_curve_dir is None else CurveKeys.load(args.kv_events_curve_dir)
        return KVEventPublisher(
            args.kv_events_endpoint,
            replay_endpoint=args.kv_events_replay_endpoint,
            topic=args.kv_events_topic,
            curve=curve,
            plaintext_tcp=args.kv_events_plaintext_tcp,
            idle_batch_s=args.kv_events_idle_batch_s if args.kv_events_replay_endpoint else None,
            state_aware=not args.kv_events_raw,
        )
    except JaxkvError as err:
        fail(str(err))


def largest_max_model_len(model: ServedModel, memory_bytes: int, limit: int, **plan_kwargs: Any) -> int:
    """The longest ``max_model_len`` up to ``limit`` whose plan fits ``memory_bytes`` (0: none),
    by bisection over :func:`~jaxkv.serving.engine.plan_for_model` with ``plan_kwargs``."""
    from jaxkv.planner import PlanError
    from jaxkv.serving.engine import plan_for_model

    fits, over = 0, limit + 1
    while over - fits > 1:
        mid = (fits + over) // 2
        try:
            plan_for_model(model, memory_bytes, max_model_len=mid, **plan_kwargs)
        except PlanError:
            over = mid
        else:
            fits = mid
    return fits


def plan_or_refuse(model: ServedModel, memory_bytes: int, max_model_len: int, **plan_kwargs: Any) -> KVCacheConfig:
    """The plan an engine of ``model`` serves with; a memory that holds no request of
    ``max_model_len`` tokens is refused naming the largest length that fits, as vLLM does."""
    from jaxkv.planner import InsufficientMemoryError
    from jaxkv.serving.engine import plan_for_model

    try:
        return plan_for_model(model, memory_bytes, max_model_len=max_model_len, **plan_kwargs)
    except InsufficientMemoryError as err:
        fits = largest_max_model_len(model, memory_bytes, max_model_len - 1, **plan_kwargs)
        advice = f"--max_model_len {fits} fits" if fits else "no request fits"
        raise InsufficientMemoryError(f"{err}; in --memory {memory_bytes:,} B {advice}") from None


def checkpoint_identity(directory: Path) -> str:
    """What names a checkpoint's weights for a host tier kept in a file: a digest of its
    ``config.json`` and of the names, sizes and modification times of its weight files."""
    digest = hashlib.sha256((directory / "config.json").read_bytes())
    for weights in sorted(directory.glob("*.safetensors")) + sorted(directory.glob("*.bin")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def offload_config(args: argparse.Namespace, directory: Path) -> OffloadConfig | None:
    """The host tier the flags ask for (None without ``--kv_offloading_size``); refused in one line."""
    from jaxkv.serving.offload_connector import OffloadConfig

    if args.kv_offloading_size is None:
        if args.kv_offloading_path is not None:
            fail("--kv_offloading_path needs --kv_offloading_size (the host memory the file maps)")
        if args.kv_offloading_peers is not None:
            fail("--kv_offloading_peers needs --kv_offloading_size and --kv_offloading_path (a file of its own)")
        return None
    if args.no_prefix_caching:
        fail("--kv_offloading_size needs the prefix cache: the host tier is keyed by block hashes")
    persistent = args.kv_offloading_path is not None
    if args.kv_offloading_peers is not None and not persistent:
        fail("--kv_offloading_peers needs --kv_offloading_path: a replica shares its host tier through its own file")
    store = args.kv_offloading_store or ("write_through" if persistent else "on_eviction")
    try:
        return OffloadConfig(
            args.kv_offloading_size,
            policy=args.kv_offloading_policy,
            store=store,
            path=args.kv_offloading_path,
            model_id=checkpoint_identity(directory) if persistent else "",
            peers=args.kv_offloading_peers,
        )
    except JaxkvError as err:
        fail(str(err).replace("host_bytes", "--kv_offloading_size"))


def build_app(args: argparse.Namespace, kv_events: Any = None) -> Any:
    """The app for parsed ``args`` (the engine is built when the app starts), its engine
    publishing on ``kv_events`` (:func:`event_publisher`) when given."""
    from jaxkv.models.checkpoint import eos_token_ids, load_pretrained
    from jaxkv.models.checkpoint_files import read_config
    from jaxkv.models.config_checks import max_positions
    from jaxkv.models.text import load_tokenizer
    from jaxkv.server.app import ServerConfig, create_app
    from jaxkv.serving.engine import Engine

    directory = Path(args.checkpoint)
    if not (directory / "config.json").exists():
        fail(f"--checkpoint={args.checkpoint} has no config.json")
    if args.api_key is not None and not args.api_key:
        fail("--api_key is empty: give a key, or leave the flag (and JAXKV_API_KEY) unset")
    try:
        tokenizer = load_tokenizer(directory)
        if args.max_model_len is None:
            args.max_model_len = max_positions(read_config(directory))
    except JaxkvError as err:
        fail(str(err))
    if args.max_model_len is None:
        fail(f"--max_model_len is needed: {directory / 'config.json'} names no max_position_embeddings")
    for name in ("port", "max_model_len", "max_num_seqs", "max_requests", "header_timeout_s"):
        if not getattr(args, name) > 0 or (name == "port" and args.port > 65535):
            fail(f"--{name}={getattr(args, name)} is out of range")

    offload = offload_config(args, directory)

    def build() -> Engine:
        model = load_pretrained(directory, max_model_len=args.max_model_len)
        plan = plan_or_refuse(model, args.memory, args.max_model_len, max_num_seqs=args.max_num_seqs)
        return Engine(
            model,
            plan,
            max_num_seqs=args.max_num_seqs,
            enable_caching=not args.no_prefix_caching,
            eos_token_ids=eos_token_ids(directory),
            tokenizer=tokenizer,
            kv_events=kv_events,
            offload=offload,
        )

    config = ServerConfig(
        model_name=args.served_model_name or directory.resolve().name,
        build_engine=build,
        tokenizer=tokenizer,
        api_key=args.api_key,
        max_requests=args.max_requests,
        max_body_bytes=args.max_body_bytes,
        model_path=str(directory.resolve()),
    )
    return create_app(config)


class ServerThread:
    """``app`` served by uvicorn on a free loopback port, on a daemon thread: a live server
    inside a test or benchmark process. ``url`` answers once the constructor returns."""

    def __init__(self, app: Any, *, timeout_s: float = 300.0, header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
        import uvicorn

        from jaxkv.server.header_timeout import header_timeout_protocol

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.app = app
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        http = header_timeout_protocol(header_timeout_s)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=http))
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


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def host_tier(engine: Any) -> str:
    """The ready line's words for the engine's host tier ("" without one)."""
    connector = engine.connector
    if connector is None:
        return ""
    kept = "" if connector.persistent is None else f", kept in {connector.persistent.path}"
    reloaded = "" if connector.persistent is None else f", {len(connector.persistent.entries)} reloaded"
    peers = "" if connector.peers is None else f", peers {connector.peers.pattern}"
    return f", host tier {connector.num_host_blocks} blocks ({connector.host_bytes:,} B{kept}{reloaded}{peers})"


async def serve(args: argparse.Namespace) -> None:
    """Build the engine, then bind and serve ``args`` until a signal stops uvicorn."""
    kv_events = event_publisher(args)
    try:
        events = "" if kv_events is None else f", KV events on {kv_events.endpoint}"
        await _serve(args, build_app(args, kv_events), events)
    finally:
        if kv_events is not None:
            kv_events.close()


async def _serve(args: argparse.Namespace, app: Any, events: str) -> None:
    import uvicorn

    from jaxkv.server.header_timeout import header_timeout_protocol
    from jaxkv.serving.async_engine import AsyncEngine, EngineDeadError
    from jaxkv.serving.engine import freeze_heap

    engine = AsyncEngine(app.state.build_engine, max_requests=args.max_requests)
    try:
        built = await engine.ready()
    except EngineDeadError as err:
        # the engine thread ends before the process does: a daemon thread still unwinding
        # JAX's C++ at interpreter exit aborts the process (SIGABRT) instead of exit status 2
        await engine.close()
        fail(str(err))
    app.state.engine = engine
    freeze_heap()  # this process serves this engine for its life: no full collection walks the start-up heap again
    if args.api_key is None and args.host not in LOOPBACK and not args.host.startswith("127."):
        print(f"{PROG}: warning: serving on {args.host} beyond loopback without --api_key", file=sys.stderr)
    log_level = "info" if args.access_log else "warning"
    http = header_timeout_protocol(args.header_timeout_s)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level=log_level, access_log=args.access_log, http=http)
    )
    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    if server.started:
        config = built.manager.config
        print(
            f"{PROG}: ready on http://{args.host}:{args.port}: model {app.state.config.model_name}, "
            f"max_model_len {args.max_model_len}, {config.num_blocks} blocks in {len(config.groups)} groups "
            f"({args.memory:,} B){host_tier(built)}{events}",
            flush=True,
        )
    await serving
    if not server.started:
        fail(f"cannot serve on {args.host}:{args.port} (see uvicorn's message above)")


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        fail("the server needs its extra: pip install 'jaxkv[server]'")
    asyncio.run(serve(args))
