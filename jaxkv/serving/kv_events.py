"""KV cache events on the wire, as vLLM servers publish them, so that a KV-aware router
written for vLLM follows a jaxkv server unchanged.

The wire format (facts from vLLM's ``vllm/distributed/kv_events.py`` and
``vllm/v1/core/kv_cache_utils.py``, checked against the vLLM 0.33.0 release):

- Transport: ZeroMQ. A PUB socket sends one three-frame message per batch: the topic
  (UTF-8, empty by default), the batch's sequence number as 8 bytes big-endian (0, 1,
  2, ... counted per publisher) and the msgpack payload. A batch holds the events of
  one scheduler step; steps without events publish nothing.
- Payload: a msgspec struct ``EventBatch`` encoded as an array (``array_like``):
  ``[ts, events, data_parallel_rank]``, ``ts`` a float in seconds since the epoch, the
  rank set by the publisher (0 without data parallelism).
- Events: msgspec structs tagged by class name (``tag=True``: the key ``"type"``),
  encoded as maps, fields still at their default left out (``omit_defaults``).
  ``BlockStored``: ``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``lora_id``, ``medium``, ``lora_name``, then the defaulted
  ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``,
  ``kv_cache_spec_sliding_window``, ``locality``, ``ownership``, ``session_id``,
  ``lookahead_token_ids`` (the last four new in 0.33; jaxkv leaves them at None, but
  declares them: msgspec writes a 16-bit map header for a struct of 16 fields, so the
  bytes match vLLM's). ``BlockRemoved``: ``block_hashes``, ``medium``, then the
  defaulted ``group_idx``, ``locality``, ``ownership`` (one event per removed hash).
  ``AllBlocksCleared``: no field, on a prefix-cache reset. (Releases from before
  ``extra_keys`` and ``group_idx`` encoded the events as arrays too.)
- Block hashes: vLLM hashes blocks to bytes and publishes by default the low 64 bits
  as an unsigned int (the bytes read big-endian, masked to 64 bits); with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` the bytes themselves. A stored run's
  parent is the hash of the block before its first, None at the start of a request.
- Medium: ``"GPU"`` for the device cache. Host (CPU offloading) blocks are published
  as ``"CPU"``, without parent or token ids (jaxkv adds them where it knows them: a
  router that indexes blocks by their tokens can then credit the host tier).
- Replay: an optional ROUTER socket. A client (REQ, or DEALER sending an empty
  delimiter frame first) sends the first sequence number it wants as 8 bytes
  big-endian; the server answers with one message ``[topic, sequence number,
  payload]`` per batch it still buffers from there on (the live frames; releases
  before 0.33 left the topic out), then the end marker ``[b"", -1 as 8 signed
  big-endian bytes, b""]`` (an empty third frame, exactly as vLLM sends it).
  Requests of another shape are ignored. The buffer holds
  the last ``buffer_steps`` batches (10,000 by default); older ones are not sent, and
  nothing says so: a client sees the first sequence number it gets back. A start
  past the newest batch (any unsigned 64-bit value) gets the end marker alone.
- Numbering: from 0 per publisher, as vLLM does. A publisher restarted on the same
  endpoint starts again from 0: a subscriber sees the sequence numbers fall, which
  vLLM's routers (and :class:`jaxkv.fleet.prefix_index.KVEventSubscriber`) read as a
  restart; a router started after the replicas cached asks for a replay from 0 and
  gets the whole buffer.

jaxkv publishes the device pools' events as medium ``"GPU"`` whatever the accelerator,
and the host tier's as ``"CPU"``. For a model with recurrent layers it publishes by
default what a hit can use (:mod:`jaxkv.serving.state_aware_events`: attention blocks
announced once a state checkpoint lets a prompt resume on their chain, withdrawn when
none does, with no ``group_idx``), so a KV-event router credits only chains a prompt
can resume on; its host tier's ``"CPU"`` events then announce the chains a hit can use
with the host tier's help (:class:`~jaxkv.serving.state_aware_events.HostTierEvents`:
chains with parents and token ids, no group, a superset of the ``"GPU"`` chains);
``state_aware=False`` publishes every group's blocks and checkpoints as
the manager records them, each with its ``group_idx`` (as attention-only models always
are). ZeroMQ (pyzmq) and msgspec are the optional extra ``jaxkv[events]``: only this
module, :mod:`jaxkv.fleet.prefix_index` and the routing modules
(:mod:`jaxkv.fleet.protocol`, :mod:`jaxkv.fleet.replica`, :mod:`jaxkv.fleet.router`)
import them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jaxkv.errors import JaxkvError, raise_missing_extra

try:  # the events extra: one error naming it, not a bare ModuleNotFoundError
    import msgspec
    import zmq
except ModuleNotFoundError as err:
    raise_missing_extra(err, ("msgspec", "zmq"), "KV events need pyzmq and msgspec: pip install 'jaxkv[events]'")

from jaxkv.core.pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from jaxkv.offload.catalog import KeysRemoved, KeysStored, OffloadEvent, OffloadKey
from jaxkv.offload.persistent import BlockInfo
from jaxkv.serving.state_aware_events import HostTierEvents, StateAwareEvents
from jaxkv.serving.zmq_security import CurveKeys, SecureContext, check_endpoint

if TYPE_CHECKING:
    from jaxkv.core.manager import KVCacheManager
    from jaxkv.serving.offload_connector import OffloadConnector

MEDIUM_DEVICE = "GPU"
"""vLLM's word for the device cache (any accelerator)."""
MEDIUM_HOST = "CPU"
"""vLLM's word for the host-memory tier."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence-number frame closing a replay answer."""
_MASK_64 = (1 << 64) - 1

