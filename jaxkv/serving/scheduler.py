"""Continuous batching over a KV cache manager: which requests run this step, and how far.

vLLM v1's policy, re-stated. Every step has a budget of ``max_num_batched_tokens``.
Running requests come first, in admission order: one decode token each, or the next
chunk of a prefill (chunked prefill). Then waiting requests are admitted first come,
first served while budget and ``max_num_seqs`` last: a prefix-cache lookup
(``get_computed_blocks``), then a chunk of what is not cached (cut to end at the next
recurrent-state checkpoint, :meth:`~jaxkv.core.manager.KVCacheManager.chunk_limit`); admission stops at the
first request whose blocks do not fit in the free pool. A running request that cannot
get its blocks preempts the most recently admitted one (preemption by recompute: its
blocks are freed, its progress reset, and it goes back to the head of the queue), and
no request is admitted in a step that preempted.

Asynchronous scheduling (vLLM's ``async_scheduling``): an engine may schedule step N+1
before it knows the tokens step N drew. :meth:`Scheduler.advance` moves the chunks of a
dispatched step on and counts each drawn token as a placeholder
(``SeqState.num_placeholders``), so the next :meth:`~Scheduler.schedule` decodes it (the
engine feeds the token on the device); :meth:`Scheduler.resolve` appends the tokens once
read back and retires the requests at their length. A request the tokens in flight take
to its length is not scheduled again; :meth:`Scheduler.update` is both at once (the
synchronous loop). The manager caches a block only once its tokens are known: a block a
decode completed with a token in flight is cached at the sequence's next allocation (before
its next state is placed, so a recurrent state on a block boundary is kept as the
synchronous loop keeps it) or, for a sequence no step extends, when the token is appended.

The scheduler is host-only (no JAX): :mod:`jaxkv.serving.simulator` replays traces with it and
:mod:`jaxkv.serving.engine` drives a model with it. It asks of its manager only the calls of
:class:`ScheduledManager`: jaxkv's :class:`~jaxkv.core.manager.KVCacheManager`, or an adapter over a peer's
manager, so that a benchmark can replay one trace through both under the same policy.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple, Protocol, runtime_checkable

from jaxkv.core.manager import KVCacheBlocks, PrefixCacheStats, Request
from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int
from jaxkv.planner import KVCacheConfig

_log = logging.getLogger(__name__)


class SchedulerError(JaxkvError, ValueError):
    """The scheduler was set up, or given a request, it cannot serve."""


class DuplicateRequestIdError(SchedulerError):
    """A request id already waiting, running or holding blocks was queued again."""


class RequestTooLongError(SchedulerError):
    """A prompt leaves no room for one output token within max_model_len."""


class PoolTooSmallError(SchedulerError):
    """A request cannot get its blocks even with the whole pool to itself."""


def check_positive_int(name: str, value: object) -> int:
    """``value`` as an int; :class:`SchedulerError` naming ``name`` unless it is an int > 0."""
    return check_int(name, value, minimum=1, error=SchedulerError)


def check_prompt_fits(request_id: str, num_prompt_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt that leaves no room for an output token."""
    if num_prompt_tokens >= max_model_len:
        raise RequestTooLongError(
            f"request {request_id!r} has a {num_prompt_tokens}-token prompt; "
            f"max_model_len={max_model_len} leaves no room for an output token"
        )


@runtime_checkable
class ScheduledManager(Protocol):
    """The calls the scheduler and the trace simulator make of a KV cache manager.

    :class:`~jaxkv.core.manager.KVCacheManager` is one. A prefix hit is whatever the manager's
    ``get_computed_blocks`` returns; the scheduler only hands it back to ``allocate_slots``.
    ``chunk_limit`` may return 0 (no chunk within the budget ends where the manager needs
    it to, as in vLLM's align mode): a running request then waits a step and admission stops.
    The scheduler passes its ``max_num_batched_tokens`` as ``max_chunk_tokens``, so the
    manager can tell a chunk that waits for a fuller step from one that never could end there.
    A step is scheduled inside ``step_transaction()`` (the engine's and the simulator's):
    a state cached in it is no hit before the next.
    """

    max_model_len: int

    @property
    def config(self) -> KVCacheConfig: ...

    @property
    def usage(self) -> float: ...

    def has_request(self, request_id: str) -> bool: ...

    def get_computed_blocks(self, request: Request) -> tuple[Any, int]: ...

    def chunk_limit(
        self, request: Request, start: int, num_new_tokens: int, max_chunk_tokens: int | None = None
    ) -> int: ...

    def allocate_slots(
        self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0, new_computed_blocks: Any = None
    ) -> Any: ...

    def allocate_decode_slots(self, requests: Sequence[Request]) -> int: ...

    def append_token_ids(self, requests: Sequence[Request], token_ids: Sequence[int]) -> None: ...

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]: ...

    def free(self, request: Request) -> None: ...

    def prefix_cache_stats(self) -> PrefixCacheStats: ...

    def step_transaction(self) -> AbstractContextManager[None]: ...


