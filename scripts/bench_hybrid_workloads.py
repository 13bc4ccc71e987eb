"""Prompt hit rate of a Qwen3-Next-80B-shaped hybrid on the workload kinds of issue 39, at tight memory.

Users of vLLM and SGLang reported lost prefix hits on hybrid models for five kinds of
workload; each is a seeded request trace here, replayed through jaxkv's scheduler
(:class:`jaxkv.serving.simulator.Simulator`, as ``scripts/bench_hybrid.py`` replays its
chat traces):

* ``prefix_once``: pairs of requests, the second sharing the first's long prefix
  (1-4k tokens) with another suffix (16 to 1,024 tokens), many pairs interleaved;
* ``near_duplicate``: requests that share most of one of a few 5-6k-token documents
  (each cut at 85-100 % of the document, then a different tail);
* ``short_behind_prefix``: 200 short prompts, one of 4 system prompts and a short query;
* ``agent``: agent conversations interleaved, each turn appending the model's call and a
  tool output of 100-2,000 tokens;
* ``forks``: bursts of branches off one conversation, more branches than states fit.

Each trace runs three ways in the same bytes, in one run: jaxkv with its defaults (the plan
:func:`~jaxkv.planner.plan_kv_cache` picks, :class:`~jaxkv.core.manager.KVCacheManager` as
the Engine builds it), vLLM 0.33's own manager in align mode with its engine's defaults
(:class:`~jaxkv.benchmarks.vllm_manager.VllmManager`) and the attention-only twin (the
model's attention layers alone). A fourth replay, the ``jaxkv chat`` column, gives jaxkv
each request's chat message boundaries (``branch_points``, as ``jaxkv-server`` names them
from a chat template: the end of ``short_behind_prefix``'s and an agent's system prompt,
``prefix_once``'s prefix as if it were the chat's messages but the last, whose start follows
no turn of the model's; a fork's last message follows the base's answer, where a state
already is, and ``near_duplicate``'s cuts are no message boundary: none); the default column
passes none, as a caller of the manager does by default. Memory: each ``--memories`` factor
times vLLM's minimum memory for the trace's longest request
(``bench_hybrid.vllm_minimum_memory``'s rule: 32 requests' state blocks in vLLM's layout,
two per recurrent group in align mode, and that request's attention blocks). Replays run at
most 32 requests at once. The summary gives the mean of jaxkv / attention-only over every
row (issue 39's target: >= 0.85), and per kind whether the bytes left beside the live states
of jaxkv's replay (the most running at once) can hold the checkpoints its hits need (one
state per shared prefix open at once, with that prefix's attention KV; the live requests'
own attention KV is not counted, so "left" is an upper bound), and jaxkv's missed tokens by
cause (no checkpoint at the junction, evicted, never cached, below one block: what retention
could still win is the evicted column). Last, the admission count of ``bench_hybrid.py``'s
capacity section: requests of 929 and 1,360 tokens an idle manager admits at once at vLLM's
minimum memory for 8,192 tokens, jaxkv against vLLM.

    PYTHONPATH=. python scripts/bench_hybrid_workloads.py --out workloads.json

Flags: ``--kinds`` and ``--memories`` (comma lists), ``--nopeer`` (no vLLM: its columns read
n/a), ``--quick`` (small traces: a smoke run, not the benchmark's figures), ``--seed``,
``--out FILE.json`` (the flags shared with ``bench_hybrid.py`` are its own, imported).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from absl import app, flags
from bench_hybrid import (
    CAPACITY_PROMPTS,
    CHAT_MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MULTITURN_MAX_NUM_SEQS,
    VLLM_RULE,
    admitted_at_once,
    print_table,
    vllm_minimum_memory,
)

from jaxkv.benchmarks.vllm_manager import VllmManager, vllm_available
from jaxkv.commands.cli import exit_error, flags_parser
from jaxkv.core.manager import KVCacheManager
from jaxkv.errors import JaxkvError
from jaxkv.planner import plan_kv_cache
from jaxkv.presets import get_preset
from jaxkv.serving.scheduler import ScheduledManager
from jaxkv.serving.simulator import VOCAB_SIZE, Progress, Simulator, TraceRequest, output_token_ids
from jaxkv.specs import KVCacheSpec, MambaSpec

PROG = "bench_hybrid_workloads.py"
PRESET = "qwen3-next-80b"
ADMISSION_PROMPTS = CAPACITY_PROMPTS[:2]
"""929 and 1,360 tokens: issue 39's admission counts."""
TARGET_OVER_ATTENTION = 0.85
HOLDS_TARGET = 0.95
"""Issue 39's targets: the mean of jaxkv / attention-only over all rows, and each row whose bytes hold the states."""
MiB = 1 << 20
GiB = 1 << 30

