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
socket for the missing ones. A gap the publisher no longer buffers cannot be filled:
the subscriber drops the replica's entries (the index then under-reports that replica,
never over-reports), goes on from the oldest batch still there, and raises
:class:`EventGapError` naming what was lost. A publisher restarted on the same endpoint
(a new epoch, see :mod:`jaxkv.serving.kv_events`) is followed from its first batch,
the dead cache's entries dropped first. Batches that do not decode are counted and
skipped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence

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
    """The replay socket did not answer in time; nothing was applied."""


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
    wait for a replay answer. :meth:`poll` applies what has arrived;
    :meth:`catch_up` asks for what was published since the last applied batch
    without waiting for a live one to reveal the gap (after :meth:`connect`, or
    before reading the index at a moment that matters). ``curve`` / ``plaintext_tcp``:
    see :class:`~jaxkv.serving.zmq_security.SecureContext`. Single-threaded.
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
        self.epoch: int | None = None
        """The publisher's epoch, from its last replay answer (None before one)."""
        self.num_resyncs = 0
        """Publisher restarts followed (a new epoch)."""
        self.num_bad_batches = 0
        """Batches (live or replayed) that did not decode, skipped."""
        self._decoder = msgspec.msgpack.Decoder(WireEventBatch)
        self._sub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self.connect()

    # --------------------------------------------------------- connection
    @property
    def connected(self) -> bool:
        return self._sub is not None

    def connect(self) -> None:
        """Open the sockets (a no-op when connected); batches published while
        disconnected come back through the replay socket."""
        if self.connected:
            return
        self._sub = self._secure.connect(zmq.SUB, "endpoint", self.endpoint)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self._open_replay()

    def disconnect(self) -> None:
        """Close the sockets, keeping the index and the position in the stream."""
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    def resync(self) -> None:
        """Forget the position in the stream and the replica's entries and reconnect:
        the next :meth:`catch_up` follows the stream from the oldest batch its
        publisher buffers (for a replica that comes back after it was dropped)."""
        self.index.drop_replica(self.replica)
        self.next_seq = self.epoch = None
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
        """Apply the batches that arrived (waiting up to ``timeout_s`` for the first);
        how many were applied, replayed ones included."""
        sub = self._sub
        if sub is None:
            raise KVEventsError(f"subscriber of replica {self.replica!r} is disconnected")
        applied = 0
        wait_ms = int(timeout_s * 1000)
        while sub.poll(wait_ms):
            frames = sub.recv_multipart()
            wait_ms = 0
            if len(frames) != 3 or len(frames[1]) != 8:
                self.num_bad_batches += 1
                continue
            applied += self._receive(int.from_bytes(frames[1], "big"), frames[2])
        return applied

    def catch_up(self) -> int:
        """Ask the replay socket for every batch from :attr:`next_seq` on and apply them; how many."""
        if not self.connected:
            raise KVEventsError(f"subscriber of replica {self.replica!r} is disconnected")
        return self._replay_from(self.next_seq, None)

    def _receive(self, seq: int, payload: bytes) -> int:
        if self.next_seq is None:  # the first batch seen: everything before it comes from a replay
            return self._replay_from(None, seq) + self._apply_if_next(seq, payload)
        if seq < self.next_seq:
            return 0  # already applied (it came through a replay first)
        applied = 0
        try:
            if seq > self.next_seq:
                applied = self._replay_from(self.next_seq, seq)
        finally:  # a lost gap still lets the live batch in
            applied += self._apply_if_next(seq, payload)
        return applied

    def _apply_if_next(self, seq: int, payload: bytes) -> int:
        if self.next_seq is not None and seq != self.next_seq:
            return 0
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

    def _replay_from(self, start: int | None, live: int | None) -> int:
        """Apply the replayed batches from ``start`` on (None: from the oldest buffered);
        ``live`` is a sequence number seen live (None when none is known), so the stream
        is known to reach it. Raises :class:`EventGapError` after applying what came
        back if batches are lost; follows a new epoch from its start."""
        if self._replay is None:
            if live is None or start is None:
                if start is None and live is not None:
                    self.next_seq = live
                return 0
            return self._lose(start, live, "no replay socket")
        self._replay.send_multipart((b"", (start or 0).to_bytes(8, "big")))
        replayed: list[tuple[int, bytes]] = []
        while True:
            if not self._replay.poll(int(self.replay_timeout_s * 1000)):
                self._replay.close(linger=0)  # a late answer must not mix into the next one
                self._open_replay()
                raise ReplayTimeoutError(
                    f"replica {self.replica!r}: no replay answer from {self.replay_endpoint} "
                    f"within {self.replay_timeout_s} s"
                )
            frames = self._replay.recv_multipart()  # with the topic frame first or (before vLLM 0.33) without
            if len(frames) < 3 or len(frames[-2]) != 8:
                self.num_bad_batches += 1
                continue
            seq_bytes, payload = frames[-2], frames[-1]
            if seq_bytes == END_SEQ:
                epoch = int.from_bytes(payload, "big") if len(payload) == 8 else None
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), payload))
        restarted = epoch is not None and self.epoch is not None and epoch != self.epoch
        if epoch is not None:
            self.epoch = epoch
        if restarted:  # a new publisher: follow it from its first batch
            self.num_resyncs += 1
            self.index.drop_replica(self.replica)
            self.next_seq = epoch
        elif self.next_seq is None:  # the first contact: from the oldest batch still buffered
            self.next_seq = replayed[0][0] if replayed else (epoch if epoch is not None else live)
        applied, lost_at = 0, None
        for seq, payload in replayed:
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
        if lost_at is not None:
            raise EventGapError(self.replica, *lost_at, "no longer in the publisher's replay buffer")
        return applied

    def _lose(self, start: int, live: int, why: str) -> int:
        self.index.drop_replica(self.replica)
        self.next_seq = live
        raise EventGapError(self.replica, start, live, why)