class AdmissionAllocator(Protocol):
    """Allocates a waiting request after its device prefix hit (e.g. extending it from
    an offload tier): returns its computed tokens, having given it slots for
    ``min(num_tokens - computed, budget)`` new tokens cut at its next checkpoint
    (:meth:`~jaxkv.core.manager.KVCacheManager.chunk_limit`), or None (nothing changed)."""

    def allocate_admitted(self, request: Request, hit: KVCacheBlocks, num_hit: int, budget: int) -> int | None: ...


@dataclass(eq=False, slots=True)
class SeqState:
    """A request in flight: its manager-side ``Request`` and its generation limits.

    ``num_cached_tokens`` is the prefix-cache hit at first admission (None before).
    ``num_placeholders`` counts the tokens drawn on the device and not appended yet
    (asynchronous scheduling); ``finished`` turns True when the scheduler retires it.
    """

    request: Request
    max_new_tokens: int
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    num_placeholders: int = 0
    finished: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_tokens - self.request.num_prompt_tokens


class ScheduledChunk(NamedTuple):
    """Tokens ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` of a request.

    ``block_ids`` is the request's whole block table per KV cache group after this
    step's allocation. ``samples`` is True when the chunk completes the request's
    context, so its last token's logits give the next token. (A NamedTuple: the
    scheduler makes one per running request per step, and it is cheap to build.)
    """

    seq: SeqState
    num_computed_tokens: int
    num_new_tokens: int
    block_ids: tuple[list[int], ...]
    samples: bool

    @property
    def request_id(self) -> str:
        """The request's id: with the counts, what step metadata reads of a chunk
        (:class:`~jaxkv.device.metadata.StepSeq`)."""
        return self.seq.request.request_id

    @property
    def token_ids(self) -> list[int]:
        start = self.num_computed_tokens
        return self.seq.request.all_token_ids[start : start + self.num_new_tokens]


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: its chunks, decodes (one new token) first, then prefill chunks."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[SeqState, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    """Continuous batching of requests over one KV cache manager (:class:`ScheduledManager`).

    ``record_block_ids=False`` leaves ``ScheduledChunk.block_ids`` empty, for callers
    that run no device step (the trace simulator) and should not pay for the copies.
    ``admission`` replaces the allocation of admitted requests (an offload connector);
    ``SeqState.num_cached_tokens`` then counts the tokens it supplied too.
    """

    def __init__(
        self,
        manager: ScheduledManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        record_block_ids: bool = True,
        admission: AdmissionAllocator | None = None,
    ) -> None:
        if not isinstance(manager, ScheduledManager):
            raise SchedulerError(f"manager must be a KVCacheManager (or a ScheduledManager), got {manager!r}")
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.record_block_ids = record_block_ids
        self.admission = admission
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self._queued_ids: set[str] = set()  # waiting or running
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request, max_new_tokens: int) -> SeqState:
        """Queue a new request (``num_computed_tokens`` 0) that may generate ``max_new_tokens``."""
        max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
        if not isinstance(request, Request):
            raise SchedulerError(f"request must be a jaxkv.core.manager.Request, got {request!r}")
        rid = request.request_id
        if rid in self._queued_ids or self.manager.has_request(rid):
            raise DuplicateRequestIdError(f"request id {rid!r} is already queued, running or holding blocks")
        if request.num_computed_tokens:
            raise SchedulerError(
                f"request {request.request_id!r} has num_computed_tokens={request.num_computed_tokens}; "
                "a new request starts at 0"
            )
        check_prompt_fits(request.request_id, request.num_prompt_tokens, self.manager.max_model_len)
        seq = SeqState(request, max_new_tokens)
        self.waiting.append(seq)
        self._queued_ids.add(rid)
        return seq

    def finish(self, seqs: Sequence[SeqState]) -> None:
        """Retire requests that ended (stopped, reached their length, aborted, or dropped by a
        failed step): out of the queues, their blocks freed (what they computed stays in
        the prefix cache). The one way a request leaves the scheduler: :meth:`update`
        retires the requests at their length through it, the engine the others."""
        if not seqs:
            return
        gone = set(seqs)
        self.running = [s for s in self.running if s not in gone]
        if any(s in gone for s in self.waiting):
            self.waiting = deque(s for s in self.waiting if s not in gone)
        for seq in seqs:
            seq.finished = True
            self._queued_ids.discard(seq.request_id)
            self._free_blocks(seq)

    def _free_blocks(self, seq: SeqState) -> None:
        """Release what ``seq`` holds in the manager (a waiting request holds nothing):
        the only call that frees blocks, for a finished or a preempted request."""
        if self.manager.has_request(seq.request_id):
            self.manager.free(seq.request)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks and allocate their slots."""
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[SeqState] = []
        i = 0
        while i < len(self.running) and budget > 0:
            decoding = self._decode_run(i, budget)
            if decoding:  # one call for the run of decodes; a request it cannot serve goes below
                served = self.manager.allocate_decode_slots(decoding)
                for seq in self.running[i : i + served]:
                    self._add_chunk(seq, 1, decodes, prefills)
                budget -= served
                i += served
                if served == len(decoding):
                    continue
            seq = self.running[i]
            if self._finishing(seq):
                i += 1
                continue
            req = seq.request
            n = min(req.num_tokens + seq.num_placeholders - req.num_computed_tokens, budget)
            if n > 1:
                n = self.manager.chunk_limit(req, req.num_computed_tokens, n, self.max_num_batched_tokens)
                if not n:  # no chunk within the budget ends where the manager needs: next step
                    i += 1
                    continue
            if not self._allocate_running(seq, n, preempted, alone=i == 0):
                break
            self._add_chunk(seq, n, decodes, prefills)
            budget -= n
            i += 1
        if not preempted:
            budget = self._admit_waiting(budget, decodes, prefills)
        if not (decodes or prefills) and self.waiting and not self._in_flight():
            head = self.waiting[0].request
            message = (
                f"request {head.request_id!r} ({head.num_tokens} tokens) cannot be admitted into an idle "
                f"pool of {self.manager.config.num_usable_blocks} usable blocks"
            )
            _log.warning("refused: %s", message)
            raise PoolTooSmallError(message)
        self.num_scheduled_tokens += self.max_num_batched_tokens - budget
        return SchedulerOutput(tuple(decodes + prefills), tuple(preempted))

    def _decode_run(self, start: int, budget: int) -> list[Request]:
        """The requests of the running ones from ``start`` on that each decode one token
        this step, up to the first that does not (or ``budget`` of them)."""
        run = []
        for seq in islice(self.running, start, start + budget):
            req = seq.request
            if req.num_tokens + seq.num_placeholders - req.num_computed_tokens != 1 or (
                seq.num_placeholders and self._finishing(seq)
            ):
                break
            run.append(req)
        return run

    def _finishing(self, seq: SeqState) -> bool:
        """Whether the tokens ``seq`` has in flight take it to its length (it must not be scheduled)."""
        ahead = seq.num_placeholders
        return bool(ahead) and (
            seq.num_output_tokens + ahead >= seq.max_new_tokens
            or seq.request.num_tokens + ahead >= self.manager.max_model_len
        )

    def _in_flight(self) -> bool:
        """Whether some request waits for tokens drawn on the device (an empty step is then no deadlock:
        reading them back retires or advances it)."""
        return any(s.num_placeholders for s in self.running) or any(s.num_placeholders for s in self.waiting)

    def _add_chunk(self, seq: SeqState, n: int, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> None:
        """Record ``n`` tokens of ``seq`` as a decode (one token) or a prefill chunk."""
        req = seq.request
        start = req.num_computed_tokens
        block_ids = self.manager.get_block_ids(req.request_id) if self.record_block_ids else ()
        chunk = ScheduledChunk(seq, start, n, block_ids, start + n == req.num_tokens + seq.num_placeholders)
        (decodes if n == 1 else prefills).append(chunk)

    def _allocate_running(self, seq: SeqState, n: int, preempted: list[SeqState], alone: bool) -> bool:
        """Allocate ``n`` more slots, preempting from the back; False if ``seq`` itself went."""
        while self.manager.allocate_slots(seq.request, n) is None:
            victim = self.running.pop()
            if victim is seq and alone:
                message = (
                    f"request {seq.request_id!r} cannot grow to {seq.request.num_computed_tokens + n} "
                    f"tokens even alone in a pool of {self.manager.config.num_usable_blocks} usable blocks"
                )
                _log.warning("refused: %s", message)
                raise PoolTooSmallError(message)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: SeqState) -> None:
        self._free_blocks(seq)
        seq.request.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        _log.debug(  # DEBUG: under memory pressure preemptions come every step
            "preempted request %r (recompute; %d preemption(s) of it, %d in all)",
            seq.request_id,
            seq.num_preemptions,
            self.num_preemptions,
        )

    def _admit_waiting(self, budget: int, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> int:
        """Admit waiting requests FCFS while the token budget and max_num_seqs allow; return the budget left."""
        mgr = self.manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_placeholders:  # preempted with a token in flight: admitted once it is known
                break
            req = seq.request
            hit, num_hit = mgr.get_computed_blocks(req)
            if self.admission is not None:
                admitted = self.admission.allocate_admitted(req, hit, num_hit, budget)
                if admitted is None:
                    break
                num_hit = admitted
                n = mgr.chunk_limit(req, num_hit, min(req.num_tokens - num_hit, budget))
            else:
                n = mgr.chunk_limit(req, num_hit, min(req.num_tokens - num_hit, budget), self.max_num_batched_tokens)
                if not n or mgr.allocate_slots(req, n, num_hit, hit) is None:
                    break
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_hit
            self.running.append(seq)
            self._add_chunk(seq, n, decodes, prefills)
            budget -= n
        return budget

    # -------------------------------------------------------------- update
    def update(self, output: SchedulerOutput, sampled: Sequence[int]) -> list[SeqState]:
        """Advance the scheduled chunks, append sampled tokens, retire finished requests
        (the synchronous loop: :meth:`advance` and :meth:`resolve` at once).

        ``sampled[i]`` is the token generated for ``output.chunks[i]`` (read only
        where the chunk ``samples``). A request finishes at ``max_new_tokens`` outputs
        or at ``max_model_len`` tokens (:meth:`finish`). Returns the finished.
        """
        sampling = self._append(output, sampled)  # a bad token: nothing changes
        for chunk in output.chunks:
            chunk.seq.request.num_computed_tokens += chunk.num_new_tokens
        return self._retire(sampling)

    def advance(self, output: SchedulerOutput) -> None:
        """A step was dispatched, its tokens not yet known: advance its chunks and hold a
        placeholder for each token it draws, so the next :meth:`schedule` decodes it."""
        for chunk in output.chunks:
            seq = chunk.seq
            seq.request.num_computed_tokens += chunk.num_new_tokens
            if chunk.samples:
                seq.num_placeholders += 1

    def resolve(self, output: SchedulerOutput, sampled: Sequence[int]) -> list[SeqState]:
        """The tokens of a step passed to :meth:`advance`, read back: each replaces its
        placeholder (requests retired since, stopped or aborted, drop theirs); the requests
        at their length are retired and returned."""
        sampling = self._append(output, sampled)
        for seq in sampling:
            seq.num_placeholders -= 1
        return self._retire(sampling)

    def _append(self, output: SchedulerOutput, sampled: Sequence[int]) -> list[SeqState]:
        """Append each drawing chunk's token to its request (not to a retired one); those requests."""
        if len(sampled) < len(output.chunks):
            raise SchedulerError(f"got {len(sampled)} sampled tokens for {len(output.chunks)} scheduled chunks")
        sampling: list[SeqState] = []
        tokens = []
        for chunk, token in zip(output.chunks, sampled, strict=True):
            if chunk.samples and not chunk.seq.finished:
                sampling.append(chunk.seq)
                tokens.append(token)
        self.manager.append_token_ids([seq.request for seq in sampling], tokens)
        return sampling

    def _retire(self, sampling: list[SeqState]) -> list[SeqState]:
        """Finish the requests of ``sampling`` at their length; those."""
        limit = self.manager.max_model_len
        done = [
            seq for seq in sampling if seq.num_output_tokens >= seq.max_new_tokens or seq.request.num_tokens >= limit
        ]
        self.finish(done)
        return done
