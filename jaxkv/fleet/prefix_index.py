"""The router's side of KV events: which replicas hold which blocks, on which medium.

:class:`PrefixIndex` maps a block hash (as published: see :mod:`jaxkv.serving.kv_events`)
to the ``(replica, medium)`` pairs holding it, from decoded event batches; a router
over data-parallel replicas asks it how long a prompt's cached prefix is on each
replica. It counts copies: a replica may cache one hash in several blocks (every
computed copy is cached, as in vLLM), and a hash leaves a replica's medium only when
its last copy is removed. ``AllBlocksCleared`` drops a replica's device entries: the
device prefix cache was reset, the host tier was not.

:class:`KVEventSubscriber` follows one replica's publisher into an index: it applies
batches in sequence order, skips those it already has, and on a gap asks the replay
socket for the missing ones. The replay runs beside the live stream: :meth:`poll`
never waits on it (live batches that arrive meanwhile are held, then applied after
the replayed ones), so a slow or mute replay socket never stalls its caller. A replay
unanswered for ``replay_timeout_s`` is abandoned: the subscriber takes its position
from the live batches, asks no replay for a back-off that doubles with each timeout,
and raises :class:`ReplayTimeoutError`. A gap the publisher no longer buffers cannot be
filled: the subscriber drops the replica's entries (the index then under-reports that
replica, never over-reports), goes on from the oldest batch still there, and raises
:class:`EventGapError` naming what was lost. A publisher restarted on the same endpoint
(its sequence numbers fall back to 0, see :mod:`jaxkv.serving.kv_events`) is followed
from its first batch, the dead cache's entries dropped first: a live batch numbered at
or below the last live one can only come from a new publisher (one publisher's live
stream rises). A live batch below the position but above the last live one is a
duplicate of a replayed batch and is skipped. Batches that do not decode are counted and
skipped.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq

from jaxkv.errors import JaxkvError
from jaxkv.serving.kv_events import (
    END_SEQ,
    MEDIUM_DEVICE,
    ExternalBlockHash,
    KVEventsError,
    WireAllBlocksCleared,
    WireBlockRemoved,
    WireBlockStored,
    WireEvent,
    WireEventBatch,
)
from jaxkv.serving.zmq_security import CurveKeys, SecureContext, check_endpoint

Location = tuple[Hashable, str]
"""(replica, medium)."""


class EventGapError(JaxkvError):
    """Batches ``[missing_from, resumed_at)`` of a replica are lost (no longer buffered,
    or no replay socket): its entries were dropped and the subscriber goes on from
    ``resumed_at``."""

    def __init__(self, replica: Hashable, missing_from: int, resumed_at: int, why: str) -> None:
        super().__init__(f"replica {replica!r}: batches {missing_from}..{resumed_at - 1} are lost ({why})")
        self.replica = replica
        self.missing_from = missing_from
        self.resumed_at = resumed_at


class ReplayTimeoutError(JaxkvError):
    """The replay socket did not answer in time: the replay was abandoned, the live
    batches held meanwhile applied (the gap before them lost), and no replay is asked
    for a back-off."""


MAX_REPLAY_BACKOFF_S = 60.0
"""The longest a subscriber waits, after replay timeouts, before asking again."""


@dataclass(eq=False)
class _PendingReplay:
    """A replay asked for and not yet answered in full."""

    deadline: float
    """When it is abandoned (pushed back by every frame that arrives)."""
    batches: list[tuple[int, bytes]] = field(default_factory=list)
    held: list[tuple[int, bytes]] = field(default_factory=list)
    """Live batches received meanwhile, applied after the replayed ones."""


class PrefixIndex:
    """Block hash -> the ``(replica, medium)`` pairs caching it, kept from KV events."""

    def __init__(self) -> None:
        # replica -> medium -> hash -> copies per group
        self._held: dict[Hashable, dict[str, dict[ExternalBlockHash, Counter]]] = {}

    def apply(self, replica: Hashable, events: Iterable[WireEvent]) -> None:
        """Apply one replica's events in order. A removal of what the index does not
        hold (a replica followed from the middle of its stream) changes nothing."""
        media = self._held.setdefault(replica, {})
        for e in events:
            if isinstance(e, WireBlockStored):
                held = media.setdefault(e.medium or MEDIUM_DEVICE, {})
                for h in e.block_hashes:
                    held.setdefault(h, Counter())[e.group_idx] += 1
            elif isinstance(e, WireBlockRemoved):
                held = media.get(e.medium or MEDIUM_DEVICE, {})
                for h in e.block_hashes:
                    copies = held.get(h)
                    if copies is None or not copies[e.group_idx]:
                        continue
                    copies[e.group_idx] -= 1
                    if not copies[e.group_idx]:
                        del copies[e.group_idx]
                        if not copies:
                            del held[h]
            elif isinstance(e, WireAllBlocksCleared):
                media.pop(MEDIUM_DEVICE, None)

    def drop_replica(self, replica: Hashable) -> None:
        """Forget everything about ``replica`` (it left, or its stream has a hole)."""
        self._held.pop(replica, None)

    def locations(self, block_hash: ExternalBlockHash) -> frozenset[Location]:
        """Where ``block_hash`` is cached."""
        return frozenset(
            (replica, medium)
            for replica, media in self._held.items()
            for medium, held in media.items()
            if block_hash in held
        )

    def longest_prefix(
        self, block_hashes: Sequence[ExternalBlockHash], medium: str | None = None
    ) -> dict[Hashable, int]:
        """Per replica, how many leading ``block_hashes`` it caches (on ``medium``, or on
        any medium: a prefix may run on from device blocks into host blocks)."""
        out = {}
        for replica, media in self._held.items():
            tiers = [held for m, held in media.items() if medium is None or m == medium]
            n = 0
            while n < len(block_hashes) and any(block_hashes[n] in held for held in tiers):
                n += 1
            out[replica] = n
        return out

    def snapshot(self) -> dict[ExternalBlockHash, frozenset[Location]]:
        """Every cached hash and where it is (for comparisons and debugging)."""
        out: dict[ExternalBlockHash, set[Location]] = {}
        for replica, media in self._held.items():
            for medium, held in media.items():
                for h in held:
                    out.setdefault(h, set()).add((replica, medium))
        return {h: frozenset(where) for h, where in out.items()}

    def __len__(self) -> int:
        """Distinct hashes cached anywhere."""
        return len(self.snapshot())


class KVEventSubscriber:
    """Follows one replica's KV event publisher into a :class:`PrefixIndex`.

    Connects a SUB socket to ``endpoint`` and, for gaps, a DEALER socket to
    ``replay_endpoint`` (vLLM's replay protocol); ``replay_timeout_s`` bounds the
    wait for a replay answer (see the module docstring). :meth:`poll` applies what has
    arrived; :meth:`start_catch_up` asks for what was published since the last applied
    batch without waiting for a live one to reveal the gap (the answer is applied by
    later polls), :meth:`catch_up` does so and waits for the answer (before reading the
    index at a moment that matters). ``curve`` / ``plaintext_tcp``: see
    :class:`~jaxkv.serving.zmq_security.SecureContext`. Single-threaded.
    """

    def __init__(
        self,
        index: PrefixIndex,
        replica: Hashable,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout_s: float = 5.0,
        curve: CurveKeys | None = None,
        plaintext_tcp: bool = False,
    ) -> None:
        self.endpoint = check_endpoint("endpoint", endpoint)
        self.replay_endpoint = None if replay_endpoint is None else check_endpoint("replay_endpoint", replay_endpoint)
        if not isinstance(topic, str):
            raise KVEventsError(f"topic must be a str, got {topic!r}")
        if not isinstance(replay_timeout_s, (int, float)) or not replay_timeout_s > 0:
            raise KVEventsError(f"replay_timeout_s must be a positive number, got {replay_timeout_s!r}")
        self._secure = SecureContext(curve, plaintext_tcp=plaintext_tcp)
        for name, value in (("endpoint", endpoint), ("replay_endpoint", replay_endpoint)):
            if value is not None:
                self._secure.check(name, value, bind=False)
        self.index = index
        self.replica = replica
        self.topic = topic
        self.replay_timeout_s = replay_timeout_s
        self.next_seq: int | None = None
        """The sequence number of the next batch to apply (None before the first)."""
        self.num_resyncs = 0
        """Publisher restarts followed (sequence numbers that fell)."""
        self._last_live: int | None = None
        self.num_bad_batches = 0
        """Batches (live or replayed) that did not decode, skipped."""
        self._decoder = msgspec.msgpack.Decoder(WireEventBatch)
        self._sub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._pending: _PendingReplay | None = None
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self.connect()

    # --------------------------------------------------------- connection
    @property
    def connected(self) -> bool:
        return self._sub is not None

    @property
    def replaying(self) -> bool:
        """Whether a replay was asked for and is not yet answered in full."""
        return self._pending is not None

    def connect(self) -> None:
        """Open the sockets (a no-op when connected); batches published while
        disconnected come back through the replay socket."""
        if self.connected:
            return
        self._sub = self._secure.connect(zmq.SUB, "endpoint", self.endpoint)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self._open_replay()

    def disconnect(self) -> None:
        """Close the sockets, keeping the index and the position in the stream (a
        replay in progress is abandoned, its held live batches with it)."""
        self._pending = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    def resync(self) -> None:
        """Forget the position in the stream, the replica's entries and any replay
        back-off, and reconnect: the next catch-up follows the stream from the oldest
        batch its publisher buffers (for a replica that comes back after it was
        dropped, or restarted)."""
        self.index.drop_replica(self.replica)
        self.next_seq = self._last_live = None
        self._backoff_s = self._retry_at = 0.0
        self.disconnect()
        self.connect()

    def close(self) -> None:
        self.disconnect()
        self._secure.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_replay(self) -> None:
        if self.replay_endpoint is not None:  # no receive limit: a replay brings a whole buffer
            self._replay = self._secure.connect(zmq.DEALER, "replay_endpoint", self.replay_endpoint, RCVHWM=0)

    # ----------------------------------------------------------- receiving
    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply the batches that arrived, live and replayed (waiting up to
        ``timeout_s`` until one is applied); how many were applied."""
        sub = self._connected_sub()
        deadline = time.monotonic() + timeout_s
        applied = 0
        while True:
            while sub.poll(0):
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.num_bad_batches += 1
                    continue
                seq = int.from_bytes(frames[1], "big")
                if self._last_live is not None and seq <= self._last_live:
                    self._follow_restart()
                self._last_live = seq
                applied += self._receive(seq, frames[2])
            applied += self._advance_replay()
            wait_s = deadline - time.monotonic()
            if applied or wait_s <= 0:
                return applied
            poller = zmq.Poller()
            poller.register(sub, zmq.POLLIN)
            if self._pending is not None and self._replay is not None:
                poller.register(self._replay, zmq.POLLIN)
            poller.poll(max(1, int(wait_s * 1000)))

    def start_catch_up(self) -> None:
        """Ask the replay socket for every batch from :attr:`next_seq` on (unless a
        replay is under way, or there is no replay socket); later polls apply the answer."""
        self._connected_sub()
        if self._pending is None and self._replay is not None:
            self._ask_replay(self.next_seq)

    def catch_up(self) -> int:
        """Ask the replay socket for every batch from :attr:`next_seq` on and wait for
        the answer; how many batches were applied."""
        self.start_catch_up()
        applied = 0
        while self._pending is not None and self._replay is not None:
            self._replay.poll(max(1, int((self._pending.deadline - time.monotonic()) * 1000)))
            applied += self._advance_replay()
        return applied

    def _follow_restart(self) -> None:
        """A new publisher on the endpoint: drop the dead cache's entries and any replay
        under way (its answer may mix both publishers) and follow the new one from 0."""
        self.num_resyncs += 1
        self.index.drop_replica(self.replica)
        if self._pending is not None and self._replay is not None:
            self._pending = None
            self._replay.close(linger=0)  # a late answer must not mix into the next one
            self._open_replay()
        self.next_seq = 0
        self._backoff_s = self._retry_at = 0.0

    def _connected_sub(self) -> zmq.Socket:
        if self._sub is None:
            raise KVEventsError(f"subscriber of replica {self.replica!r} is disconnected")
        return self._sub

    def _receive(self, seq: int, payload: bytes) -> int:
        """Apply a live batch, hold it while a replay runs, or start one for the gap
        before it (or, with no replay to ask, take the stream from it)."""
        if self._pending is not None:
            self._pending.held.append((seq, payload))
            return 0
        if self.next_seq is not None and seq < self.next_seq:
            return 0  # already applied (it came through a replay first)
        if self.next_seq is None or seq > self.next_seq:
            if self._replay is not None and time.monotonic() >= self._retry_at:
                self._ask_replay(self.next_seq)
                assert self._pending is not None
                self._pending.held.append((seq, payload))
                return 0
            missing_from = self.next_seq
            if missing_from is not None:
                self.index.drop_replica(self.replica)
            self._apply(seq, payload)
            if missing_from is not None:
                why = "no replay socket" if self._replay is None else "replays back off after a timeout"
                raise EventGapError(self.replica, missing_from, seq, why)
            return 1
        self._apply(seq, payload)
        return 1

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        try:
            batch = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.num_bad_batches += 1
            return
        self.index.apply(self.replica, batch.events)

    # -------------------------------------------------------------- replay
    def _ask_replay(self, start: int | None) -> None:
        """Ask for the batches from ``start`` on (None: from the oldest buffered)."""
        assert self._replay is not None
        self._replay.send_multipart((b"", (start or 0).to_bytes(8, "big")))
        self._pending = _PendingReplay(time.monotonic() + self.replay_timeout_s)

    def _advance_replay(self) -> int:
        """Take what the replay socket has, without waiting; once the end marker is in,
        apply the answer and the held live batches; abandon the replay past its deadline.
        How many batches were applied."""
        pending, replay = self._pending, self._replay
        if pending is None or replay is None:
            return 0
        while replay.poll(0):
            frames = replay.recv_multipart()  # with the topic frame first or (before vLLM 0.33) without
            pending.deadline = time.monotonic() + self.replay_timeout_s
            if len(frames) < 3 or len(frames[-2]) != 8:
                self.num_bad_batches += 1
                continue
            seq_bytes, payload = frames[-2], frames[-1]
            if seq_bytes == END_SEQ:
                self._pending, self._backoff_s, self._retry_at = None, 0.0, 0.0
                return self._settle(pending)
            pending.batches.append((int.from_bytes(seq_bytes, "big"), payload))
        if time.monotonic() < pending.deadline:
            return 0
        self._pending = None
        replay.close(linger=0)  # a late answer must not mix into the next one
        self._open_replay()
        self._backoff_s = min(MAX_REPLAY_BACKOFF_S, 2 * self._backoff_s or self.replay_timeout_s)
        self._retry_at = time.monotonic() + self._backoff_s
        with contextlib.suppress(EventGapError):  # the timeout is the news
            self._apply_held(pending.held)
        raise ReplayTimeoutError(
            f"replica {self.replica!r}: no replay answer from {self.replay_endpoint} within "
            f"{self.replay_timeout_s} s; following the live batches, no replay for {self._backoff_s:g} s"
        )

    def _settle(self, pending: _PendingReplay) -> int:
        """Apply a whole replay answer, then the live batches held meanwhile. Raises
        :class:`EventGapError` after applying what came back if batches are lost."""
        live = pending.held[0][0] if pending.held else None
        if self.next_seq is None:  # the first contact: from the oldest batch still buffered
            replayed = pending.batches
            self.next_seq = replayed[0][0] if replayed else live
        applied, lost_at = 0, None
        for seq, payload in pending.batches:
            if self.next_seq is None:
                self.next_seq = seq
            if seq < self.next_seq:
                continue
            if seq > self.next_seq and lost_at is None:
                lost_at = (self.next_seq, seq)
                self.index.drop_replica(self.replica)
            self._apply(seq, payload)
            applied += 1
        if self.next_seq is None:
            self.next_seq = live
        elif lost_at is None and live is not None and self.next_seq < live:
            lost_at = (self.next_seq, live)
            self.index.drop_replica(self.replica)
            self.next_seq = live
        gap = None if lost_at is None else EventGapError(self.replica, *lost_at, "no longer in the replay buffer")
        try:
            applied += self._apply_held(pending.held)
        except EventGapError as err:
            gap = gap or err
        if gap is not None:
            raise gap
        return applied

    def _apply_held(self, held: list[tuple[int, bytes]]) -> int:
        """Apply the live batches held during a replay, in order (the first gap among
        them, if any, raised after the rest is taken)."""
        applied, gap = 0, None
        for seq, payload in held:  # a gap among them starts another replay, which holds the rest
            try:
                applied += self._receive(seq, payload)
            except EventGapError as err:
                gap = gap or err
        if gap is not None:
            raise gap
        return applied
