"""Replay a request trace through a KV cache manager with the serving loop's scheduler.

The scheduling decisions are :class:`jaxkv.serving.scheduler.Scheduler`'s (vLLM v1
style), exactly those the device engine makes. No device work happens: "computing"
tokens advances ``num_computed_tokens``, and a request whose prompt (or preempted
context) is fully computed "generates" its next token with :func:`output_token_ids`,
a deterministic function of (request id, position). Runs therefore repeat exactly,
and a trace builder knows in advance which tokens a turn will generate:
:func:`synthetic_trace` builds each follow-up turn eagerly as the previous prompt +
that turn's output + a new user message, so follow-ups hit the prefix cache.

Time is in seconds. Requests carry an ``arrival_time``; every scheduler step lasts
``step_duration_s`` of simulated time, and when nothing is queued or running the clock
jumps to the next arrival (idle time costs no steps).

Trace files are UTF-8 JSON: a list of objects, one per request, with the fields of
:class:`TraceRequest` (``request_id`` non-empty str, ``arrival_time`` finite number >= 0,
``prompt_token_ids`` non-empty list of ints in [0, 2**31), ``max_output_tokens``
int >= 1, and optionally ``cache_salt`` and ``lora_name``, str or null, and
``branch_points``, a list of positions inside the prompt: ``Request.branch_points``). Anything
else in a file (bad bytes, bad JSON, a wrong type, a missing or unknown field, a
number too large to read) raises :class:`TraceError` naming the file, the entry and
the value; only an unreadable file raises ``OSError``.

A prompt of ``max_model_len`` tokens or more leaves no room for an output token: the
simulator refuses the whole trace up front with :class:`RequestTooLongError`. A
request whose prompt fits but whose outputs would pass ``max_model_len`` stops there
(counted in ``num_capped``), as in vLLM: ``max_output_tokens`` may be any int >= 1
(10**11 too), and the replay generates at most ``max_model_len - len(prompt)`` of them.

The manager keeps host bookkeeping for every block up front (about 72 bytes a block,
more once used), so a plan of more than :data:`MAX_NUM_BLOCKS` (2**24, about 1.2 GiB
of bookkeeping) blocks is refused by :func:`check_num_blocks` before a manager is
built: a 1 PiB budget would otherwise plan hundreds of millions of blocks. Real
budgets stay far below it (Gemma-3-27B in 80 GiB: about 50,000 blocks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from jaxkv.core.hashing import MAX_TOKEN_ID
from jaxkv.core.manager import KVCacheManagerError, Request
from jaxkv.core.request import checked_branch_points
from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int, check_int_range, is_int
from jaxkv.serving.scheduler import (
    PoolTooSmallError,
    RequestTooLongError,
    ScheduledManager,
    Scheduler,
    SchedulerError,
    SeqState,
    check_positive_int,
    check_prompt_fits,
)

__all__ = [
    "MAX_NUM_BLOCKS",
    "VOCAB_SIZE",
    "PlanTooLargeError",
    "PoolTooSmallError",
    "Progress",
    "RequestTooLongError",
    "SimulationError",
    "SimulationResult",
    "Simulator",
    "TraceError",
    "TraceRequest",
    "check_num_blocks",
    "load_trace",
    "output_token_ids",
    "save_trace",
    "synthetic_trace",
]

VOCAB_SIZE = 32_000
"""Token ids of synthetic prompts and of generated tokens lie in [0, VOCAB_SIZE)."""

MAX_NUM_BLOCKS = 1 << 24
"""The most blocks a simulated plan may have (host bookkeeping; see the module docstring)."""

_REQUIRED_FIELDS = ("request_id", "arrival_time", "prompt_token_ids", "max_output_tokens")
_OPTIONAL_FIELDS = ("cache_salt", "lora_name")
_FIELDS = (*_REQUIRED_FIELDS, *_OPTIONAL_FIELDS, "branch_points")


class TraceError(JaxkvError, ValueError):
    """A trace (file, request or synthetic knob) that cannot be replayed."""


SimulationError = SchedulerError
"""The simulator was set up, or given a trace, it cannot run (the scheduler's error
type, so :class:`RequestTooLongError` and :class:`PoolTooSmallError` are ones too)."""


class PlanTooLargeError(SimulationError):
    """A KV cache plan with more blocks than the simulator keeps bookkeeping for."""


def check_num_blocks(num_blocks: int) -> int:
    """``num_blocks`` if a manager of that many blocks is sane to build on the host.

    Raises :class:`PlanTooLargeError` naming it above :data:`MAX_NUM_BLOCKS`.
    """
    num_blocks = check_int("num_blocks", num_blocks, minimum=1, error=SimulationError)
    if num_blocks > MAX_NUM_BLOCKS:
        raise PlanTooLargeError(
            f"the plan has {num_blocks:,} blocks; the simulator keeps host bookkeeping per block and "
            f"takes at most {MAX_NUM_BLOCKS:,} (2**24): plan a smaller memory budget"
        )
    return num_blocks


def _token_ids(value: object, where: str) -> tuple[int, ...]:
    """``value`` as a tuple of valid token ids, or a TraceError naming the bad position."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) == 0:
        raise TraceError(f"{where}field 'prompt_token_ids' must be a non-empty list of ints, got {value!r:.80}")
    for pos, token in enumerate(value):
        if not is_int(token) or not 0 <= token <= MAX_TOKEN_ID:
            raise TraceError(
                f"{where}field 'prompt_token_ids'[{pos}] must be a token id in [0, 2**31), got {token!r:.80}"
            )
    return tuple(int(t) for t in value)


