"""Routing requests over data-parallel replicas (:mod:`jaxkv.fleet.replica`) on the
KV events they publish.

The :class:`Router` follows every replica's KV events into one
:class:`~jaxkv.fleet.prefix_index.PrefixIndex` (a
:class:`~jaxkv.fleet.prefix_index.KVEventSubscriber` per replica) and hashes each
prompt as the replicas' engines do (:class:`~jaxkv.core.hashing.BlockHasher` at the plan's
hash block size, the cache salt in the first block, each hash's low 64 bits as
published), so it knows how many leading tokens of the prompt each replica caches, on
device or host.

Policies (:func:`pick_replica`), over the live replicas:

- ``round_robin``: the next replica in turn.
- ``least_loaded``: the fewest requests in flight.
- ``prefix``: the highest score ``cached_tokens - load_penalty * in_flight - queued``:
  a replica's cached prefix of the prompt, in tokens (the prefill it saves: what its
  KV events say it caches, or what a request in flight on it shares with the prompt,
  which it is computing before any event can say so), less
  ``load_penalty`` tokens per request it is serving (they share its steps), less the
  expected wait for a running slot (:func:`queue_tokens`: zero while the replica has
  a free slot, then about a step's worth of tokens per decode step until one frees).
  A cached prefix wins until its replica is that much busier (a new tenant, cached
  nowhere, goes to the least loaded); ties go to the less loaded, then in turn. Both
  terms are in prompt tokens, a step's budget of prefill being worth one step: on a
  replica with a free slot a new request starts at once and its TTFT is its prefill,
  while past its slots it first waits for running requests to finish.

The load is the router's own count of requests in flight on the replica (sent, not
yet answered): exact and current when this router is the replica's only client, where
a heartbeat's load (kept in :meth:`Router.reported_load`) is up to one interval old.

Every submitted request is answered exactly once (:meth:`Router.poll` returns one
:class:`RoutedOutput` per request): tokens, or an ``error`` naming why: ``refused:``
(the replica refused it), ``step failed:``, ``no live replica``, ``deadline passed``
or ``cancelled``. A request has a deadline (``deadline_s`` per request, or the
router's ``request_timeout_s``); past it, it is answered and cancelled on its replica.

Liveness, from two signs: each replica heartbeats every ``heartbeat_interval_s`` (from a
thread of its own, so a long step does not silence it), and each heartbeat carries
its step count and whether its serving thread is compiling a step (tracing, lowering
or compiling in JAX, which can outlast any hang timeout: a compiling replica is
alive). A replica not heard from for ``2 * heartbeat_interval_s``, or with this
router's requests in flight and neither a step nor a compile for ``hang_timeout_s``
(a loop stuck while idle never steps), is dropped at the next
:meth:`Router.poll`: the router stops sending to it, its prefixes leave the index,
its requests in flight are cancelled on it and sent again to the live replicas (up
to ``max_attempts`` sends each; a late answer from it is ignored; a send that fails
moves on to the next candidate), and with no replica left they are answered ``no
live replica``. A dropped replica is re-admitted when it heartbeats again (one
dropped as hung only once its steps move on): its KV events are followed again from
its publisher's replay buffer. A heartbeat with a new ``instance`` is a restart:
the requests in flight on the dead instance are sent again (after a cancel, so the
new one never holds two copies) and the index follows the new publisher from its
start, the dead cache's entries dropped. Replays run beside the stream (see
:class:`~jaxkv.fleet.prefix_index.KVEventSubscriber`): no replica's replay socket
stalls :meth:`Router.poll`.

Limits: each replica's heartbeats announce its ``max_model_len`` and
``max_request_bytes``; :meth:`Router.submit` refuses a request that no live replica
admits, naming the limit, and a request goes only to replicas that admit it.

Answers are accepted only on the link the request was sent on (the name written
inside an answer is not trusted); a message that does not decode is counted and
skipped. The router's request ids carry a token drawn at its start, and a replica
keeps each client's ids apart, so routers sharing replicas never collide.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from jaxkv.core.hashing import BlockHasher, ExtraKeys
from jaxkv.errors import JaxkvError
from jaxkv.fleet.prefix_index import EventGapError, KVEventSubscriber, PrefixIndex, ReplayTimeoutError
from jaxkv.fleet.protocol import (
    CacheReset,
    CancelRequest,
    FromReplica,
    GenerateFailure,
    GenerateRequest,
    Heartbeat,
    ReplicaAddress,
    ResetPrefixCache,
    ToReplica,
)
from jaxkv.ints import is_int
from jaxkv.serving.kv_events import ExternalBlockHash, external_hash
from jaxkv.serving.zmq_security import CurveKeys, SecureContext

POLICIES = ("round_robin", "least_loaded", "prefix")


class RouterError(JaxkvError, ValueError):
    """The router was given settings or a request it cannot use; nothing was sent."""


class NoLiveReplicaError(RouterError):
    """Every replica was dropped: nothing can serve the request."""


def queue_tokens(in_flight: int, slots: int, step_tokens: int, new_tokens: float) -> float:
    """A new request's expected wait for a running slot, in prompt tokens: with
    ``in_flight`` requests on a replica of ``slots`` running slots (0: unknown, no wait
    counted), it waits for ``in_flight - slots + 1`` of them to finish, each about
    ``new_tokens / slots`` decode steps away, a step being worth ``step_tokens``
    tokens of prefill."""
    if slots <= 0 or in_flight < slots:
        return 0.0
    return (in_flight - slots + 1) * new_tokens / slots * step_tokens


def pick_replica(
    policy: str,
    loads: Mapping[str, int],
    cached_tokens: Mapping[str, int],
    *,
    load_penalty: float,
    turn: int,
    queued: Mapping[str, float] | None = None,
) -> str:
    """The replica ``policy`` sends a request to (see the module docstring).

    ``loads``: requests in flight per live replica (its keys are the candidates, in
    turn order); ``cached_tokens``: the prompt's cached prefix per replica (missing:
    0); ``turn``: the request's number, which rotates ties; ``queued``: the
    :func:`queue_tokens` of each replica (missing: 0).
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
    queued = queued or {}
    return max(order, key=lambda r: (cached_tokens.get(r, 0) - load_penalty * loads[r] - queued.get(r, 0.0), -loads[r]))


