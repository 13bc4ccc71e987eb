"""Routing requests over data-parallel replicas (:mod:`jaxkv.fleet.replica`) on the
KV events they publish.

The :class:`Router` follows every replica's KV events into one
:class:`~jaxkv.fleet.prefix_index.PrefixIndex` (a
:class:`~jaxkv.fleet.prefix_index.KVEventSubscriber` per replica) and hashes each
prompt as the replicas' engines do (:class:`~jaxkv.hashing.BlockHasher` at the plan's
hash block size, the cache salt in the first block, each hash's low 64 bits as
published), so it knows how many leading tokens of the prompt each replica caches, on
device or host.

Policies (:func:`pick_replica`), over the live replicas:

- ``round_robin``: the next replica in turn.
- ``least_loaded``: the fewest requests in flight.
- ``prefix``: the highest score ``cached_tokens - load_penalty * in_flight``: a
  replica's cached prefix of the prompt, in tokens, less ``load_penalty`` tokens per
  request it is serving. A cached prefix wins until its replica is that much busier
  (a new tenant, cached nowhere, goes to the least loaded); ties go to the less
  loaded, then in turn.

The load is the router's own count of requests in flight on the replica (sent, not
yet answered): exact and current when this router is the replica's only client, where
a heartbeat's load (kept in :meth:`Router.reported_load`) is up to one interval old.

Liveness: each replica heartbeats every ``heartbeat_interval_s`` (from a thread of its
own, so a long step does not silence it). A replica not heard from for
``2 * heartbeat_interval_s`` missed a heartbeat and is dropped at the next
:meth:`Router.poll`, within one interval of the missed one: the router stops sending
to it, its prefixes leave the index, and its requests in flight are sent again to the
live replicas (a late answer from it is ignored), so no request is lost while a
replica lives. A dropped replica stays dropped.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from jaxkv.errors import JaxkvError
from jaxkv.fleet.prefix_index import EventGapError, KVEventSubscriber, PrefixIndex
from jaxkv.fleet.protocol import (
    CacheReset,
    FromReplica,
    GenerateFailure,
    GenerateRequest,
    Heartbeat,
    ReplicaAddress,
    ResetPrefixCache,
)
from jaxkv.hashing import BlockHasher, ExtraKeys
from jaxkv.ints import is_int
from jaxkv.serving.kv_events import ExternalBlockHash, external_hash

POLICIES = ("round_robin", "least_loaded", "prefix")


class RouterError(JaxkvError, ValueError):
    """The router was given settings or a request it cannot use; nothing was sent."""


class NoLiveReplicaError(RouterError):
    """Every replica was dropped: nothing can serve the request."""


def pick_replica(
    policy: str,
    loads: Mapping[str, int],
    cached_tokens: Mapping[str, int],
    *,
    load_penalty: float,
    turn: int,
) -> str:
    """The replica ``policy`` sends a request to (see the module docstring).

    ``loads``: requests in flight per live replica (its keys are the candidates, in
    turn order); ``cached_tokens``: the prompt's cached prefix per replica (missing:
    0); ``turn``: the request's number, which rotates ties.
    """
    if policy not in POLICIES:
        raise RouterError(f"policy must be one of {POLICIES}, got {policy!r}")
    names = list(loads)
    if not names:
        raise NoLiveReplicaError("no live replica to route to")
    k = turn % len(names)
    order = names[k:] + names[:k]
    if policy == "round_robin":
        return order[0]
    if policy == "least_loaded":
        return min(order, key=lambda r: loads[r])
    return max(order, key=lambda r: (cached_tokens.get(r, 0) - load_penalty * loads[r], -loads[r]))


@dataclass(frozen=True)
class RoutedOutput:
    """A request's answer. ``ttft_s``: from :meth:`Router.submit` to its first token
    (the replica's TTFT plus the time before its last send, transit not counted);
    ``attempts``: replicas it was sent to; ``error``: the replica's refusal, if any."""

    request_id: str
    replica: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_cached_tokens: int
    ttft_s: float
    attempts: int
    error: str | None = None


@dataclass(eq=False)
class _InFlight:
    request: GenerateRequest
    hashes: list[ExternalBlockHash]
    submitted: float
    sent: float = 0.0
    replica: str = ""
    attempts: int = 0


class _Link:
    """The router's end of one replica: its request socket and its event subscriber."""

    def __init__(self, ctx: zmq.Context, index: PrefixIndex, name: str, address: ReplicaAddress) -> None:
        self.requests = ctx.socket(zmq.DEALER)
        self.requests.connect(address.requests)
        self.events = KVEventSubscriber(index, name, address.events, replay_endpoint=address.replay)
        self.heard = False
        self.last_heard = time.monotonic()
        self.reported_load = 0
        self.in_flight: set[str] = set()

    def close(self) -> None:
        self.requests.close(linger=0)
        self.events.close()


class Router:
    """Routes requests over ``replicas`` (name -> address) with ``policy``.

    ``block_size`` and ``hash_algo`` must be the replicas' hash block size and hash
    algorithm (the plan's ``hash_block_size``; the engine's ``hash_algo``).
    Single-threaded: :meth:`submit` requests, :meth:`poll` for answers (it also
    applies KV events, heartbeats and drops silent replicas). Close it (or use it as a
    context manager).
    """

    def __init__(
        self,
        replicas: Mapping[str, ReplicaAddress],
        *,
        policy: str = "prefix",
        block_size: int = 16,
        hash_algo: str = "sha256",
        load_penalty: float = 64.0,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        if policy not in POLICIES:
            raise RouterError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not replicas or not all(isinstance(a, ReplicaAddress) for a in replicas.values()):
            raise RouterError(f"replicas must map names to ReplicaAddress, got {replicas!r:.120}")
        for name, value in (("load_penalty", load_penalty), ("heartbeat_interval_s", heartbeat_interval_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise RouterError(f"{name} must be a finite number >= 0, got {value!r}")
        if heartbeat_interval_s == 0:
            raise RouterError("heartbeat_interval_s must be > 0")
        self.policy = policy
        self.load_penalty = load_penalty
        self.heartbeat_interval_s = heartbeat_interval_s
        self.hasher = BlockHasher(block_size, hash_algo)
        self.index = PrefixIndex()
        self.num_event_gaps = 0
        self.num_retries = 0
        self._ctx = zmq.Context()
        self._links = {name: _Link(self._ctx, self.index, name, address) for name, address in replicas.items()}
        self._dropped: dict[str, float] = {}  # name -> when
        self._sends: dict[str, int] = dict.fromkeys(replicas, 0)
        self._heartbeats = self._ctx.socket(zmq.SUB)
        self._heartbeats.setsockopt(zmq.SUBSCRIBE, b"")
        for address in replicas.values():
            self._heartbeats.connect(address.heartbeats)
        self._poller = zmq.Poller()
        self._poller.register(self._heartbeats, zmq.POLLIN)
        for link in self._links.values():
            self._poller.register(link.requests, zmq.POLLIN)
        self._in_flight: dict[str, _InFlight] = {}
        self._resets: dict[str, bool] = {}
        self._ids = itertools.count()
        self._turns = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromReplica)
        self._heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)

    # ------------------------------------------------------------- queries
    @property
    def live_replicas(self) -> tuple[str, ...]:
        return tuple(self._links)

    @property
    def dropped_replicas(self) -> dict[str, float]:
        """Dropped replica -> when (``time.monotonic()``)."""
        return dict(self._dropped)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def in_flight(self, replica: str) -> int:
        """Requests sent to a live ``replica`` and not answered (0 once dropped)."""
        link = self._links.get(replica)
        return len(link.in_flight) if link is not None else 0

    def num_sent(self, replica: str) -> int:
        """Requests sent to ``replica`` so far (retries included)."""
        return self._sends[replica]

    def reported_load(self, replica: str) -> int:
        """The load in ``replica``'s last heartbeat."""
        return self._links[replica].reported_load

    def cached_tokens(self, prompt: Sequence[int], cache_salt: str | None = None) -> dict[str, int]:
        """Per live replica, the tokens of ``prompt``'s longest cached prefix."""
        return self._cached(self._hashes(prompt, cache_salt))

    # ------------------------------------------------------------ requests
    def wait_ready(self, timeout_s: float) -> None:
        """Wait until every replica has heartbeated once (it then serves, its step
        shapes compiled) and catch up on its KV events; :class:`RouterError` naming the
        silent ones after ``timeout_s`` (call it again to wait on). Call it before
        :meth:`poll`: the heartbeat clock of every replica starts when it returns."""
        deadline = time.monotonic() + timeout_s
        while not all(link.heard for link in self._links.values()):
            if time.monotonic() > deadline:
                silent = sorted(name for name, link in self._links.items() if not link.heard)
                raise RouterError(f"replicas {silent} sent no heartbeat in {timeout_s} s")
            if self._heartbeats.poll(100):
                self._heartbeat(self._heartbeats.recv())
        now = time.monotonic()
        for link in self._links.values():
            link.events.catch_up()
            link.last_heard = max(link.last_heard, now)

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Route one request and send it; its id (given or made). Bad token ids raise
        before anything is sent; what the replica refuses comes back as an error."""
        rid = f"route-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str) or rid in self._in_flight:
            raise RouterError(f"request_id must be a str not already in flight, got {rid!r}")
        if not is_int(max_new_tokens) or max_new_tokens <= 0:
            raise RouterError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        hashes = self._hashes(prompt, cache_salt)
        request = GenerateRequest(rid, [int(t) for t in prompt], int(max_new_tokens), cache_salt)
        pending = _InFlight(request, hashes, time.monotonic())
        self._send(pending)
        self._in_flight[rid] = pending
        return rid

    def poll(self, timeout_s: float = 0.0) -> list[RoutedOutput]:
        """Take what arrived (waiting up to ``timeout_s`` for something): answers,
        heartbeats and KV events; drop replicas that missed a heartbeat and resend
        their requests. The answers that completed requests."""
        out: list[RoutedOutput] = []
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._heartbeats in ready:
            while self._heartbeats.poll(0):
                self._heartbeat(self._heartbeats.recv())
        for link in list(self._links.values()):
            if link.requests in ready:
                while link.requests.poll(0):
                    answer = self._answer(self._decoder.decode(link.requests.recv()))
                    if answer is not None:
                        out.append(answer)
        self._apply_events()
        now = time.monotonic()
        for name, link in list(self._links.items()):
            if now - link.last_heard > 2 * self.heartbeat_interval_s:
                self.drop(name)
        return out

    def drop(self, replica: str) -> None:
        """Stop using ``replica``: forget its prefixes and resend its requests in flight."""
        link = self._links.pop(replica)
        self._poller.unregister(link.requests)
        link.close()
        self.index.drop_replica(replica)
        self._dropped[replica] = time.monotonic()
        for rid in sorted(link.in_flight):
            self.num_retries += 1
            self._send(self._in_flight[rid])

    def reset_prefix_caches(self, timeout_s: float = 30.0) -> None:
        """Have every live replica forget its device prefix cache, and the index follow
        (for runs that must start cold). Only while nothing is in flight."""
        if self._in_flight:
            raise RouterError(f"{len(self._in_flight)} requests are in flight; reset needs idle replicas")
        self._resets.clear()
        for name, link in self._links.items():
            link.requests.send(self._encoder.encode(ResetPrefixCache(f"reset-{name}")))
        deadline = time.monotonic() + timeout_s
        while set(self._resets) < set(self._links):
            if time.monotonic() > deadline:
                raise RouterError(f"replicas {sorted(set(self._links) - set(self._resets))} did not reset")
            self.poll(0.05)
        refused = sorted(name for name, ok in self._resets.items() if not ok)
        if refused:
            raise RouterError(f"replicas {refused} refused to reset their prefix cache")
        for link in self._links.values():
            link.events.catch_up()

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        self._heartbeats.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> Router:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _hashes(self, prompt: Sequence[int], cache_salt: str | None) -> list[ExternalBlockHash]:
        hashes: list[bytes] = []
        try:
            self.hasher.extend(hashes, list(prompt), ExtraKeys(cache_salt=cache_salt))
        except JaxkvError as err:
            raise RouterError(f"cannot hash the prompt: {err}") from None
        return [external_hash(h) for h in hashes]

    def _cached(self, hashes: list[ExternalBlockHash]) -> dict[str, int]:
        blocks = self.index.longest_prefix(hashes)
        return {name: blocks.get(name, 0) * self.hasher.block_size for name in self._links}

    def _apply_events(self) -> None:
        for link in self._links.values():
            try:
                link.events.poll()
            except EventGapError:  # the subscriber dropped the replica's entries and went on
                self.num_event_gaps += 1

    def _send(self, pending: _InFlight) -> None:
        """Route ``pending`` over the live replicas and send it."""
        self._apply_events()
        loads = {name: len(link.in_flight) for name, link in self._links.items()}
        cached = self._cached(pending.hashes) if self.policy == "prefix" else {}
        name = pick_replica(self.policy, loads, cached, load_penalty=self.load_penalty, turn=next(self._turns))
        link = self._links[name]
        link.requests.send(self._encoder.encode(pending.request))
        link.in_flight.add(pending.request.request_id)
        pending.replica, pending.sent = name, time.monotonic()
        pending.attempts += 1
        self._sends[name] += 1

    def _heartbeat(self, payload: bytes) -> None:
        beat = self._heartbeat_decoder.decode(payload)
        link = self._links.get(beat.replica)
        if link is not None:
            link.heard = True
            link.last_heard = time.monotonic()
            link.reported_load = beat.load

    def _answer(self, message: FromReplica) -> RoutedOutput | None:
        if isinstance(message, CacheReset):
            self._resets[message.replica] = message.ok
            return None
        pending = self._in_flight.get(message.request_id)
        if pending is None or pending.replica != message.replica:
            return None  # an answer from a replica the request was taken from
        del self._in_flight[message.request_id]
        self._links[message.replica].in_flight.discard(message.request_id)
        request = pending.request
        if isinstance(message, GenerateFailure):
            return RoutedOutput(
                request.request_id,
                message.replica,
                tuple(request.prompt_token_ids),
                (),
                0,
                0.0,
                pending.attempts,
                message.message,
            )
        return RoutedOutput(
            request.request_id,
            message.replica,
            tuple(request.prompt_token_ids),
            tuple(message.output_token_ids),
            message.num_cached_tokens,
            pending.sent - pending.submitted + message.ttft_s,
            pending.attempts,
        )
