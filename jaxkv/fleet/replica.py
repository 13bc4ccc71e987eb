"""A data-parallel replica: one :class:`~jaxkv.serving.engine.Engine` behind a ZeroMQ
request endpoint, publishing its KV events and heartbeats for a router
(:mod:`jaxkv.fleet.router`).

A replica binds four sockets, named by a :class:`ReplicaAddress`:

- ``requests`` (ROUTER): a client (a DEALER) sends :class:`GenerateRequest`,
  :class:`CancelRequest` or :class:`ResetPrefixCache` messages; the replica answers
  each request with a :class:`GenerateResult`, a :class:`GenerateFailure` or a
  :class:`CacheReset`. Requests are added to the engine as they arrive and join the
  running batch at the next step (continuous batching: :meth:`Engine.add_request` /
  :meth:`Engine.step`); a cancel aborts one (:meth:`Engine.abort`). A request over
  the size limit is answered with a failure naming it (its prompt never decoded);
  multi-frame and undecodable messages are refused; none of them stops the loop or
  drops the client's connection.
- ``heartbeats`` (PUB): a :class:`Heartbeat` with the replica's load (running +
  waiting requests, as of the last step), its step count, whether it is busy and its
  request limits,
  every ``heartbeat_interval_s``, from a thread of its own: a long step (a big
  prefill on a busy host) is not read as death, while a replica that is killed or
  closed falls silent, and one whose step hangs shows no progress. Each beat also
  says whether the serving thread is inside JAX's tracing, lowering or compiling
  (read from that thread's stack as the beat is sent: :func:`thread_is_compiling`),
  so a router counts a first step that compiles for longer than its hang timeout as
  progress, not a hang.
- ``events`` (PUB) and ``replay`` (ROUTER): the engine's KV events in vLLM's format
  (:class:`~jaxkv.serving.kv_events.KVEventPublisher`).

The addresses and messages are :mod:`jaxkv.fleet.protocol`.
:func:`running_replicas` runs :func:`serve_replica` in child processes
(``python -m jaxkv.fleet.replica SPEC_JSON``); a child compiles every step shape
before its first heartbeat, and exits when its parent dies, so no replica outlives
the program that started it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import secrets
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from jaxkv.errors import JaxkvError
from jaxkv.fleet.protocol import (
    CacheReset,
    CancelRequest,
    FromReplica,
    GenerateFailure,
    GenerateResult,
    Heartbeat,
    ReplicaAddress,
    RequestId,
    ResetPrefixCache,
    ToReplica,
    max_frame_bytes,
    max_request_bytes,
)
from jaxkv.ints import is_int
from jaxkv.serving.engine import Engine
from jaxkv.serving.kv_events import KVEventPublisher
from jaxkv.serving.outputs import RequestOutput
from jaxkv.serving.zmq_security import CurveKeys, SecureContext


class ReplicaError(JaxkvError, ValueError):
    """A replica was given settings it cannot use; nothing was started."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process serves: its name and address, the keyword arguments of
    :meth:`Engine.build` (JSON values) and its heartbeat interval. Its KV events carry
    the blocks' token ids, as vLLM's do (Dynamo's indexer and vllm-router's ``kv_aware``
    policy need them); ``include_token_ids=False`` leaves them out."""

    name: str
    address: ReplicaAddress
    engine: Mapping[str, Any]  # JSON values that Engine.build checks itself
    heartbeat_interval_s: float = 1.0
    include_token_ids: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ReplicaError(f"name must be a non-empty str, got {self.name!r}")
        interval = self.heartbeat_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0 < interval < float("inf"):
            raise ReplicaError(f"heartbeat_interval_s must be a positive number, got {interval!r}")
        if not isinstance(self.include_token_ids, bool):
            raise ReplicaError(f"include_token_ids must be a bool, got {self.include_token_ids!r}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ReplicaSpec:
        data = json.loads(text)
        return cls(
            data["name"],
            ReplicaAddress(**data["address"]),
            data["engine"],
            data["heartbeat_interval_s"],
            data.get("include_token_ids", True),
        )

    def publisher(self, *, curve: CurveKeys | None = None) -> KVEventPublisher:
        """The replica's KV event publisher, bound at its events and replay addresses."""
        return KVEventPublisher(
            self.address.events,
            replay_endpoint=self.address.replay,
            include_token_ids=self.include_token_ids,
            curve=curve,
        )


_COMPILE_MODULES = tuple(
    os.path.join("jax", "_src", *parts)
    for parts in (("compiler.py",), ("interpreters", "mlir.py"), ("interpreters", "partial_eval.py"))
)
"""Where JAX traces (partial_eval), lowers (mlir, with any Pallas/Mosaic kernel
lowered inside) and compiles (compiler) a jitted function: a thread with a frame in
one of them is making a step shape, not running one."""