@dataclass(frozen=True)
class RoutedOutput:
    """A request's answer. ``ttft_s``: from :meth:`Router.submit` to its first token
    (the replica's TTFT plus the time before its last send, transit not counted);
    ``attempts``: replicas it was sent to; ``error``: why it has no tokens, if so (see
    the module docstring)."""

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
    payload: bytes
    hashes: list[ExternalBlockHash]
    submitted: float
    deadline: float
    sent: float = 0.0
    replica: str = ""
    attempts: int = 0


class _Link:
    """The router's end of one replica: its request socket, heartbeat subscription and
    event subscriber, and what the router knows of it."""

    def __init__(
        self, secure: SecureContext, index: PrefixIndex, name: str, address: ReplicaAddress, identity: bytes
    ) -> None:
        self.name = name
        self.requests = secure.connect(zmq.DEALER, "requests", address.requests, ROUTING_ID=identity)
        self.heartbeats = secure.connect(zmq.SUB, "heartbeats", address.heartbeats)
        self.heartbeats.setsockopt(zmq.SUBSCRIBE, b"")
        self.events = KVEventSubscriber(index, name, address.events, replay_endpoint=address.replay, curve=secure.keys)
        self.live = True
        self.hung = False
        """Dropped for making no progress (re-admitted only once its steps move on)."""
        self.heard = False
        self.last_heard = time.monotonic()
        self.last_progress = self.last_heard
        self.steps = -1
        self.instance = ""
        self.reported_load = 0
        self.slots = 0
        self.step_tokens = 0
        self.max_model_len = 0
        self.max_request_bytes = 0
        self.in_flight: set[str] = set()
        self.routed: Counter[ExternalBlockHash] = Counter()
        """The block hashes of the prompts in flight on the replica: blocks it is
        computing, or will compute, before their KV events can say so."""

    def take(self, pending: _InFlight) -> None:
        """Count ``pending`` as in flight here (the hang clock starts with the first)."""
        if not self.in_flight:
            self.last_progress = time.monotonic()
        self.in_flight.add(pending.request.request_id)
        self.routed.update(pending.hashes)

    def release(self, pending: _InFlight) -> None:
        """Stop counting ``pending`` here (answered, or taken away)."""
        if pending.request.request_id in self.in_flight:
            self.in_flight.discard(pending.request.request_id)
            for h in pending.hashes:
                self.routed[h] -= 1
                if not self.routed[h]:
                    del self.routed[h]

    def admits(self, pending: _InFlight) -> bool:
        """Whether ``pending`` is within the limits the replica announced (0: none said)."""
        return (not self.max_model_len or len(pending.request.prompt_token_ids) < self.max_model_len) and (
            not self.max_request_bytes or len(pending.payload) <= self.max_request_bytes
        )

    def routed_blocks(self, hashes: Sequence[ExternalBlockHash]) -> int:
        """How many leading ``hashes`` a prompt in flight here shares."""
        n = 0
        while n < len(hashes) and hashes[n] in self.routed:
            n += 1
        return n

    def close(self) -> None:
        self.requests.close(linger=0)
        self.heartbeats.close(linger=0)
        self.events.close()