def _is_utf8(text: str) -> bool:
    """False for a str holding lone surrogates (JSON's "\\ud800"), which cannot be hashed or saved."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _arrival_time(value: object, where: str) -> float:
    """``value`` as a finite float >= 0, or a TraceError (ints too large for a float included)."""
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    try:
        arrival = float(value) if ok else math.nan  # type: ignore[arg-type]  # a real number when ok
    except OverflowError:
        arrival = math.inf
    if not (math.isfinite(arrival) and arrival >= 0):
        raise TraceError(f"{where}field 'arrival_time' must be a finite number >= 0, got {value!r:.80}")
    return arrival


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: what arrives when, and how much it may generate.

    ``arrival_time`` is in seconds; ``prompt_token_ids`` may be any sequence of ints
    (stored as a tuple). Bad fields raise :class:`TraceError` naming the field.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    max_output_tokens: int
    cache_salt: str | None = None
    lora_name: str | None = None
    branch_points: tuple[int, ...] = ()
    """Where later prompts may leave this one (a chat's message boundaries, as
    ``jaxkv-server`` names them): :class:`~jaxkv.core.request.Request`'s."""

    def __post_init__(self) -> None:
        rid = self.request_id
        if not isinstance(rid, str) or not rid or not _is_utf8(rid):
            raise TraceError(f"field 'request_id' must be a non-empty UTF-8 str, got {rid!r:.80}")
        where = f"request {rid!r:.80}: "
        object.__setattr__(self, "arrival_time", _arrival_time(self.arrival_time, where))
        object.__setattr__(self, "prompt_token_ids", _token_ids(self.prompt_token_ids, where))
        max_out = check_int(f"{where}field 'max_output_tokens'", self.max_output_tokens, minimum=1, error=TraceError)
        object.__setattr__(self, "max_output_tokens", max_out)
        for name in _OPTIONAL_FIELDS:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and _is_utf8(value)):
                raise TraceError(f"{where}field {name!r} must be a UTF-8 str or null, got {value!r:.80}")
        try:
            points = checked_branch_points(self.branch_points, len(self.prompt_token_ids), f"{where}field")
        except KVCacheManagerError as err:
            raise TraceError(str(err)) from None
        object.__setattr__(self, "branch_points", points)

    def to_json(self) -> dict[str, object]:
        """The request as a JSON-able object of the trace file schema."""
        out: dict[str, object] = {
            "request_id": self.request_id,
            "arrival_time": self.arrival_time,
            "prompt_token_ids": list(self.prompt_token_ids),
            "max_output_tokens": self.max_output_tokens,
        }
        out.update({name: getattr(self, name) for name in _OPTIONAL_FIELDS if getattr(self, name) is not None})
        if self.branch_points:
            out["branch_points"] = list(self.branch_points)
        return out


# ------------------------------------------------------------------ traces
def output_token_ids(request_id: str, count: int) -> list[int]:
    """The first ``count`` tokens the simulator generates for ``request_id``.

    Seeded by a hash of the id alone, so the trace builder, every run and every
    scheduling order (with or without caching or preemption) agree.
    """
    seed = int.from_bytes(hashlib.blake2b(request_id.encode("utf-8"), digest_size=8).digest(), "little")
    ids: list[int] = np.random.default_rng(seed).integers(0, VOCAB_SIZE, count).tolist()
    return ids