def thread_is_compiling(thread_id: int) -> bool:
    """Whether thread ``thread_id`` is now inside JAX's tracing, lowering or
    compiling (False for a thread that is gone)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_COMPILE_MODULES):
            return True
        frame = frame.f_back
    return False


def warm_up(engine: Engine) -> None:
    """Compile every step shape of ``engine``'s default buckets (a prefill of the whole
    step budget and a decode), then forget what that cached."""
    length = min(engine.max_num_batched_tokens + 1, engine.manager.max_model_len - 2)
    engine.generate([[t % engine.model.vocab_size for t in range(length)]], 2)
    engine.reset_prefix_cache()


class Replica:
    """Serves requests from ``address.requests`` on ``engine`` until ``should_stop()``.

    The engine must publish to ``address.events`` (its ``kv_events``); the replica
    owns the request socket and a heartbeat thread. The serving loop runs on the
    engine's owner thread. Bounds: frames longer than
    :func:`~jaxkv.fleet.protocol.max_request_bytes` of the engine's ``max_model_len``
    are answered with a failure before their prompt is decoded (the socket reads up to
    :func:`~jaxkv.fleet.protocol.max_frame_bytes`); at most ``max_receive`` messages are taken between
    two steps (so a flood cannot starve stepping); past ``max_waiting`` queued
    requests a new one is refused with a failure. ``curve`` / ``plaintext_tcp``: see
    :class:`~jaxkv.serving.zmq_security.SecureContext`.
    """

    def __init__(
        self,
        name: str,
        engine: Engine,
        address: ReplicaAddress,
        *,
        heartbeat_interval_s: float,
        max_waiting: int | None = None,
        max_receive: int | None = None,
        curve: CurveKeys | None = None,
        plaintext_tcp: bool = False,
    ) -> None:
        self.name = name
        self.engine = engine
        self.max_waiting = 4 * engine.max_num_seqs if max_waiting is None else max_waiting
        self.max_receive = 2 * engine.max_num_seqs if max_receive is None else max_receive
        for what, value in (("max_waiting", self.max_waiting), ("max_receive", self.max_receive)):
            if not is_int(value) or value < 1:
                raise ReplicaError(f"{what} must be a positive int, got {value!r}")
        self.instance = secrets.token_hex(8)
        self.num_bad_messages = 0
        """Messages skipped: of other than two frames (identity, payload), undecodable, or over the size limit."""
        self._secure = SecureContext(curve, plaintext_tcp=plaintext_tcp)
        max_model_len = engine.manager.max_model_len
        self.max_request_bytes = max_request_bytes(max_model_len)
        self._requests = self._secure.bind(
            zmq.ROUTER, "requests", address.requests, MAXMSGSIZE=max_frame_bytes(max_model_len), ROUTER_HANDOVER=1
        )
        self._decoder = msgspec.msgpack.Decoder(ToReplica)
        self._id_decoder = msgspec.msgpack.Decoder(RequestId)
        self._encoder = msgspec.msgpack.Encoder()
        self._clients: dict[str, tuple[bytes, str]] = {}  # engine request id -> (client identity, its request id)
        self._load = 0  # running + waiting, written by the serving loop, read by the heartbeat thread
        self._steps = 0
        self._busy = False
        self._serving_thread: int | None = None  # the thread in serve(), whose stack the beats read
        self._closed = threading.Event()
        heartbeats = self._secure.bind(zmq.PUB, "heartbeats", address.heartbeats)
        self._heartbeat = threading.Thread(
            target=self._beat, args=(heartbeats, heartbeat_interval_s), name=f"{name}-heartbeat", daemon=True
        )
        self._heartbeat.start()

    def serve(self, should_stop: Callable[[], bool]) -> None:
        """The serving loop: take what arrived (waiting up to 50 ms when idle), run one
        engine step."""
        self._serving_thread = threading.get_ident()
        while not should_stop():
            if self._requests.poll(0 if self.engine.has_unfinished else 50):
                self._receive()
            self._busy = self.engine.has_unfinished
            if self._busy:
                self._step()
            self._load = self.engine.num_running + self.engine.num_waiting
            self._busy = self.engine.has_unfinished

    def close(self) -> None:
        """Stop heartbeating and close the sockets (answers already sent get 1 s to leave)."""
        self._closed.set()
        self._heartbeat.join()
        self._requests.close(linger=1000)
        self._secure.term()

    def _beat(self, socket: zmq.Socket, interval_s: float) -> None:
        encoder = msgspec.msgpack.Encoder()  # the loop's encoder is not for this thread
        try:
            for seq in itertools.count():
                beat = Heartbeat(
                    self.name,
                    seq,
                    self._load,
                    self._steps,
                    self._busy,
                    self.instance,
                    self.engine.max_num_seqs,
                    self.engine.max_num_batched_tokens,
                    self.engine.manager.max_model_len,
                    self.max_request_bytes,
                    self._serving_thread is not None and thread_is_compiling(self._serving_thread),
                )
                socket.send(encoder.encode(beat))
                if self._closed.wait(interval_s):
                    return
        finally:
            socket.close(linger=0)

    def _receive(self) -> None:
        for _ in range(self.max_receive):
            if not self._requests.poll(0):
                return
            frames = self._requests.recv_multipart()
            if len(frames) != 2:
                self.num_bad_messages += 1
                continue
            client, payload = frames
            if len(payload) > self.max_request_bytes:
                self.num_bad_messages += 1
                self._send(client, GenerateFailure(self._request_id(payload), self.name, self._over_limit(payload)))
                continue
            try:
                message = self._decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                self.num_bad_messages += 1
                self._send(client, GenerateFailure("", self.name, f"refused: undecodable request: {err}"))
                continue
            self._handle(client, message)

    def _request_id(self, payload: bytes) -> str:
        """The request id of a frame not otherwise decoded ("" when it has none)."""
        try:
            return self._id_decoder.decode(payload).request_id
        except (msgspec.DecodeError, msgspec.ValidationError):
            return ""

    def _over_limit(self, payload: bytes) -> str:
        return (
            f"refused: a request of {len(payload)} bytes exceeds max_request_bytes={self.max_request_bytes} "
            f"(max_model_len={self.engine.manager.max_model_len})"
        )

    def _handle(self, client: bytes, message: ToReplica) -> None:
        key = f"{client.hex()}:{message.request_id}"  # each client's ids apart from the others'
        if isinstance(message, ResetPrefixCache):
            self._send(client, CacheReset(message.request_id, self.name, self.engine.reset_prefix_cache()))
            return
        if isinstance(message, CancelRequest):
            if self._clients.pop(key, None) is not None:  # not answered: the client answered it itself
                self.engine.abort(key)
            return
        if key in self._clients:
            self._send(client, GenerateFailure(message.request_id, self.name, "refused: request id already in flight"))
            return
        if self.engine.num_waiting >= self.max_waiting:
            self._send(
                client,
                GenerateFailure(message.request_id, self.name, f"refused: {self.max_waiting} requests already waiting"),
            )
            return
        try:
            self.engine.add_request(
                message.prompt_token_ids, message.max_new_tokens, cache_salt=message.cache_salt, request_id=key
            )
        except JaxkvError as err:
            self._send(client, GenerateFailure(message.request_id, self.name, f"refused: {err}"))
            return
        self._clients[key] = (client, message.request_id)

    def _step(self) -> None:
        try:
            step = self.engine.step()
        except JaxkvError as err:  # the engine dropped every unfinished request
            for client, rid in self._clients.values():
                self._send(client, GenerateFailure(rid, self.name, f"step failed: {err}"))
            self._clients.clear()
            return
        finally:
            self._steps += 1
        for out in step.finished:
            client, rid = self._clients.pop(out.request_id)
            self._send(client, self._result(rid, out))

    def _result(self, request_id: str, out: RequestOutput) -> GenerateResult:
        return GenerateResult(request_id, self.name, list(out.output_token_ids), out.ttft_s, out.num_cached_tokens)

    def _send(self, client: bytes, message: FromReplica) -> None:
        self._requests.send_multipart((client, self._encoder.encode(message)))


def serve_replica(spec: ReplicaSpec, should_stop: Callable[[], bool], *, curve: CurveKeys | None = None) -> None:
    """Build the spec's engine with a KV event publisher, compile it, and serve
    (``curve``: the deployment's keys; None reads ``JAXKV_CURVE_DIR``)."""
    with spec.publisher(curve=curve) as events:
        engine = Engine.build(**spec.engine, kv_events=events)
        warm_up(engine)
        replica = Replica(spec.name, engine, spec.address, heartbeat_interval_s=spec.heartbeat_interval_s, curve=curve)
        try:
            replica.serve(should_stop)
        finally:
            replica.close()


@contextlib.contextmanager
def running_replicas(
    specs: Iterable[ReplicaSpec], *, env: Mapping[str, str] | None = None
) -> Iterator[dict[str, subprocess.Popen]]:
    """Start each spec in a child process (``env``: extra environment variables, e.g.
    ``XLA_FLAGS``); yields name -> process and kills every one that still runs on
    exit, whatever the exit. A child also exits by itself when this process dies."""
    package_root = str(Path(__file__).resolve().parents[2])  # this jaxkv, whatever the child's cwd
    path = os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH"))))
    child_env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    processes: dict[str, subprocess.Popen] = {}
    try:
        for spec in specs:
            cmd = [sys.executable, "-m", "jaxkv.fleet.replica", spec.to_json()]
            processes[spec.name] = subprocess.Popen(cmd, env=child_env)
        yield processes
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
        for process in processes.values():
            process.wait()


def _main(argv: list[str]) -> None:
    spec = ReplicaSpec.from_json(argv[1])
    parent = os.getppid()
    serve_replica(spec, should_stop=lambda: os.getppid() != parent)


if __name__ == "__main__":
    _main(sys.argv)