FLAGS = flags.FLAGS  # --out, --quick, --peer/--nopeer and --seed are bench_hybrid's
flags.DEFINE_list(
    "kinds",
    ["prefix_once", "near_duplicate", "short_behind_prefix", "agent", "forks"],
    "workload kinds to run, in this order",
)
flags.DEFINE_list("memories", ["1", "2"], "memory factors: multiples of vLLM's minimum memory for the longest request")


class WorkloadError(JaxkvError):
    """A flag names no workload kind or no positive memory factor."""


@dataclass(frozen=True)
class Scale:
    """Trace sizes: the benchmark's and ``--quick``'s."""

    pairs: int
    prefix_len: tuple[int, int]
    documents: int
    requests_per_document: int
    document_len: tuple[int, int]
    short_prompts: int
    conversations: int
    turns: int
    tool_output_len: tuple[int, int]
    fork_bases: int
    branches: int


FULL = Scale(
    pairs=48,
    prefix_len=(1024, 4096),
    documents=3,
    requests_per_document=10,
    document_len=(5000, 6000),
    short_prompts=200,
    conversations=16,
    turns=8,
    tool_output_len=(100, 2000),
    fork_bases=2,
    branches=48,
)
QUICK = Scale(
    pairs=4,
    prefix_len=(512, 1024),
    documents=2,
    requests_per_document=3,
    document_len=(1200, 1500),
    short_prompts=24,
    conversations=2,
    turns=3,
    tool_output_len=(100, 400),
    fork_bases=1,
    branches=12,
)


@dataclass
class Workload:
    """A trace and, per shared prefix, the (arrival, shared tokens) of each request that reuses it."""

    trace: list[TraceRequest] = field(default_factory=list)
    shares: dict[str, list[tuple[float, int]]] = field(default_factory=dict)

    def add(self, request: TraceRequest, group: str | None = None, shared: int = 0) -> None:
        self.trace.append(request)
        if group is not None:
            self.shares.setdefault(group, []).append((request.arrival_time, shared))

    def sorted(self) -> Workload:
        self.trace.sort(key=lambda r: (r.arrival_time, r.request_id))
        return self

    def open_prefixes(self) -> tuple[int, int]:
        """(shared prefixes open at once at most, their shared tokens at that moment): a prefix is
        open from its first request's arrival to its last reuse's."""
        spans = [
            (min(t for t, _ in uses), max(t for t, _ in uses), max(n for _, n in uses)) for uses in self.shares.values()
        ]
        best = (0, 0)
        for start, _, _ in spans:
            live = [n for s, e, n in spans if s <= start <= e]
            best = max(best, (len(live), sum(live)))
        return best


OUTPUT_LEN = (32, 256)
"""Tokens each request generates (the agent's calls: 32-160): long enough that 32 run at once."""


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB_SIZE, n).tolist()


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def _log_between(rng: np.random.Generator, lo: int, hi: int) -> int:
    """An integer drawn log-uniformly from [lo, hi] (as many 16-64 as 256-1,024 suffixes)."""
    return round(float(np.exp(rng.uniform(np.log(lo), np.log(hi)))))


def prefix_once(rng: np.random.Generator, scale: Scale) -> Workload:
    """Pairs starting 8 a second; the second of a pair 2 s (mean) after the first, its prefix with another suffix."""
    work = Workload()
    start = 0.0
    for p in range(scale.pairs):
        start += float(rng.exponential(1 / 8))
        prefix = _tokens(rng, _between(rng, scale.prefix_len))
        arrivals = (start, start + float(rng.exponential(2.0)))
        for k, arrival in enumerate(arrivals):
            prompt = prefix + _tokens(rng, _log_between(rng, 16, 1024))
            request = TraceRequest(
                f"pair{p}-{k}", arrival, prompt, _between(rng, OUTPUT_LEN), branch_points=[len(prefix)]
            )
            work.add(request, f"pair{p}", len(prefix))
    return work.sorted()