class Router:
    """Routes requests over ``replicas`` (name -> address) with ``policy``.

    ``block_size``, ``hash_algo`` and ``hash_seed`` must be the replicas' hash block
    size, hash algorithm and seed (the plan's ``hash_block_size``; the engine's
    ``hash_algo``; ``JAXKV_HASH_SEED``, read when ``hash_seed`` is None, as the
    replicas read it). Single-threaded: :meth:`submit` requests, :meth:`poll` for
    answers (it also applies KV events and heartbeats, drops dead or hung replicas,
    re-admits those that recover and answers requests past their deadline). ``curve``
    / ``plaintext_tcp``: see :class:`~jaxkv.serving.zmq_security.SecureContext`. Close
    it (or use it as a context manager).
    """

    def __init__(
        self,
        replicas: Mapping[str, ReplicaAddress],
        *,
        policy: str = "prefix",
        block_size: int = 16,
        hash_algo: str = "sha256",
        hash_seed: str | None = None,
        load_penalty: float = 16.0,
        heartbeat_interval_s: float = 1.0,
        hang_timeout_s: float = 30.0,
        request_timeout_s: float = 600.0,
        max_attempts: int = 3,
        curve: CurveKeys | None = None,
        plaintext_tcp: bool = False,
    ) -> None:
        if policy not in POLICIES:
            raise RouterError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not replicas or not all(isinstance(a, ReplicaAddress) for a in replicas.values()):
            raise RouterError(f"replicas must map names to ReplicaAddress, got {replicas!r:.120}")
        for name, value in (
            ("load_penalty", load_penalty),
            ("heartbeat_interval_s", heartbeat_interval_s),
            ("hang_timeout_s", hang_timeout_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise RouterError(f"{name} must be a finite number >= 0, got {value!r}")
        for name, value in (
            ("heartbeat_interval_s", heartbeat_interval_s),
            ("hang_timeout_s", hang_timeout_s),
            ("request_timeout_s", request_timeout_s),
        ):
            if value == 0:
                raise RouterError(f"{name} must be > 0")
        if not is_int(max_attempts) or max_attempts < 1:
            raise RouterError(f"max_attempts must be a positive int, got {max_attempts!r}")
        self.policy = policy
        self.load_penalty = load_penalty
        self.heartbeat_interval_s = heartbeat_interval_s
        self.hang_timeout_s = hang_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.hasher = BlockHasher(block_size, hash_algo, seed=hash_seed)
        self.index = PrefixIndex()
        self.router_id = secrets.token_hex(6)
        """Drawn at start: it prefixes the router's request ids."""
        self.num_event_gaps = 0
        self.num_replay_timeouts = 0
        self.num_retries = 0
        self.num_send_failures = 0
        self.num_bad_messages = 0
        self.num_readmissions = 0
        self.num_restarts = 0
        self._secure = SecureContext(curve, plaintext_tcp=plaintext_tcp)
        self._links: dict[str, _Link] = {}
        try:
            for name, address in replicas.items():
                self._links[name] = _Link(self._secure, self.index, name, address, self.router_id.encode())
        except BaseException:
            self.close()
            raise
        self._dropped: dict[str, float] = {}  # name -> when, while dropped
        self._sends: dict[str, int] = dict.fromkeys(replicas, 0)
        self._poller = zmq.Poller()
        for link in self._links.values():
            self._poller.register(link.heartbeats, zmq.POLLIN)
            self._poller.register(link.requests, zmq.POLLIN)
        self._in_flight: dict[str, _InFlight] = {}
        self._ready: list[RoutedOutput] = []
        self._resets: dict[str, bool] = {}
        self._ids = itertools.count()
        self._turns = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromReplica)
        self._heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)

    # ------------------------------------------------------------- queries
    @property
    def live_replicas(self) -> tuple[str, ...]:
        return tuple(name for name, link in self._links.items() if link.live)

    @property
    def dropped_replicas(self) -> dict[str, float]:
        """Replicas dropped now -> when (``time.monotonic()``)."""
        return dict(self._dropped)

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet returned by :meth:`poll`."""
        return len(self._in_flight) + len(self._ready)

    def in_flight(self, replica: str) -> int:
        """Requests sent to ``replica`` and not answered (0 while dropped)."""
        return len(self._links[replica].in_flight)

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
            for link in self._links.values():
                if link.heartbeats.poll(100 // len(self._links)):
                    self._heartbeats(link)
        now = time.monotonic()
        for link in self._links.values():
            self._catch_up(link)
            link.last_heard = max(link.last_heard, now)
            link.last_progress = max(link.last_progress, now)

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
        deadline_s: float | None = None,
    ) -> str:
        """Route one request and send it; its id (given or made). Bad input raises
        before anything is sent, a prompt over every live replica's limits included
        (the error names them); everything else (no live replica, a refusal, the
        deadline ``deadline_s`` from now, default ``request_timeout_s``) comes back
        from :meth:`poll` as an error output."""
        rid = f"{self.router_id}-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str) or rid in self._in_flight:
            raise RouterError(f"request_id must be a str not already in flight, got {rid!r}")
        if not is_int(max_new_tokens) or max_new_tokens <= 0:
            raise RouterError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        timeout = self.request_timeout_s if deadline_s is None else deadline_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise RouterError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        hashes = self._hashes(prompt, cache_salt)
        request = GenerateRequest(rid, [int(t) for t in prompt], int(max_new_tokens), cache_salt)
        now = time.monotonic()
        pending = _InFlight(request, self._encoder.encode(request), hashes, now, now + timeout)
        live = [self._links[name] for name in self.live_replicas]
        if live and not any(link.admits(pending) for link in live):
            raise RouterError(self._over_limits(pending, live))
        self._in_flight[rid] = pending
        self._route(pending)
        return rid

    def cancel(self, request_id: str) -> bool:
        """Answer ``request_id`` as cancelled and stop it on its replica; False when it
        is not in flight."""
        pending = self._in_flight.get(request_id)
        if pending is None:
            return False
        self._cancel_on(pending)
        self._finish(pending, error="cancelled")
        return True

    def poll(self, timeout_s: float = 0.0) -> list[RoutedOutput]:
        """Take what arrived (waiting up to ``timeout_s`` for something): answers,
        heartbeats and KV events; drop replicas dead or hung, resending their requests;
        answer requests past their deadline. The requests answered since the last call."""
        wait_ms = 0 if self._ready else int(timeout_s * 1000)
        ready = dict(self._poller.poll(wait_ms))
        for link in self._links.values():
            if link.heartbeats in ready:
                self._heartbeats(link)
            if link.requests in ready:
                self._answers(link)
        self._apply_events()
        now = time.monotonic()
        for name, link in self._links.items():
            if not link.live:
                continue
            if now - link.last_heard > 2 * self.heartbeat_interval_s:
                self.drop(name)
            elif link.in_flight and now - link.last_progress > self.hang_timeout_s:
                self.drop(name)
                link.hung = True
        for pending in [p for p in self._in_flight.values() if p.deadline < now]:
            self._cancel_on(pending)
            self._finish(pending, error="deadline passed")
        out, self._ready = self._ready, []
        return out

    def drop(self, replica: str) -> None:
        """Stop using ``replica`` until it heartbeats again, idle or making progress:
        forget its prefixes, cancel its requests in flight on it and resend them."""
        link = self._links[replica]
        if not link.live:
            return
        link.live, link.hung = False, False
        link.events.disconnect()
        self.index.drop_replica(replica)
        self._dropped[replica] = time.monotonic()
        self._resend(link)

    def _resend(self, link: _Link) -> None:
        """Cancel the requests in flight on ``link`` and route them again."""
        moved = [self._in_flight[rid] for rid in sorted(link.in_flight)]
        for pending in moved:
            self._cancel_on(pending)
            link.release(pending)
        for pending in moved:
            self.num_retries += 1
            self._route(pending)

    def reset_prefix_caches(self, timeout_s: float = 30.0) -> None:
        """Have every live replica forget its device prefix cache, and the index follow
        (for runs that must start cold). Only while nothing is in flight."""
        if self.num_in_flight:
            raise RouterError(f"{self.num_in_flight} requests are in flight; reset needs idle replicas")
        self._resets.clear()
        live = set(self.live_replicas)
        for name in live:
            self._try_send(self._links[name], ResetPrefixCache(f"reset-{name}"))
        deadline = time.monotonic() + timeout_s
        while not live <= set(self._resets):
            if time.monotonic() > deadline:
                raise RouterError(f"replicas {sorted(live - set(self._resets))} did not reset")
            self.poll(0.05)
        refused = sorted(name for name, ok in self._resets.items() if not ok)
        if refused:
            raise RouterError(f"replicas {refused} refused to reset their prefix cache")
        for name in live:
            self._catch_up(self._links[name])

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
        self._secure.term()

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
        except TypeError as err:
            raise RouterError(f"prompt must be a sequence of token ids: {err}") from None
        return [external_hash(h) for h in hashes]

    def _cached(self, hashes: list[ExternalBlockHash]) -> dict[str, int]:
        blocks = self.index.longest_prefix(hashes)
        return {name: blocks.get(name, 0) * self.hasher.block_size for name in self.live_replicas}

    def _expected(self, hashes: list[ExternalBlockHash]) -> dict[str, int]:
        """Per live replica, the tokens of the prompt's longest prefix it caches or is
        computing for a request in flight (whose KV events are yet to come)."""
        blocks = self.index.longest_prefix(hashes)
        return {
            name: max(blocks.get(name, 0), self._links[name].routed_blocks(hashes)) * self.hasher.block_size
            for name in self.live_replicas
        }

    def _catch_up(self, link: _Link) -> None:
        try:
            link.events.catch_up()
        except EventGapError:  # the subscriber dropped the replica's entries and went on
            self.num_event_gaps += 1
        except ReplayTimeoutError:  # nothing applied; the next gap asks again
            self.num_replay_timeouts += 1

    def _apply_events(self) -> None:
        for link in self._links.values():
            if not link.live:
                continue
            try:
                link.events.poll()
            except EventGapError:
                self.num_event_gaps += 1
            except ReplayTimeoutError:
                self.num_replay_timeouts += 1

    def _route(self, pending: _InFlight) -> None:
        """Send ``pending`` to the replica the policy picks among the live ones, the
        next one when a send fails; answer it when none is left or it was sent
        ``max_attempts`` times."""
        if pending.attempts >= self.max_attempts:
            self._finish(pending, error=f"no live replica: sent {pending.attempts} times, each replica lost it")
            return
        self._apply_events()
        live = [self._links[name] for name in self.live_replicas]
        candidates = [link.name for link in live if link.admits(pending)]
        if live and not candidates:
            self._finish(pending, error=f"refused: {self._over_limits(pending, live)}")
            return
        cached = self._expected(pending.hashes) if self.policy == "prefix" else {}
        turn = next(self._turns)
        while candidates:
            loads = {name: len(self._links[name].in_flight) for name in candidates}
            queued = {name: self._queued(name, pending) for name in candidates} if self.policy == "prefix" else {}
            name = pick_replica(self.policy, loads, cached, load_penalty=self.load_penalty, turn=turn, queued=queued)
            link = self._links[name]
            try:
                link.requests.send(pending.payload, zmq.NOBLOCK)
            except zmq.ZMQError:
                self.num_send_failures += 1
                candidates.remove(name)
                continue
            link.take(pending)
            pending.replica, pending.sent = name, time.monotonic()
            pending.attempts += 1
            self._sends[name] += 1
            return
        self._finish(pending, error="no live replica")

    @staticmethod
    def _over_limits(pending: _InFlight, live: list[_Link]) -> str:
        """Why no replica of ``live`` admits ``pending``: its size and the largest limits."""
        return (
            f"a prompt of {len(pending.request.prompt_token_ids)} tokens ({len(pending.payload)} bytes) exceeds "
            f"every live replica's limits: max_model_len={max(link.max_model_len for link in live)} "
            f"(a prompt must be shorter), max_request_bytes={max(link.max_request_bytes for link in live)}"
        )

    def _queued(self, name: str, pending: _InFlight) -> float:
        """:func:`queue_tokens` of replica ``name`` for ``pending``, from the requests in
        flight on it and the slots and step budget its heartbeats tell."""
        link = self._links[name]
        limits = [self._in_flight[rid].request.max_new_tokens for rid in link.in_flight]
        new_tokens = sum(limits) / len(limits) if limits else pending.request.max_new_tokens
        return queue_tokens(len(limits), link.slots, link.step_tokens, new_tokens)

    def _try_send(self, link: _Link, message: ToReplica) -> bool:
        try:
            link.requests.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError:
            self.num_send_failures += 1
            return False
        return True

    def _cancel_on(self, pending: _InFlight) -> None:
        """Tell the replica ``pending`` was sent to that it can stop (best effort)."""
        if pending.replica:
            self._try_send(self._links[pending.replica], CancelRequest(pending.request.request_id))

    def _finish(
        self,
        pending: _InFlight,
        *,
        error: str | None = None,
        tokens: tuple[int, ...] = (),
        cached: int = 0,
        ttft: float = 0.0,
    ) -> None:
        request = pending.request
        del self._in_flight[request.request_id]
        if pending.replica:
            self._links[pending.replica].release(pending)
        self._ready.append(
            RoutedOutput(
                request.request_id,
                pending.replica,
                tuple(request.prompt_token_ids),
                tokens,
                cached,
                ttft,
                pending.attempts,
                error,
            )
        )

    def _heartbeats(self, link: _Link) -> None:
        while link.heartbeats.poll(0):
            try:
                beat = self._heartbeat_decoder.decode(link.heartbeats.recv())
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.num_bad_messages += 1
                continue
            if beat.replica != link.name:
                self.num_bad_messages += 1
                continue
            self._heartbeat(link, beat)

    def _heartbeat(self, link: _Link, beat: Heartbeat) -> None:
        now = time.monotonic()
        restarted = bool(link.instance) and beat.instance != link.instance
        progressed = beat.instance != link.instance or beat.steps != link.steps or beat.compiling
        link.heard = True
        link.last_heard = now
        link.reported_load = beat.load
        link.slots, link.step_tokens = beat.slots, beat.step_tokens
        link.max_model_len, link.max_request_bytes = beat.max_model_len, beat.max_request_bytes
        link.instance, link.steps = beat.instance, beat.steps
        if progressed:
            link.last_progress = now
        if not link.live and (progressed or not link.hung):
            link.live = True
            self._dropped.pop(link.name, None)
            self.num_readmissions += 1
            link.events.resync()
            link.events.start_catch_up()
        elif restarted and link.live:  # the dead instance's requests and cache are gone
            self.num_restarts += 1
            link.events.resync()
            link.events.start_catch_up()
            self._resend(link)

    def _answers(self, link: _Link) -> None:
        while link.requests.poll(0):
            frames = link.requests.recv_multipart()
            try:
                if len(frames) != 1:
                    raise msgspec.DecodeError(f"{len(frames)} frames")
                message = self._decoder.decode(frames[0])
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.num_bad_messages += 1
                continue
            self._answer(link, message)

    def _answer(self, link: _Link, message: FromReplica) -> None:
        if isinstance(message, CacheReset):
            if message.request_id == f"reset-{link.name}":
                self._resets[link.name] = message.ok
            return
        pending = self._in_flight.get(message.request_id)
        if pending is None or pending.replica != link.name or not link.live:
            return  # not in flight, or taken from this replica: answered elsewhere
        if isinstance(message, GenerateFailure):
            self._finish(pending, error=message.message)
            return
        self._finish(
            pending,
            tokens=tuple(message.output_token_ids),
            cached=message.num_cached_tokens,
            ttft=pending.sent - pending.submitted + message.ttft_s,
        )