def _check_rate(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise TraceError(f"{name} must be a finite number > 0, got {value!r}")


def synthetic_trace(
    *,
    num_conversations: int = 100,
    turns_per_conversation: int = 3,
    num_system_prompts: int = 4,
    system_prompt_len: int = 1024,
    user_turn_len: tuple[int, int] = (64, 512),
    output_len: tuple[int, int] = (32, 256),
    arrival_rate: float = 1.0,
    turn_gap_s: float = 10.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """Multi-turn chats over shared system prompts, sorted by arrival time.

    Conversations start as a Poisson process (``arrival_rate`` per second) and each
    picks one of ``num_system_prompts`` system prompts. Turn k's prompt is turn k-1's
    prompt + turn k-1's output (exactly what the simulator will generate, see
    :func:`output_token_ids`) + a new user message; it arrives an exponential gap of
    mean ``turn_gap_s`` after turn k-1 arrived. Turn k's request id is
    ``conv{c}-turn{k}``; every turn asks for exactly its output length.
    """
    check_int("num_conversations", num_conversations, minimum=1, error=TraceError)
    check_int("turns_per_conversation", turns_per_conversation, minimum=1, error=TraceError)
    check_int("num_system_prompts", num_system_prompts, minimum=1, error=TraceError)
    check_int("system_prompt_len", system_prompt_len, minimum=0, error=TraceError)
    check_int("seed", seed, minimum=0, error=TraceError)
    _check_rate("arrival_rate", arrival_rate)
    _check_rate("turn_gap_s", turn_gap_s)
    user_lo, user_hi = check_int_range("user_turn_len", user_turn_len, error=TraceError)
    out_lo, out_hi = check_int_range("output_len", output_len, error=TraceError)
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB_SIZE, system_prompt_len).tolist() for _ in range(num_system_prompts)]
    starts = np.cumsum(rng.exponential(1.0 / arrival_rate, num_conversations))
    trace = []
    for c in range(num_conversations):
        context = systems[rng.integers(num_system_prompts)]
        arrival = float(starts[c])
        for k in range(turns_per_conversation):
            if k:
                arrival += float(rng.exponential(turn_gap_s))
            rid = f"conv{c}-turn{k}"
            prompt = context + rng.integers(0, VOCAB_SIZE, rng.integers(user_lo, user_hi + 1)).tolist()
            num_out = int(rng.integers(out_lo, out_hi + 1))
            trace.append(TraceRequest(rid, arrival, prompt, num_out))
            context = prompt + output_token_ids(rid, num_out)
    trace.sort(key=lambda r: r.arrival_time)
    return trace


def _request_from_json(obj: object) -> TraceRequest:
    if not isinstance(obj, Mapping):
        raise TraceError(f"must be an object with fields {', '.join(_REQUIRED_FIELDS)}, got {obj!r:.80}")
    missing = [name for name in _REQUIRED_FIELDS if name not in obj]
    if missing:
        raise TraceError(f"missing field {missing[0]!r}")
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise TraceError(f"unknown field {unknown[0]!r}; valid: {', '.join(_FIELDS)}")
    return TraceRequest(**obj)