def near_duplicate(rng: np.random.Generator, scale: Scale) -> Workload:
    """Requests arriving 4 a second, each on a random document cut at 85-100 % plus a new tail."""
    documents = [_tokens(rng, _between(rng, scale.document_len)) for _ in range(scale.documents)]
    work = Workload()
    arrival = 0.0
    for r in range(scale.documents * scale.requests_per_document):
        d = int(rng.integers(scale.documents))
        cut = int(len(documents[d]) * rng.uniform(0.85, 1.0))
        prompt = documents[d][:cut] + _tokens(rng, _between(rng, (16, 256)))
        work.add(TraceRequest(f"doc{d}-req{r}", arrival, prompt, _between(rng, OUTPUT_LEN)), f"doc{d}", cut)
        arrival += float(rng.exponential(1 / 4))
    return work.sorted()


SYSTEM_PROMPTS = 4


def short_behind_prefix(rng: np.random.Generator, scale: Scale) -> Workload:
    """Short prompts at 40 a second: one of 4 system prompts (192-384 tokens) and a 16-96-token query."""
    systems = [_tokens(rng, _between(rng, (192, 384))) for _ in range(SYSTEM_PROMPTS)]
    work = Workload()
    arrival = 0.0
    for r in range(scale.short_prompts):
        s = int(rng.integers(SYSTEM_PROMPTS))
        prompt = systems[s] + _tokens(rng, _between(rng, (16, 96)))
        request = TraceRequest(
            f"sys{s}-q{r}", arrival, prompt, _between(rng, OUTPUT_LEN), branch_points=[len(systems[s])]
        )
        work.add(request, f"sys{s}", len(systems[s]))
        arrival += float(rng.exponential(1 / 40))
    return work.sorted()


def agent(rng: np.random.Generator, scale: Scale) -> Workload:
    """Conversations starting 2 a second on one of 2 agent system prompts (1,024 tokens) and a task; each
    turn, 3 s (mean) after the last arrived, appends the last output (the model's call) and a tool output."""
    systems = [_tokens(rng, 1024) for _ in range(2)]
    work = Workload()
    start = 0.0
    for c in range(scale.conversations):
        start += float(rng.exponential(1 / 2))
        context = systems[c % 2] + _tokens(rng, _between(rng, (64, 256)))
        arrival = start
        for k in range(scale.turns):
            rid, num_out = f"agent{c}-turn{k}", _between(rng, (32, 160))
            work.add(
                TraceRequest(rid, arrival, context, num_out, branch_points=[1024]),
                f"agent{c}",
                len(context),
            )
            context = context + output_token_ids(rid, num_out) + _tokens(rng, _between(rng, scale.tool_output_len))
            arrival += float(rng.exponential(3.0))
    return work.sorted()


def forks(rng: np.random.Generator, scale: Scale) -> Workload:
    """Per base conversation (2-3k tokens, one a second), a burst of branches 10 s later, all at once: the
    base's prompt and output plus a 32-256-token continuation each."""
    work = Workload()
    for b in range(scale.fork_bases):
        rid, num_out, arrival = f"base{b}", _between(rng, (64, 256)), float(b)
        prompt = _tokens(rng, _between(rng, (2000, 3000)))
        work.add(TraceRequest(rid, arrival, prompt, num_out), f"base{b}", len(prompt))
        context = prompt + output_token_ids(rid, num_out)
        for n in range(scale.branches):
            branch = TraceRequest(
                f"base{b}-fork{n}",
                arrival + 10.0,
                context + _tokens(rng, _between(rng, (32, 256))),
                _between(rng, OUTPUT_LEN),
            )
            work.add(branch, f"base{b}", len(context))
    return work.sorted()


KINDS: dict[str, Callable[[np.random.Generator, Scale], Workload]] = {
    "prefix_once": prefix_once,
    "near_duplicate": near_duplicate,
    "short_behind_prefix": short_behind_prefix,
    "agent": agent,
    "forks": forks,
}


@dataclass(frozen=True)
class Side:
    """One replay's prompt hit rate and what it cost."""

    hit_rate: float
    hit_tokens: int
    prompt_tokens: int
    preemptions: int
    peak_running: int
    wall_s: float


def unnamed(trace: Sequence[TraceRequest]) -> list[TraceRequest]:
    """``trace`` without its branch points: what a caller of the manager passes by default."""
    return [dataclasses.replace(r, branch_points=()) for r in trace]