ExternalBlockHash = int | bytes


class KVEventsError(JaxkvError, ValueError):
    """A publisher or subscriber was given settings it cannot use; nothing was opened."""


class WireEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A KV cache event as vLLM encodes it (a map tagged with ``"type"``)."""


class WireBlockStored(WireEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class WireBlockRemoved(WireEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class WireAllBlocksCleared(WireEvent, tag="AllBlocksCleared"):
    pass


AnyWireEvent = WireBlockStored | WireBlockRemoved | WireAllBlocksCleared
"""One event of a batch: the tagged union a batch is decoded into."""


class WireEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: the events of one engine step."""

    ts: float
    events: list[AnyWireEvent]
    data_parallel_rank: int | None = None


def external_hash(block_hash: bytes, *, as_int: bool = True) -> ExternalBlockHash:
    """The hash a router sees: the low 64 bits of ``block_hash`` as an unsigned int
    (vLLM's default), or the bytes themselves."""
    return int.from_bytes(block_hash, "big") & _MASK_64 if as_int else bytes(block_hash)


def wire_events(
    device: Iterable[KVCacheEvent],
    host: Iterable[OffloadEvent] = (),
    block_sizes: Sequence[int] = (),
    *,
    int_hashes: bool = True,
    include_token_ids: bool = True,
    device_group_idx: bool = True,
    host_chain: Iterable[KVCacheEvent] = (),
    host_info: Callable[[OffloadKey], BlockInfo | None] | None = None,
) -> list[AnyWireEvent]:
    """The wire form of one step's events: the device pools' (medium ``"GPU"``), then the
    host tier's (``"CPU"``, one event per run of keys of one group; ``block_sizes`` gives
    each group's block size), then ``host_chain``: state-aware events of the chains a hit
    can use with the host tier (``"CPU"``, no group, with parents and token ids; a reset
    in it is left out, the device's goes out). ``host_info(key)`` gives a stored host
    key's parent and token ids where known (the connector's
    :meth:`~jaxkv.serving.offload_connector.OffloadConnector.host_block_info`): such a key
    goes out as an event of its own carrying them, which a router indexing blocks by
    their tokens needs. ``include_token_ids=False`` leaves stored blocks' token ids out;
    ``device_group_idx=False`` the device events' group (a single-group view:
    state-aware events)."""

    def ext(h: bytes) -> ExternalBlockHash:
        return external_hash(h, as_int=int_hashes)

    out: list[AnyWireEvent] = []
    chains = [(e, MEDIUM_DEVICE, device_group_idx) for e in device]
    chains += [(e, MEDIUM_HOST, False) for e in host_chain if not isinstance(e, AllBlocksCleared)]
    for e, medium, with_group in chains:
        group_idx = e.group if with_group and not isinstance(e, AllBlocksCleared) else None
        if isinstance(e, BlockStored):
            out.append(
                WireBlockStored(
                    block_hashes=[ext(h) for h in e.block_hashes],
                    parent_block_hash=None if e.parent_block_hash is None else ext(e.parent_block_hash),
                    token_ids=list(e.token_ids) if include_token_ids else [],
                    block_size=e.block_size,
                    lora_id=None,
                    medium=medium,
                    lora_name=e.lora_name,
                    group_idx=group_idx,
                )
            )
        elif isinstance(e, BlockRemoved):
            out.append(WireBlockRemoved([ext(h) for h in e.block_hashes], medium, group_idx=group_idx))
        elif isinstance(e, AllBlocksCleared):
            out.append(WireAllBlocksCleared())
    for change in host:
        for group, keys in itertools.groupby(change.keys, key=lambda k: k[1]):
            hashes = []
            for key in keys:
                h = key[0]
                assert isinstance(h, bytes)  # the offload connector keys its host tier by block hash
                info = host_info(key) if host_info is not None and isinstance(change, KeysStored) else None
                if info is None:
                    hashes.append(ext(h))
                    continue
                parent, tokens = info
                out.append(
                    WireBlockStored(
                        [ext(h)],
                        None if parent is None else ext(parent),
                        list(tokens) if include_token_ids else [],
                        block_sizes[group],
                        None,
                        MEDIUM_HOST,
                        None,
                        group_idx=group,
                    )
                )
            if not hashes:
                continue
            if isinstance(change, KeysStored):
                out.append(
                    WireBlockStored(hashes, None, [], block_sizes[group], None, MEDIUM_HOST, None, group_idx=group)
                )
            elif isinstance(change, KeysRemoved):
                out.append(WireBlockRemoved(hashes, MEDIUM_HOST, group_idx=group))
    return out