def _check_unique_ids(trace: Sequence[TraceRequest]) -> None:
    seen: set[str] = set()
    for i, req in enumerate(trace):
        if req.request_id in seen:
            raise TraceError(f"entry [{i}]: duplicate request_id {req.request_id!r}")
        seen.add(req.request_id)


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read a JSON trace file (schema in the module docstring), in file order.

    Raises :class:`TraceError` naming the file (and entry) for anything but a readable
    UTF-8 JSON trace; ``OSError`` if the file cannot be read at all.
    """
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise TraceError(
            f"{path}: not UTF-8 text: byte {raw[err.start : err.start + 1]!r} at offset {err.start}"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise TraceError(f"{path}: not valid JSON: {err}") from None
    except (ValueError, RecursionError) as err:  # a number of over 4300 digits; nesting too deep
        raise TraceError(f"{path}: cannot read the JSON: {str(err).splitlines()[0]:.160}") from None
    if not isinstance(data, list):
        raise TraceError(f"{path}: a trace is a JSON list of request objects, got {type(data).__name__}")
    trace = []
    for i, obj in enumerate(data):
        try:
            trace.append(_request_from_json(obj))
        except TraceError as err:
            raise TraceError(f"{path}: entry [{i}]: {err}") from None
    try:
        _check_unique_ids(trace)
    except TraceError as err:
        raise TraceError(f"{path}: {err}") from None
    return trace


def save_trace(path: str | Path, trace: Sequence[TraceRequest]) -> None:
    """Write ``trace`` as a JSON trace file, one request per line."""
    lines = ",\n".join(json.dumps(req.to_json(), separators=(",", ":")) for req in trace)
    Path(path).write_text(f"[\n{lines}\n]\n" if trace else "[]\n")


# --------------------------------------------------------------- simulator
@dataclass(frozen=True)
class Progress:
    """A snapshot handed to the progress callback (cache counters in tokens, since the run started)."""

    step: int
    time_s: float
    num_waiting: int
    num_running: int
    num_finished: int
    num_requests: int
    usage: float
    num_preemptions: int
    cache_queried_tokens: int = 0
    cache_hit_tokens: int = 0


@dataclass(frozen=True)
class SimulationResult:
    """What one replay did.

    ``num_prompt_hit_tokens`` counts each request's prefix hit at its first admission
    (over ``num_prompt_tokens``). The ``cache_*`` counters are the manager's own
    (:meth:`~jaxkv.core.manager.KVCacheManager.prefix_cache_stats`, this run only): they also count the
    re-queries of a preempted request and of a waiting request retried while blocked.
    Host times cover the scheduler and every manager call of a step.
    """

    num_requests: int
    num_finished: int
    num_capped: int
    num_steps: int
    simulated_time_s: float
    num_prompt_tokens: int
    num_prompt_hit_tokens: int
    cache_queries: int
    cache_queried_tokens: int
    cache_hit_tokens: int
    num_scheduled_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    peak_usage: float
    mean_usage: float
    host_us_mean: float
    host_us_p50: float
    host_us_p99: float
    host_s_total: float
    outputs: dict[str, tuple[int, ...]] = field(repr=False, compare=False)

    @property
    def prompt_hit_rate(self) -> float:
        return self.num_prompt_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_hit_tokens / self.cache_queried_tokens if self.cache_queried_tokens else 0.0

    def outputs_digest(self) -> str:
        """A short hash of every request's generated tokens (compare runs by it)."""
        data = json.dumps(sorted(self.outputs.items()), separators=(",", ":")).encode()
        return hashlib.sha256(data).hexdigest()[:16]

    def to_dict(self) -> dict[str, object]:
        """The counters, rates and outputs digest as a JSON-able dict."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "outputs"}
        out.update(
            prompt_hit_rate=self.prompt_hit_rate,
            cache_hit_rate=self.cache_hit_rate,
            outputs_digest=self.outputs_digest(),
        )
        return out


class Simulator:
    """Replays traces through :class:`jaxkv.serving.scheduler.Scheduler` (vLLM v1 style).

    Each step schedules, within ``max_num_batched_tokens``: first the running
    requests in admission order (one decode token, or the next prefill chunk), then
    waiting requests FCFS up to ``max_num_seqs`` running (prefix-cache lookup, then a
    chunk limited by the remaining budget). A running request that cannot get its
    blocks preempts the most recently admitted running request (freed, progress
    reset, back at the head of the queue) and retries; no waiting request is admitted
    in a step that preempted.
    """

    def __init__(
        self,
        manager: ScheduledManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        step_duration_s: float = 0.02,
    ) -> None:
        if not isinstance(manager, ScheduledManager):
            raise SimulationError(f"manager must be a KVCacheManager (or a ScheduledManager), got {manager!r}")
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if (
            isinstance(step_duration_s, bool)
            or not isinstance(step_duration_s, (int, float))
            or not (0 < step_duration_s < math.inf)
        ):
            raise SimulationError(f"step_duration_s must be a finite number > 0, got {step_duration_s!r}")
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.step_duration_s = float(step_duration_s)

    def check_trace(self, trace: Sequence[TraceRequest]) -> None:
        """Refuse duplicate ids and prompts with no room for an output token."""
        _check_unique_ids(trace)
        for req in trace:
            check_prompt_fits(req.request_id, len(req.prompt_token_ids), self.manager.max_model_len)

    def run(
        self,
        trace: Sequence[TraceRequest],
        *,
        progress: Callable[[Progress], None] | None = None,
        progress_every: int = 1000,
    ) -> SimulationResult:
        """Replay ``trace`` until every request has finished; report what happened."""
        self.check_trace(trace)
        check_positive_int("progress_every", progress_every)
        return _Replay(self, trace).run(progress, progress_every)


class _Replay:
    """The state of one Simulator.run: arrivals, the scheduler, clock and counters."""

    def __init__(self, sim: Simulator, trace: Sequence[TraceRequest]) -> None:
        self.sim = sim
        self.manager = sim.manager
        self.scheduler = Scheduler(
            sim.manager,
            max_num_seqs=sim.max_num_seqs,
            max_num_batched_tokens=sim.max_num_batched_tokens,
            record_block_ids=False,
        )
        self.pending = deque(sorted(trace, key=lambda r: r.arrival_time))
        self.outputs: dict[str, list[int]] = {}
        self.finished: list[SeqState] = []
        self.num_requests = len(trace)
        self.clock = 0.0
        self.host_s: list[float] = []
        self.usages: list[float] = []
        self.stats_before = self.manager.prefix_cache_stats()

    def run(self, progress: Callable[[Progress], None] | None, every: int) -> SimulationResult:
        scheduler = self.scheduler
        while self.pending or scheduler.has_unfinished:
            self._arrive()
            start = time.perf_counter()
            with self.manager.step_transaction():  # as the engine schedules a step
                output = scheduler.schedule()
            usage = self.manager.usage
            sampled = [
                self.outputs[c.seq.request_id][c.seq.num_output_tokens] if c.samples else 0 for c in output.chunks
            ]
            self.finished.extend(scheduler.update(output, sampled))
            self.host_s.append(time.perf_counter() - start)
            self.usages.append(usage)
            self.clock += self.sim.step_duration_s
            if progress is not None and len(self.host_s) % every == 0:
                progress(self._progress())
        return self._result()

    def _arrive(self) -> None:
        """Queue every request that has arrived; jump the clock over idle time."""
        if not self.scheduler.has_unfinished:
            self.clock = max(self.clock, self.pending[0].arrival_time)
        while self.pending and self.pending[0].arrival_time <= self.clock:
            req = self.pending.popleft()
            request = Request(
                req.request_id,
                req.prompt_token_ids,
                cache_salt=req.cache_salt,
                lora_name=req.lora_name,
                branch_points=req.branch_points,
            )
            # Generation stops at max_model_len: draw no more tokens than fit (a trace may
            # ask for 10**11); the scheduler still sees the request's own limit, so a
            # request stopped by max_model_len counts in num_capped.
            room = self.manager.max_model_len - len(req.prompt_token_ids)
            self.outputs[req.request_id] = output_token_ids(req.request_id, min(req.max_output_tokens, room))
            self.scheduler.add_request(request, req.max_output_tokens)

    # ------------------------------------------------------------ reports
    def _progress(self) -> Progress:
        stats = self.manager.prefix_cache_stats()
        return Progress(
            step=len(self.host_s),
            time_s=self.clock,
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_finished=len(self.finished),
            num_requests=self.num_requests,
            usage=self.usages[-1],
            num_preemptions=self.scheduler.num_preemptions,
            cache_queried_tokens=stats.num_queried_tokens - self.stats_before.num_queried_tokens,
            cache_hit_tokens=stats.num_hit_tokens - self.stats_before.num_hit_tokens,
        )

    def _result(self) -> SimulationResult:
        stats = self.manager.prefix_cache_stats()
        before = self.stats_before
        host_us = np.asarray(self.host_s) * 1e6
        p50, p99 = np.percentile(host_us, [50, 99]) if host_us.size else (0.0, 0.0)
        outputs = {s.request_id: tuple(s.request.output_token_ids) for s in self.finished}
        return SimulationResult(
            num_requests=self.num_requests,
            num_finished=len(self.finished),
            num_capped=sum(len(outputs[s.request_id]) < s.max_new_tokens for s in self.finished),
            num_steps=len(self.host_s),
            simulated_time_s=self.clock,
            num_prompt_tokens=sum(s.request.num_prompt_tokens for s in self.finished),
            num_prompt_hit_tokens=sum(s.num_cached_tokens or 0 for s in self.finished),
            cache_queries=stats.num_requests - before.num_requests,
            cache_queried_tokens=stats.num_queried_tokens - before.num_queried_tokens,
            cache_hit_tokens=stats.num_hit_tokens - before.num_hit_tokens,
            num_scheduled_tokens=self.scheduler.num_scheduled_tokens,
            num_generated_tokens=sum(map(len, outputs.values())),
            num_preemptions=self.scheduler.num_preemptions,
            peak_usage=max(self.usages, default=0.0),
            mean_usage=float(np.mean(self.usages)) if self.usages else 0.0,
            host_us_mean=float(host_us.mean()) if host_us.size else 0.0,
            host_us_p50=float(p50),
            host_us_p99=float(p99),
            host_s_total=float(sum(self.host_s)),
            outputs=outputs,
        )