def replay(manager: ScheduledManager, trace: Sequence[TraceRequest]) -> Side:
    """``trace`` through the scheduler on ``manager`` (32 running at most, as bench_hybrid replays)."""
    start = time.perf_counter()
    peak = 0

    def running(progress: Progress) -> None:
        nonlocal peak
        peak = max(peak, progress.num_running)

    sim = Simulator(manager, max_num_seqs=MULTITURN_MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    result = sim.run(trace, progress=running, progress_every=1)
    return Side(
        result.prompt_hit_rate,
        result.num_prompt_hit_tokens,
        result.num_prompt_tokens,
        result.num_preemptions,
        peak,
        time.perf_counter() - start,
    )


def _ratio(ours: float | None, only: float) -> float | None:
    return None if ours is None or not only else ours / only


def attention_layers(specs: dict[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """The attention-only twin: the model's layers without its recurrent ones."""
    return {name: spec for name, spec in specs.items() if not isinstance(spec, MambaSpec)}


def run_kind(kind: str, work: Workload, factors: Sequence[float], peer: bool) -> tuple[list[dict], dict]:
    """One row per memory factor, and the kind's state arithmetic (at each memory)."""
    specs = get_preset(PRESET)
    trace = work.trace
    max_model_len = max(len(r.prompt_token_ids) + r.max_output_tokens for r in trace)
    low = vllm_minimum_memory(specs, max_model_len)
    attention_bytes = sum(s.page_size_bytes(1) for s in attention_layers(specs).values())  # one token's K and V
    num_open, open_tokens = work.open_prefixes()
    rows, holds = [], []
    for factor in factors:
        memory = int(factor * low)
        config = plan_kv_cache(specs, memory, max_model_len=max_model_len)
        manager = KVCacheManager(config)
        ours = replay(manager, unnamed(trace))
        causes = manager.prefix_cache_stats()
        chat = replay(KVCacheManager(config), trace)
        only = replay(
            KVCacheManager(plan_kv_cache(attention_layers(specs), memory, max_model_len=max_model_len)), trace
        )
        theirs = None
        if peer:
            paged = plan_kv_cache(specs, memory, max_model_len=max_model_len, options=VLLM_RULE)
            theirs = replay(VllmManager(paged, max_model_len, MAX_NUM_BATCHED_TOKENS), trace)
        assert config.shared_states is not None  # a recurrent hybrid's default plan shares its pages with states
        state = config.shared_states.state_bytes
        needed = num_open * state + open_tokens * attention_bytes
        left = memory - ours.peak_running * state
        holds.append(
            {
                "memory": f"{factor:g}x",
                "live_states": ours.peak_running,
                "open_prefixes": num_open,
                "state_mib": state / MiB,
                "prefix_kv_mib": open_tokens * attention_bytes / MiB,
                "needed_mib": needed / MiB,
                "left_mib": left / MiB,
                "holds": needed <= left,
                "states_that_fit": max(0, left - open_tokens * attention_bytes) // state,
            }
        )
        vllm_rate = None if theirs is None else theirs.hit_rate
        rows.append(
            {
                "kind": kind,
                "memory": f"{factor:g}x",
                "gib": memory / GiB,
                "max_model_len": max_model_len,
                "requests": len(trace),
                "prompt_tokens": ours.prompt_tokens,
                "jaxkv_queried_tokens": causes.num_queried_tokens,
                "jaxkv_hit_tokens": causes.num_hit_tokens,
                "attention_only_hit_rate": only.hit_rate,
                "jaxkv_hit_rate": ours.hit_rate,
                "vllm_hit_rate": vllm_rate,
                "jaxkv_over_attention": _ratio(ours.hit_rate, only.hit_rate),
                "vllm_over_attention": _ratio(vllm_rate, only.hit_rate),
                "jaxkv_ge_vllm": None if vllm_rate is None else ours.hit_rate >= vllm_rate,
                "jaxkv_chat_hit_rate": chat.hit_rate,
                "jaxkv_chat_over_attention": _ratio(chat.hit_rate, only.hit_rate),
                "jaxkv_chat_ge_vllm": None if vllm_rate is None else chat.hit_rate >= vllm_rate,
                "jaxkv_preemptions": ours.preemptions,
                "jaxkv_missed_no_checkpoint": causes.num_missed_no_checkpoint,
                "jaxkv_missed_evicted": causes.num_missed_evicted,
                "jaxkv_missed_not_cached": causes.num_missed_not_cached,
                "jaxkv_missed_below_block": causes.num_missed_below_block,
                "jaxkv_peak_running": ours.peak_running,
                "vllm_preemptions": None if theirs is None else theirs.preemptions,
                "attention_only_preemptions": only.preemptions,
                "holds_states": needed <= left,
                "wall_s": ours.wall_s + chat.wall_s + only.wall_s + (0.0 if theirs is None else theirs.wall_s),
            }
        )
    return rows, {"kind": kind, "memories": holds}


def admission(peer: bool) -> list[dict]:
    """bench_hybrid's capacity count: requests admitted at once into an idle manager at vLLM's minimum memory."""
    specs = get_preset(PRESET)
    memory = vllm_minimum_memory(specs, CHAT_MAX_MODEL_LEN)
    ours = plan_kv_cache(specs, memory, max_model_len=CHAT_MAX_MODEL_LEN)
    paged = plan_kv_cache(specs, memory, max_model_len=CHAT_MAX_MODEL_LEN, options=VLLM_RULE)
    rows = []
    for prompt_len in ADMISSION_PROMPTS:
        jaxkv = admitted_at_once(KVCacheManager(ours), prompt_len)
        vllm = (
            admitted_at_once(VllmManager(paged, CHAT_MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS), prompt_len)
            if peer
            else None
        )
        rows.append(
            {
                "gib": memory / GiB,
                "prompt_len": prompt_len,
                "jaxkv": jaxkv,
                "vllm": vllm,
                "jaxkv_ge_vllm": None if vllm is None else jaxkv >= vllm,
            }
        )
    return rows


def summary(rows: list[dict]) -> dict:
    """The mean of each side over attention-only, and how many rows meet issue 39's targets."""

    def mean(key: str) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return sum(values) / len(values) if values else None

    compared = [r for r in rows if r["jaxkv_ge_vllm"] is not None]
    return {
        "rows": len(rows),
        "mean_jaxkv_over_attention": mean("jaxkv_over_attention"),
        "mean_vllm_over_attention": mean("vllm_over_attention"),
        "target": TARGET_OVER_ATTENTION,
        "jaxkv_ge_vllm_rows": sum(r["jaxkv_ge_vllm"] for r in compared) if compared else None,
        "mean_jaxkv_chat_over_attention": mean("jaxkv_chat_over_attention"),
        "jaxkv_chat_ge_vllm_rows": sum(r["jaxkv_chat_ge_vllm"] for r in compared) if compared else None,
        "compared_rows": len(compared),
        "jaxkv_ge_095_rows": sum((r["jaxkv_over_attention"] or 0) >= HOLDS_TARGET for r in rows),
        "holds_rows": sum(r["holds_states"] for r in rows),
        "holds_ge_095_rows": sum(r["holds_states"] and (r["jaxkv_over_attention"] or 0) >= HOLDS_TARGET for r in rows),
    }


COLUMNS: dict[str, tuple[str, tuple[tuple[str, str, str], ...]]] = {
    "workloads": (
        f"{PRESET} prompt hit rate (hit / prompt tokens) per workload kind: jaxkv defaults vs vLLM align mode "
        "vs attention-only, same bytes (x vLLM's minimum memory for the longest request)",
        (
            ("kind", "kind", "s"),
            ("memory", "memory", "s"),
            ("gib", "GiB", ".2f"),
            ("requests", "requests", "d"),
            ("attention_only_hit_rate", "attn only", ".3f"),
            ("jaxkv_hit_rate", "jaxkv", ".3f"),
            ("vllm_hit_rate", "vLLM", ".3f"),
            ("jaxkv_over_attention", "jaxkv/attn", ".3f"),
            ("vllm_over_attention", "vLLM/attn", ".3f"),
            ("jaxkv_ge_vllm", "jaxkv>=vLLM", ""),
            ("jaxkv_chat_hit_rate", "jaxkv chat", ".3f"),
            ("jaxkv_chat_over_attention", "chat/attn", ".3f"),
            ("holds_states", "bytes hold", ""),
            ("jaxkv_preemptions", "preempt", "d"),
        ),
    ),
    "misses": (
        f"{PRESET} jaxkv's looked-up tokens by outcome (the manager's counters, a preempted request's second "
        "lookup included; see PrefixCacheStats)",
        (
            ("kind", "kind", "s"),
            ("memory", "memory", "s"),
            ("jaxkv_queried_tokens", "queried", "d"),
            ("jaxkv_hit_tokens", "hit", "d"),
            ("jaxkv_missed_no_checkpoint", "no_checkpoint", "d"),
            ("jaxkv_missed_evicted", "evicted", "d"),
            ("jaxkv_missed_not_cached", "not_cached", "d"),
            ("jaxkv_missed_below_block", "below_block", "d"),
        ),
    ),
    "admission": (
        f"{PRESET} requests admitted at once into an idle manager at vLLM's minimum memory "
        f"(max_model_len {CHAT_MAX_MODEL_LEN}): jaxkv vs vLLM's own manager",
        (
            ("gib", "GiB", ".2f"),
            ("prompt_len", "prompt", "d"),
            ("jaxkv", "jaxkv", "d"),
            ("vllm", "vLLM", "d"),
            ("jaxkv_ge_vllm", "jaxkv>=vLLM", ""),
        ),
    ),
}


def _factors() -> list[float]:
    factors = []
    for text in FLAGS.memories:
        try:
            value = float(text)
        except ValueError:
            value = 0.0
        if not value > 0 or value == float("inf"):
            raise WorkloadError(f"--memories: {text!r} is not a positive memory factor")
        factors.append(value)
    if not factors:
        raise WorkloadError("--memories: give at least one memory factor")
    return factors


def _print_states(states: list[dict]) -> None:
    print("\n[states] can the bytes hold the checkpoints the hits need? (one state per shared prefix open at once")
    print("         + its attention KV) vs the bytes left beside the most live states of jaxkv's replay (their own")
    print("         attention KV not counted)")
    for entry in states:
        for m in entry["memories"]:
            verdict = "holds" if m["holds"] else f"does not hold: the best the bytes allow is {m['states_that_fit']}"
            print(
                f"  {entry['kind']:<20} {m['memory']:>4}: {m['open_prefixes']} x {m['state_mib']:.1f} MiB"
                f" + {m['prefix_kv_mib']:.1f} MiB KV = {m['needed_mib']:,.1f} MiB needed vs"
                f" {m['left_mib']:,.1f} MiB left beside {m['live_states']} live: {verdict}"
                + ("" if m["holds"] else f" of {m['open_prefixes']} states")
            )


def _print_summary(total: dict) -> None:
    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f}"

    print(
        f"\n[summary] over {total['rows']} rows: mean jaxkv/attn {fmt(total['mean_jaxkv_over_attention'])}"
        f" (target >= {total['target']}), mean vLLM/attn {fmt(total['mean_vllm_over_attention'])};"
        f" jaxkv >= vLLM on {total['jaxkv_ge_vllm_rows'] if total['compared_rows'] else 'n/a'}"
        f" of {total['compared_rows']}; jaxkv/attn >= {HOLDS_TARGET} on {total['jaxkv_ge_095_rows']}"
        f" ({total['holds_ge_095_rows']} of the {total['holds_rows']} rows whose bytes hold the states)"
    )
    print(
        f"          with the chats' message boundaries named (jaxkv chat): mean jaxkv/attn"
        f" {fmt(total['mean_jaxkv_chat_over_attention'])}, >= vLLM on"
        f" {total['jaxkv_chat_ge_vllm_rows'] if total['compared_rows'] else 'n/a'} of {total['compared_rows']}"
    )


def main(argv: Sequence[str]) -> None:
    del argv  # flags_parser refused positional arguments
    unknown = [k for k in FLAGS.kinds if k not in KINDS]
    if unknown or not FLAGS.kinds:
        exit_error(PROG, f"unknown kinds {unknown!r}; valid kinds: {', '.join(KINDS)}")
    peer = FLAGS.peer and vllm_available()
    scale = QUICK if FLAGS.quick else FULL
    report: dict = {
        "preset": PRESET,
        "kinds": FLAGS.kinds,
        "memories": FLAGS.memories,
        "quick": FLAGS.quick,
        "seed": FLAGS.seed,
        "vllm": importlib.metadata.version("vllm") if peer else None,
    }
    start = time.perf_counter()
    try:
        factors = _factors()
        rows, states = [], []
        for kind in FLAGS.kinds:
            print(f"({kind} ...)", flush=True)
            work = KINDS[kind](np.random.default_rng([FLAGS.seed, list(KINDS).index(kind)]), scale)
            kind_rows, kind_states = run_kind(kind, work, factors, peer)
            rows += kind_rows
            states.append(kind_states)
        report["workloads"] = rows
        report["states"] = states
        report["summary"] = summary(rows)
        report["admission"] = admission(peer)
    except JaxkvError as err:
        exit_error(PROG, err)
    report["wall_s"] = time.perf_counter() - start
    print_table("workloads", rows, COLUMNS)
    print_table("misses", rows, COLUMNS)
    _print_states(states)
    _print_summary(report["summary"])
    print_table("admission", report["admission"], COLUMNS)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {FLAGS.out}", file=sys.stderr)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