@dataclass(frozen=True)
class _Transforms:
    """A state-aware publisher's transforms of one manager's events: the device's alone,
    and the device's with the host tier's (None: published as recorded)."""

    manager: KVCacheManager
    device: StateAwareEvents | None
    with_host: HostTierEvents | None


class KVEventPublisher:
    """Publishes batches of KV events over ZeroMQ as a vLLM server does, with replay.

    Binds ``endpoint`` (PUB) and, if given, ``replay_endpoint`` (ROUTER), e.g.
    ``ipc:///run/jaxkv/r0-events``; a ``*`` port takes a free one (read the bound
    address back from :attr:`endpoint` / :attr:`replay_endpoint`). :meth:`publish` runs
    on the caller's thread (the engine's); a background thread
    answers replay requests from the last ``buffer_steps`` batches, all of them (the
    replay socket's send queue holds a whole buffer per client). The replay thread
    never waits on a client: a send that would block (a client that does not read,
    its queue full) or fails abandons that answer (the client sees no end marker and
    asks again), and no request, whatever its bytes, ends the thread (a failure is
    counted in :attr:`num_failed_replays`). ``int_block_hashes=False``
    publishes block hashes as bytes; ``include_token_ids=False`` leaves token ids out.
    ``curve`` / ``plaintext_tcp``: see :class:`~jaxkv.serving.zmq_security.SecureContext`.
    ``idle_batch_s`` (with a replay socket): after that many seconds without a batch,
    the replay thread publishes an empty one, so a subscriber that joined late learns
    the stream's position and replays what it missed (vllm-router 0.1.17 replays only
    on a gap it sees live: a replica idle since the router started stays unknown to
    it otherwise). :meth:`publish` and that thread share the PUB socket under a lock.
    ``state_aware`` (default True): :meth:`publish_step` publishes a hybrid model's
    events through :class:`~jaxkv.serving.state_aware_events.StateAwareEvents` (what a hit
    can use); False publishes its groups' events as recorded. Attention-only models are
    published as recorded either way. Close it (or use it as a context manager).
    """

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int = 0,
        int_block_hashes: bool = True,
        include_token_ids: bool = True,
        hwm: int = 100_000,
        curve: CurveKeys | None = None,
        plaintext_tcp: bool = False,
        idle_batch_s: float | None = None,
        state_aware: bool = True,
    ) -> None:
        check_endpoint("endpoint", endpoint)
        if idle_batch_s is not None and (
            isinstance(idle_batch_s, bool) or not isinstance(idle_batch_s, (int, float)) or not idle_batch_s > 0
        ):
            raise KVEventsError(f"idle_batch_s must be a positive number or None, got {idle_batch_s!r}")
        if idle_batch_s is not None and replay_endpoint is None:
            raise KVEventsError("idle_batch_s needs a replay_endpoint (an idle batch only tells of batches to replay)")
        if replay_endpoint is not None:
            check_endpoint("replay_endpoint", replay_endpoint)
        if not isinstance(topic, str):
            raise KVEventsError(f"topic must be a str, got {topic!r}")
        for name, value, low in (("buffer_steps", buffer_steps, 1), ("data_parallel_rank", data_parallel_rank, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise KVEventsError(f"{name} must be an int >= {low}, got {value!r}")
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.int_block_hashes = int_block_hashes
        self.include_token_ids = include_token_ids
        self.state_aware = state_aware
        self._state_aware: _Transforms | None = None
        self._secure = SecureContext(curve, plaintext_tcp=plaintext_tcp)
        self._replay: zmq.Socket | None = None
        try:
            self._pub: zmq.Socket = self._secure.bind(zmq.PUB, "endpoint", endpoint)
        except BaseException:
            self._secure.term()
            raise
        try:
            self._pub.set_hwm(hwm)
            if replay_endpoint is not None:
                # a whole buffer and its end marker queue up per client; past that a send
                # raises at once (ROUTER_MANDATORY, non-blocking sends) and the answer is dropped
                self._replay = self._secure.bind(
                    zmq.ROUTER, "replay_endpoint", replay_endpoint, SNDHWM=buffer_steps + 2, ROUTER_MANDATORY=1
                )
        except BaseException:
            self._close_sockets()
            raise
        self._topic = topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._lock = threading.Lock()  # the buffer, the numbering and the PUB socket, shared with the replay thread
        self.idle_batch_s = idle_batch_s
        self._last_publish = time.monotonic()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self.num_bad_replay_requests = 0
        self.num_failed_replays = 0
        self._stop = threading.Event()
        self._thread = None
        if self._replay is not None:
            self._thread = threading.Thread(
                target=self._serve_replays, args=(self._replay,), name="kv-events-replay", daemon=True
            )
            self._thread.start()

    # ------------------------------------------------------------- queries
    @property
    def endpoint(self) -> str:
        """The bound PUB address (a ``*`` port resolved)."""
        return self._pub.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def replay_endpoint(self) -> str | None:
        """The bound ROUTER address, None without replay."""
        return None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def num_published(self) -> int:
        """Batches published so far."""
        return self._next_seq

    @property
    def next_seq(self) -> int:
        """The next batch's sequence number."""
        return self._next_seq

    @property
    def closed(self) -> bool:
        return self._pub.closed

    # ---------------------------------------------------------- publishing
    def publish(self, events: Sequence[AnyWireEvent]) -> int:
        """Publish ``events`` as one batch; its sequence number."""
        if self.closed:
            raise KVEventsError("the publisher is closed")
        batch = WireEventBatch(ts=time.time(), events=list(events), data_parallel_rank=self.data_parallel_rank)
        payload = self._encoder.encode(batch)
        with self._lock:
            seq = self._next_seq
            self._buffer.append((seq, payload))  # before the send: a replay never lacks what went out live
            self._next_seq += 1
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._last_publish = time.monotonic()
        return seq

    def publish_step(self, manager: KVCacheManager, connector: OffloadConnector | None = None) -> int | None:
        """Publish what the manager's pools (and the connector's host tier) did since the
        last call as one batch; its sequence number, or None when nothing happened.

        The manager must record events (``enable_events=True``); so must the host
        catalogs (an :class:`~jaxkv.serving.offload_connector.OffloadConnector` made by
        ``create`` for such a manager does). A state-aware publisher follows one manager,
        and its host tier if any, from its first step on (another manager, or a host tier
        that was not there at the first step, is refused); the host tier's events go out
        state-aware too (what a hit can use with the host tier's help:
        :class:`~jaxkv.serving.state_aware_events.HostTierEvents`).
        """
        transforms = self._transforms_for(manager, connector)
        device = manager.take_events()
        host = connector.take_events() if connector is not None else []
        host_chain: list[KVCacheEvent] = []
        if transforms.device is not None:
            device_out = transforms.device.apply(device)
            if transforms.with_host is not None:
                host_chain = transforms.with_host.apply(device, device_out, host)
                host = []
            device = device_out
        events = wire_events(
            device,
            host,
            manager.block_sizes,
            int_hashes=self.int_block_hashes,
            include_token_ids=self.include_token_ids,
            device_group_idx=transforms.device is None,
            host_chain=host_chain,
            host_info=connector.host_block_info if connector is not None and host else None,
        )
        return self.publish(events) if events else None

    def _transforms_for(self, manager: KVCacheManager, connector: OffloadConnector | None) -> _Transforms:
        """The state-aware transforms of ``manager``'s events (none: publish as recorded)."""
        if not self.state_aware:
            return _Transforms(manager, None, None)
        if self._state_aware is None:
            device = StateAwareEvents.for_config(manager.config)
            with_host = None
            if device is not None and connector is not None:
                with_host = HostTierEvents(device)
            self._state_aware = _Transforms(manager, device, with_host)
        elif self._state_aware.manager is not manager:
            raise KVEventsError("a state-aware publisher follows one manager; this step came from another")
        elif connector is not None and self._state_aware.device is not None and self._state_aware.with_host is None:
            raise KVEventsError(
                "a state-aware publisher follows a host tier from its first step on; this step brought one"
            )
        return self._state_aware

    # -------------------------------------------------------------- replay
    def _serve_replays(self, replay: zmq.Socket) -> None:
        while not self._stop.is_set():
            try:
                if replay.poll(50):
                    self._answer(replay, replay.recv_multipart())
            except Exception:  # whatever a client sent, the thread answers the next one
                self.num_failed_replays += 1
            if self.idle_batch_s is not None and time.monotonic() - self._last_publish >= self.idle_batch_s:
                self.publish([])

    def _answer(self, replay: zmq.Socket, frames: list[bytes]) -> None:
        """Stream the buffered batches from the requested sequence number (clamped to
        the buffer), then vLLM's end marker; a request of another shape
        is counted and ignored."""
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self.num_bad_replay_requests += 1
            return
        client, first = frames[0], int.from_bytes(frames[2], "big")
        with self._lock:
            oldest = self._buffer[0][0] if self._buffer else first
            skip = min(max(0, first - oldest), len(self._buffer))
            batches = list(itertools.islice(self._buffer, skip, None))
        try:
            for seq, payload in batches:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            replay.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
        except zmq.ZMQError:  # the client left or its queue is full: it sees no end marker and asks again
            self.num_failed_replays += 1

    # --------------------------------------------------------------- close
    def close(self, linger_s: float = 1.0) -> None:
        """Stop answering replays and close the sockets; batches already sent get up to
        ``linger_s`` seconds to leave."""
        if self.closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._close_sockets(linger_s)

    def _close_sockets(self, linger_s: float = 0.0) -> None:
        self._pub.close(linger=int(linger_s * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)
        self._secure.term()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
