"""What jaxkv's hybrid-model options buy over vLLM's rules (issues 9 and 19, group-aware retention).

Three ways to hold a recurrent hybrid's cache, in the same bytes: jaxkv's default
(``shared_pages``: one memory, a state is pages of the block pool; :mod:`jaxkv.planner`);
"attention_pages", jaxkv's manager in vLLM's layout (one attention page holds one state,
a state cached at block boundaries); and "vLLM", vLLM 0.33's own ``KVCacheManager`` in align
mode on the blocks of that layout, with its scheduler's chunk rule
(:mod:`jaxkv.benchmarks.vllm_manager`), driven by the same scheduler and trace as jaxkv's.
The vLLM columns need the ``vllm`` benchmark extra (BUILD.md); without it, or with
``--nopeer``, they read n/a.

Sections (``--sections``, comma list, default all), one table each:

* ``granularity``: the prefix-cache granularity (hash block size, tokens) of the
  recurrent hybrids' default plans against vLLM's rule (blocks grow to hundreds or
  thousands of tokens so that a page holds a state). Target: <= 64 tokens.
* ``concurrency``: how many ``--max_model_len`` requests each plan runs at once
  (``max_concurrency``) against :func:`~jaxkv.planner.exact_concurrency_bound`.
  Target: >= 98 % of the bound.
* ``capacity``: requests of each of :data:`CAPACITY_PROMPTS` tokens admitted at once into
  an idle manager (prefix lookup, then the whole prompt), Qwen3-Next-80B at each chat
  memory and at 8 and 16 GiB: the default against vLLM, attention_pages and the static
  state pool (10 % checkpoints). Target: >= vLLM everywhere. "Served": the most
  running at once when 1.5x that many arrive together and each decodes 48 tokens
  through the scheduler (chunks cut at checkpoints, the states written after them),
  the default against vLLM's own manager. Target: >= 1.5x vLLM at its minimum memory.
* ``chat``: prompt hit rate of Qwen3-Next-80B on a chat trace (6 system prompts of 512
  tokens, 3 turns per conversation: 2 in 3 requests are follow-ups, <= 32 running) at
  vLLM's minimum memory (what its layout needs to run 32 requests, one of
  ``max_model_len``) and 2x and 4x it: the default, vLLM, attention_pages and attention
  alone in the same memory. Targets: >= vLLM at every memory, >= 0.9 of attention alone
  where live states leave at least half the memory to caching.
* ``multiturn``: prompt hit rate of recurrent hybrids replaying a multi-turn chat trace
  (a 512-token system prompt, 12 turns per conversation) in the simulator under
  memory pressure: the default (checkpoints at prompt ends, where attention ran ahead
  and at the newest decode boundary), vLLM, attention_pages and the same model's attention
  layers alone in the same memory, for the tiny hybrid and the three presets at 8 and
  16 GiB. Targets: >= 0.9 of attention-only and above vLLM.
* ``ttft``: time to first token of the tiny recurrent hybrid (``tiny-qwen3-next``, state
  pool) with and without prefix caching on prompts 90 % shared, measured by
  ``scripts/bench_serve.py`` (run as a subprocess, its JSON read back). Target: >= 5x on CPU.
* ``retention``: prompt hit rate of a Gemma-3-like model (gemma-3-27b: 5 sliding-window
  groups + 1 full) replaying one multi-turn trace in the simulator under memory
  pressure, with vLLM's eviction rule and with ``retention="group_aware"``, at each
  ``--retention_memory`` budget. Target: >= 10 points more with group-aware retention.

    python scripts/bench_hybrid.py --out bench_hybrid.json

``--quick`` shrinks the traces and the cases (a smoke run; its hit rates are not the
benchmark's). ``--plot FILE.png`` draws every section run as grouped bars.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from absl import app, flags

from jaxkv.benchmarks.vllm_manager import VllmManager, vllm_available
from jaxkv.commands.cli import exit_error, flags_parser, parse_size, pyplot, save_figure
from jaxkv.core.manager import KVCacheManager, Request
from jaxkv.errors import JaxkvError
from jaxkv.planner import KVCacheConfig, PlanOptions, StatePoolOptions, exact_concurrency_bound, plan_kv_cache
from jaxkv.presets import get_preset
from jaxkv.serving.scheduler import ScheduledManager
from jaxkv.serving.simulator import Progress, Simulator, TraceRequest, synthetic_trace
from jaxkv.specs import MambaSpec

PROG = "bench_hybrid.py"
RECURRENT_PRESETS = ("nemotron-h-8b", "qwen3-next-80b", "jamba-1.5-mini")
RETENTION_PRESET = "gemma-3-27b"
RETENTION_RULES = ("vllm", "group_aware")
MULTITURN_CASES = (
    ("tiny-mamba-hybrid", "30MiB", 8192),
    ("tiny-mamba-hybrid", "60MiB", 8192),
    *((name, memory, 32768) for name in RECURRENT_PRESETS for memory in ("8GiB", "16GiB")),
)
"""(preset, budget, max_model_len) of the multi-turn section: the tiny hybrid, whose
state weighs ~55 tokens of its attention KV, under strong and mild pressure, and the
presets (Qwen3-Next-80B's state weighs ~3,150 tokens of its KV, Nemotron-H-8B's ~6,240,
Jamba-1.5-Mini's ~990)."""
MULTITURN_MAX_NUM_SEQS = 32
MAX_NUM_BATCHED_TOKENS = 2048
CHAT_PRESET = "qwen3-next-80b"
CHAT_MAX_MODEL_LEN = 8192
CHAT_MEMORY_FACTORS = (1, 2, 4)
CAPACITY_PROMPTS = (929, 1360, 2048, 8192)
"""Prompt lengths of the capacity section: 929 and 2,048 end mid-block and 1,360 on a
16-token boundary in jaxkv's layout; 2,048 and 8,192 are the chat trace's scale."""
STATE_POOL_SHARE = 0.1
"""The static state pool's checkpoint share in the capacity section (its old default)."""
GiB = 1 << 30


class BenchError(JaxkvError):
    """A section's measurement could not be taken."""


FLAGS = flags.FLAGS
flags.DEFINE_list(
    "sections",
    ["granularity", "concurrency", "capacity", "chat", "multiturn", "ttft", "retention"],
    "sections to run, in this order",
)
flags.DEFINE_string("memory", "16GiB", "KV cache budget of the granularity and concurrency plans")
flags.DEFINE_integer("max_model_len", 32768, "tokens of the longest request (every section)", lower_bound=1)
flags.DEFINE_list("retention_memory", ["16GiB", "20GiB"], "retention: KV cache budgets of the Gemma-3 plan")
flags.DEFINE_integer("conversations", 200, "retention: conversations in the trace", lower_bound=1)
flags.DEFINE_integer("seed", 0, "retention: trace seed", lower_bound=0)
flags.DEFINE_boolean("quick", False, "retention, multiturn: 20- and 12-conversation traces (smoke runs)")
flags.DEFINE_string("out", None, "write the results as JSON here")
flags.DEFINE_string("plot", None, "draw each section run as grouped bars to this PNG (matplotlib)")
flags.DEFINE_boolean("peer", True, "capacity, chat, multiturn: drive vLLM's own manager too when vLLM is importable")


VLLM_RULE = PlanOptions(state_layout="attention_pages")
"""vLLM's layout: one attention page holds a state (the plan vLLM's own manager runs on)."""


def _both_layouts(name: str) -> tuple[dict, KVCacheConfig, KVCacheConfig]:
    """A recurrent preset's specs and its default and vLLM-rule plans at ``--memory``."""
    specs = get_preset(name)
    memory = parse_size(FLAGS.memory)
    pooled = plan_kv_cache(specs, memory, max_model_len=FLAGS.max_model_len)
    return specs, pooled, plan_kv_cache(specs, memory, max_model_len=FLAGS.max_model_len, options=VLLM_RULE)


def granularity() -> list[dict]:
    """Hash block size of the state-pool plan and of vLLM's rule, per recurrent hybrid."""
    rows = []
    for name in RECURRENT_PRESETS:
        _, pooled, paged = _both_layouts(name)
        rows.append(
            {
                "preset": name,
                "default": pooled.hash_block_size,
                "attention_pages": paged.hash_block_size,
                "finer_x": paged.hash_block_size / pooled.hash_block_size,
            }
        )
    return rows


def concurrency() -> list[dict]:
    """max_concurrency of the default and vLLM's rule against the exact bound."""
    rows = []
    for name in RECURRENT_PRESETS:
        specs, pooled, paged = _both_layouts(name)
        bound = exact_concurrency_bound(specs, parse_size(FLAGS.memory), FLAGS.max_model_len)
        rows.append(
            {
                "preset": name,
                "default": pooled.max_concurrency,
                "attention_pages": paged.max_concurrency,
                "exact_bound": bound,
                "default_ratio": pooled.max_concurrency / bound,
                "attention_pages_ratio": paged.max_concurrency / bound,
                "pages_per_state": pooled.shared_states.pages_per_state,
                "state_mib": pooled.shared_states.state_bytes / (1 << 20),
            }
        )
    return rows


def _peer() -> bool:
    return FLAGS.peer and vllm_available()


def _vllm(config: KVCacheConfig, max_model_len: int) -> VllmManager:
    """vLLM's manager on the blocks of ``config`` (a plan in vLLM's layout)."""
    return VllmManager(config, max_model_len, MAX_NUM_BATCHED_TOKENS)


def _hit_rate(manager: ScheduledManager, trace: Sequence[TraceRequest]) -> tuple[float, int]:
    """Prompt hit rate and preemptions of ``trace`` replayed on ``manager``."""
    sim = Simulator(manager, max_num_seqs=MULTITURN_MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    result = sim.run(trace)
    return result.prompt_hit_rate, result.num_preemptions


def _in_vllms_layout(
    specs: dict, memory: int, max_model_len: int, trace: Sequence[TraceRequest]
) -> tuple[float, float | None]:
    """Hit rates in vLLM's layout: jaxkv's manager, and vLLM's own (None without vLLM)."""
    config = plan_kv_cache(specs, memory, max_model_len=max_model_len, options=VLLM_RULE)
    theirs = _hit_rate(_vllm(config, max_model_len), trace)[0] if _peer() else None
    return _hit_rate(KVCacheManager(config), trace)[0], theirs


def _points(ours: float, theirs: float | None) -> float | None:
    return None if theirs is None else 100 * (ours - theirs)


def vllm_minimum_memory(specs: dict, max_model_len: int) -> int:
    """Bytes vLLM's layout needs to run ``MULTITURN_MAX_NUM_SEQS`` requests at once, one of
    ``max_model_len`` tokens: their states (a block per recurrent group each), that request's
    attention blocks and the null block."""
    config = plan_kv_cache(specs, 1 << 50, max_model_len=max_model_len, options=VLLM_RULE)
    per_request = config.blocks_per_request()
    recurrent = [n for n, g in zip(per_request, config.groups, strict=True) if isinstance(g.spec, MambaSpec)]
    attention = sum(per_request) - sum(recurrent)
    return (MULTITURN_MAX_NUM_SEQS * sum(recurrent) + attention + 1) * config.pages.block_bytes


def admitted_at_once(manager: ScheduledManager, prompt_len: int) -> int:
    """Requests of ``prompt_len`` distinct tokens an idle manager admits whole before one does not fit."""
    n = 0
    while True:
        request = Request(f"r{n}", list(range(n * prompt_len, (n + 1) * prompt_len)))
        hit, num_hit = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, prompt_len - num_hit, num_hit, hit) is None:
            return n
        n += 1


SERVED_MIN_OUTPUT_TOKENS = 48
"""Tokens each request of the capacity section's served count decodes at least: through
two or three 16-token block boundaries, each a checkpoint and a state written after it."""


SERVED_PROMPT_LIMIT = 2048
"""The longest prompt of the served count (longer ones leave no room to decode in
``max_model_len`` while the rest are admitted)."""


def served_at_once(manager: ScheduledManager, prompt_len: int, num_requests: int) -> tuple[int, int]:
    """(most requests running at once, preemptions) when ``num_requests`` requests of
    ``prompt_len`` distinct tokens arrive together, through the scheduler: prefills in
    chunks cut at checkpoints, the states written after each, everything a running
    request holds. Each decodes until the last has had time to be admitted (at least
    :data:`SERVED_MIN_OUTPUT_TOKENS` tokens), so the count is memory's, not the step budget's."""
    prefill_steps = -(-num_requests * prompt_len // MAX_NUM_BATCHED_TOKENS)
    output_len = min(prefill_steps + SERVED_MIN_OUTPUT_TOKENS, CHAT_MAX_MODEL_LEN - prompt_len)
    trace = [
        TraceRequest(f"r{n}", 0.0, tuple(range(n * prompt_len, (n + 1) * prompt_len)), output_len)
        for n in range(num_requests)
    ]
    peak = 0

    def running(progress: Progress) -> None:
        nonlocal peak
        peak = max(peak, progress.num_running)

    sim = Simulator(manager, max_num_seqs=num_requests, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    result = sim.run(trace, progress=running, progress_every=1)
    return peak, result.num_preemptions


def capacity() -> list[dict]:
    """Requests admitted at once, per prompt length and memory: the default against vLLM, attention_pages and the
    state pool."""
    specs = get_preset(CHAT_PRESET)
    low = vllm_minimum_memory(specs, CHAT_MAX_MODEL_LEN)
    memories = [(f"{f}x vLLM min", f * low) for f in CHAT_MEMORY_FACTORS] + [("8GiB", 8 * GiB), ("16GiB", 16 * GiB)]
    prompts = CAPACITY_PROMPTS[:1] if FLAGS.quick else CAPACITY_PROMPTS
    rows = []
    for label, memory in memories:
        paged = plan_kv_cache(specs, memory, max_model_len=CHAT_MAX_MODEL_LEN, options=VLLM_RULE)
        plans = {
            "default": plan_kv_cache(specs, memory, max_model_len=CHAT_MAX_MODEL_LEN),
            "attention_pages": paged,
            "state_pool": plan_kv_cache(
                specs,
                memory,
                max_model_len=CHAT_MAX_MODEL_LEN,
                options=PlanOptions(
                    state_layout="state_pool",
                    state_pool=StatePoolOptions(checkpoint_bytes=int(STATE_POOL_SHARE * memory)),
                ),
            ),
        }
        for prompt_len in prompts:
            row: dict = {"memory": label, "gib": memory / GiB, "prompt_len": prompt_len}
            row.update({key: admitted_at_once(KVCacheManager(config), prompt_len) for key, config in plans.items()})
            row["vllm"] = admitted_at_once(_vllm(paged, CHAT_MAX_MODEL_LEN), prompt_len) if _peer() else None
            row["served"] = row["vllm_served"] = row["served_over_vllm"] = None
            row["served_preemptions"] = row["vllm_served_preemptions"] = None
            if prompt_len <= SERVED_PROMPT_LIMIT:
                num_requests = row["default"] * 3 // 2 + 4
                row["served"], row["served_preemptions"] = served_at_once(
                    KVCacheManager(plans["default"]), prompt_len, num_requests
                )
                if _peer():
                    vllm_served = served_at_once(_vllm(paged, CHAT_MAX_MODEL_LEN), prompt_len, num_requests)
                    row["vllm_served"], row["vllm_served_preemptions"] = vllm_served
                    row["served_over_vllm"] = row["served"] / row["vllm_served"]
            rows.append(row)
    return rows


def chat() -> list[dict]:
    """Hit rate of the default, vLLM, attention_pages and attention alone on a chat trace, from vLLM's minimum
    memory to 4x it."""
    trace = synthetic_trace(
        num_conversations=30 if FLAGS.quick else 100,
        turns_per_conversation=3,
        num_system_prompts=6,
        system_prompt_len=512,
        user_turn_len=(64, 256),
        output_len=(32, 192),
        arrival_rate=1.0,
        turn_gap_s=20.0,
        seed=FLAGS.seed,
    )
    specs = get_preset(CHAT_PRESET)
    attention = {n: s for n, s in specs.items() if not isinstance(s, MambaSpec)}
    low = vllm_minimum_memory(specs, CHAT_MAX_MODEL_LEN)
    rows = []
    for factor in CHAT_MEMORY_FACTORS[:1] if FLAGS.quick else CHAT_MEMORY_FACTORS:
        memory = factor * low
        start = time.perf_counter()
        config = plan_kv_cache(specs, memory, max_model_len=CHAT_MAX_MODEL_LEN)
        ours, preempted = _hit_rate(KVCacheManager(config), trace)
        paged, theirs = _in_vllms_layout(specs, memory, CHAT_MAX_MODEL_LEN, trace)
        only, _ = _hit_rate(KVCacheManager(plan_kv_cache(attention, memory, max_model_len=CHAT_MAX_MODEL_LEN)), trace)
        live = MULTITURN_MAX_NUM_SEQS * config.shared_states.pages_per_state / config.num_usable_blocks
        rows.append(
            {
                "memory": f"{factor}x vLLM min",
                "gib": memory / GiB,
                "requests": len(trace),
                "attention_only_hit_rate": only,
                "vllm_hit_rate": theirs,
                "attention_pages_hit_rate": paged,
                "default_hit_rate": ours,
                "over_attention_only": ours / only if only else 0.0,
                "minus_vllm_points": _points(ours, theirs),
                "live_state_share": live,
                "preemptions": preempted,
                "wall_s": time.perf_counter() - start,
            }
        )
    return rows


def multiturn() -> list[dict]:
    """Prompt hit rate of the default, vLLM, attention_pages and attention alone on one chat trace, per case."""
    trace = synthetic_trace(
        num_conversations=12 if FLAGS.quick else 60,
        turns_per_conversation=12,
        num_system_prompts=4,
        system_prompt_len=512,
        user_turn_len=(64, 256),
        output_len=(32, 192),
        arrival_rate=0.5,
        turn_gap_s=30.0,
        seed=FLAGS.seed,
    )
    rows = []
    for name, text, max_model_len in MULTITURN_CASES[::3] if FLAGS.quick else MULTITURN_CASES:
        specs = get_preset(name)
        memory = parse_size(text)
        attention = {n: s for n, s in specs.items() if not isinstance(s, MambaSpec)}
        start = time.perf_counter()
        only, _ = _hit_rate(KVCacheManager(plan_kv_cache(attention, memory, max_model_len=max_model_len)), trace)
        paged, theirs = _in_vllms_layout(specs, memory, max_model_len, trace)
        config = plan_kv_cache(specs, memory, max_model_len=max_model_len)
        ours, preempted = _hit_rate(KVCacheManager(config), trace)
        rows.append(
            {
                "preset": name,
                "memory": text,
                "requests": len(trace),
                "attention_only_hit_rate": only,
                "vllm_hit_rate": theirs,
                "attention_pages_hit_rate": paged,
                "default_hit_rate": ours,
                "over_attention_only": ours / only if only else 0.0,
                "minus_vllm_points": _points(ours, theirs),
                "minus_pages_points": 100 * (ours - paged),
                "preemptions": preempted,
                "wall_s": time.perf_counter() - start,
            }
        )
    return rows


TTFT_MODEL = "tiny-qwen3-next"
QUICK_SERVE_FLAGS = (
    "--prompt_len=256",
    "--num_requests=2",
    "--repeats=3",
    "--max_new_tokens=2",
    "--memory=16MiB",
    "--max_model_len=512",
    "--max_num_batched_tokens=256",
)


def ttft() -> list[dict]:
    """bench_serve.py's TTFT and throughput, caching on vs off, for the tiny recurrent hybrid."""
    script = Path(__file__).resolve().with_name("bench_serve.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "serve.json"
        args = [sys.executable, str(script), f"--model={TTFT_MODEL}", f"--out={out}"]
        done = subprocess.run(args + list(QUICK_SERVE_FLAGS if FLAGS.quick else ()), capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(f"bench_serve.py failed ({done.returncode}): {done.stderr.strip()[-400:]}")
        report = json.loads(out.read_text())
    off, on = report["results"]["no prefix caching"], report["results"]["prefix caching"]
    return [
        {
            "model": TTFT_MODEL,
            "prompt_len": report["flags"]["prompt_len"],
            "uncached_ttft_ms": 1e3 * off["single_ttft_s"],
            "cached_ttft_ms": 1e3 * on["single_ttft_s"],
            "ttft_x": report["ratios"]["single_ttft_s"],
            "batch_ttft_x": report["ratios"]["batch_mean_ttft_s"],
            "batch_hit_rate": on["batch_prefix_hit_rate"],
            "tokens_identical": report["token_check"]["passed"],
        }
    ]


def retention() -> list[dict]:
    """Prompt hit rate of vLLM's eviction rule and group-aware retention on one trace, per budget."""
    num_conversations = 20 if FLAGS.quick else FLAGS.conversations
    trace = synthetic_trace(
        num_conversations=num_conversations,
        turns_per_conversation=4,
        num_system_prompts=8,
        system_prompt_len=2048,
        arrival_rate=2.0,
        turn_gap_s=20.0,
        seed=FLAGS.seed,
    )
    specs = get_preset(RETENTION_PRESET)
    rows = []
    for text in FLAGS.retention_memory:
        config = plan_kv_cache(specs, parse_size(text), max_model_len=FLAGS.max_model_len)
        row: dict = {"memory": text, "num_blocks": config.num_blocks, "requests": len(trace)}
        for rule in RETENTION_RULES:
            print(f"  {text}: {rule} retention over {len(trace):,} requests", flush=True)
            start = time.perf_counter()
            sim = Simulator(KVCacheManager(config, retention=rule), max_num_seqs=64, max_num_batched_tokens=4096)
            result = sim.run(trace)
            row[f"{rule}_hit_rate"] = result.prompt_hit_rate
            row[f"{rule}_preemptions"] = result.num_preemptions
            row[f"{rule}_wall_s"] = time.perf_counter() - start
        row["gain_points"] = 100 * (row["group_aware_hit_rate"] - row["vllm_hit_rate"])
        rows.append(row)
    return rows


SECTIONS: dict[str, Callable[[], list[dict]]] = {
    "granularity": granularity,
    "concurrency": concurrency,
    "capacity": capacity,
    "chat": chat,
    "multiturn": multiturn,
    "ttft": ttft,
    "retention": retention,
}

COLUMNS: dict[str, tuple[str, tuple[tuple[str, str, str], ...]]] = {
    "granularity": (
        "prefix-cache granularity (hash block size, tokens): default (shared pages) vs vLLM's rule",
        (
            ("preset", "preset", "s"),
            ("default", "default", "d"),
            ("attention_pages", "attention_pages", "d"),
            ("finer_x", "finer x", ".1f"),
        ),
    ),
    "concurrency": (
        "max_model_len requests at once: default (shared pages) vs vLLM's rule vs the exact bound",
        (
            ("preset", "preset", "s"),
            ("default", "default", "d"),
            ("attention_pages", "vllm rule", "d"),
            ("exact_bound", "bound", "d"),
            ("default_ratio", "default/bound", ".3f"),
            ("attention_pages_ratio", "vllm/bound", ".3f"),
            ("pages_per_state", "pages/state", ",d"),
            ("state_mib", "state MiB", ",.1f"),
        ),
    ),
    "capacity": (
        f"{CHAT_PRESET} requests admitted at once into an idle manager (max_model_len {CHAT_MAX_MODEL_LEN}): "
        f"default vs vLLM vs attention_pages vs the static state pool ({STATE_POOL_SHARE:.0%} checkpoints)",
        (
            ("memory", "memory", "s"),
            ("gib", "GiB", ".2f"),
            ("prompt_len", "prompt", "d"),
            ("default", "default", "d"),
            ("vllm", "vLLM", "d"),
            ("attention_pages", "attn pages", "d"),
            ("state_pool", "state pool", "d"),
            ("served", "served", "d"),
            ("vllm_served", "vLLM served", "d"),
            ("served_over_vllm", "served x", ".2f"),
            ("served_preemptions", "preempt", "d"),
            ("vllm_served_preemptions", "vLLM preempt", "d"),
        ),
    ),
    "chat": (
        f"{CHAT_PRESET} chat trace prompt hit rate (6 x 512-token system prompts, 3 turns, <= 32 running): "
        "default vs vLLM vs attention_pages vs attention alone, same memory",
        (
            ("memory", "memory", "s"),
            ("gib", "GiB", ".2f"),
            ("requests", "requests", "d"),
            ("attention_only_hit_rate", "attn only", ".3f"),
            ("vllm_hit_rate", "vLLM", ".3f"),
            ("attention_pages_hit_rate", "attn pages", ".3f"),
            ("default_hit_rate", "default", ".3f"),
            ("over_attention_only", "default/attn", ".3f"),
            ("minus_vllm_points", "default-vLLM pts", "+.1f"),
            ("live_state_share", "32 live states", ".2f"),
            ("preemptions", "preempt", "d"),
        ),
    ),
    "multiturn": (
        "multi-turn chat (512-token system prompt, 12 turns) prompt hit rate: default vs vLLM vs attention_pages "
        "vs attention alone, same memory",
        (
            ("preset", "preset", "s"),
            ("memory", "memory", "s"),
            ("requests", "requests", "d"),
            ("attention_only_hit_rate", "attn only", ".3f"),
            ("vllm_hit_rate", "vLLM", ".3f"),
            ("attention_pages_hit_rate", "attn pages", ".3f"),
            ("default_hit_rate", "default", ".3f"),
            ("over_attention_only", "default/attn", ".3f"),
            ("minus_vllm_points", "default-vLLM pts", "+.1f"),
            ("minus_pages_points", "default-pages pts", "+.1f"),
            ("preemptions", "preempt", "d"),
        ),
    ),
    "ttft": (
        "time to first token, prefix caching on vs off (bench_serve.py; CPU times of a tiny model: the ratio counts)",
        (
            ("model", "model", "s"),
            ("prompt_len", "prompt", "d"),
            ("uncached_ttft_ms", "off ms", ",.1f"),
            ("cached_ttft_ms", "on ms", ",.1f"),
            ("ttft_x", "TTFT x", ".2f"),
            ("batch_ttft_x", "batch TTFT x", ".2f"),
            ("batch_hit_rate", "batch hits", ".3f"),
            ("tokens_identical", "same tokens", ""),
        ),
    ),
    "retention": (
        f"prompt hit rate of {RETENTION_PRESET} under pressure: vLLM's eviction rule vs group-aware retention",
        (
            ("memory", "memory", "s"),
            ("num_blocks", "blocks", ",d"),
            ("requests", "requests", "d"),
            ("vllm_hit_rate", "vllm", ".3f"),
            ("group_aware_hit_rate", "group_aware", ".3f"),
            ("gain_points", "gain pts", "+.1f"),
            ("vllm_preemptions", "preempt vllm", "d"),
            ("group_aware_preemptions", "preempt g-a", "d"),
        ),
    ),
}


PLOTS: dict[str, tuple[str, tuple[str, ...], tuple[tuple[str, str], ...], bool]] = {
    "granularity": (
        "hash block size (tokens)",
        ("preset",),
        (("default", "default (shared pages)"), ("attention_pages", "vLLM's rule")),
        True,
    ),
    "concurrency": (
        "max_model_len requests at once",
        ("preset",),
        (("default", "default (shared pages)"), ("attention_pages", "vLLM's rule"), ("exact_bound", "exact bound")),
        False,
    ),
    "capacity": (
        "requests admitted at once",
        ("memory", "prompt_len"),
        (
            ("default", "default (shared pages)"),
            ("vllm", "vLLM"),
            ("attention_pages", "attention_pages"),
            ("state_pool", "static state pool"),
        ),
        False,
    ),
    "chat": (
        "prompt hit rate",
        ("memory",),
        (
            ("attention_only_hit_rate", "attention only"),
            ("vllm_hit_rate", "vLLM"),
            ("attention_pages_hit_rate", "attention_pages"),
            ("default_hit_rate", "default (shared pages)"),
        ),
        False,
    ),
    "multiturn": (
        "prompt hit rate",
        ("preset", "memory"),
        (
            ("attention_only_hit_rate", "attention only"),
            ("vllm_hit_rate", "vLLM"),
            ("attention_pages_hit_rate", "attention_pages"),
            ("default_hit_rate", "default (shared pages)"),
        ),
        False,
    ),
    "ttft": (
        "time to first token (ms)",
        ("model",),
        (("uncached_ttft_ms", "no caching"), ("cached_ttft_ms", "cached")),
        True,
    ),
    "retention": (
        "prompt hit rate",
        ("memory",),
        (("vllm_hit_rate", "vLLM's eviction"), ("group_aware_hit_rate", "group-aware")),
        False,
    ),
}
"""Per section: y label, the row fields naming each group, (field, legend) of its bars, log scale."""


def plot_report(report: dict, path: str) -> None:
    """One panel of grouped bars per section run."""
    plt = pyplot(PROG)
    sections = [s for s in FLAGS.sections if s in report]
    cols = min(3, len(sections))
    rows_ = -(-len(sections) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(5.2 * cols, 4.4 * rows_), squeeze=False)
    for ax in axes.flat[len(sections) :]:
        ax.set_visible(False)
    for ax, section in zip(axes.flat, sections, strict=False):  # the grid may have spare panels
        ylabel, group_keys, every_bar, log = PLOTS[section]
        rows = report[section]["rows"]
        bars = [(key, legend) for key, legend in every_bar if all(r[key] is not None for r in rows)]  # no vLLM: none
        labels = ["\n".join(str(r[key]) for key in group_keys) for r in rows]
        width = 0.8 / len(bars)
        for i, (key, legend) in enumerate(bars):
            xs = [g + (i - (len(bars) - 1) / 2) * width for g in range(len(rows))]
            ax.bar(xs, [r[key] for r in rows], width, label=legend)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.set_title(section)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"bench_hybrid{' --quick' if FLAGS.quick else ''}: jaxkv's hybrid options vs vLLM's rules")
    fig.tight_layout()
    save_figure(PROG, fig, path)


def print_table(
    section: str, rows: list[dict], tables: dict[str, tuple[str, tuple[tuple[str, str, str], ...]]] = COLUMNS
) -> None:
    """One section's rows as an aligned table under its title (``tables``: each section's title and columns)."""
    title, columns = tables[section]
    cells = [[header for _, header, _ in columns]]
    cells += [["n/a" if row[key] is None else format(row[key], fmt) for key, _, fmt in columns] for row in rows]
    widths = [max(len(line[c]) for line in cells) for c in range(len(columns))]
    print(f"\n[{section}] {title}")
    for line in cells:
        print(
            "  ".join(
                cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(line, widths, strict=True))
            )
        )


def main(argv: Sequence[str]) -> None:
    del argv  # flags_parser refused positional arguments
    unknown = [s for s in FLAGS.sections if s not in SECTIONS]
    if unknown or not FLAGS.sections:
        exit_error(PROG, f"unknown sections {unknown!r}; valid sections: {', '.join(SECTIONS)}")
    if FLAGS.plot:
        pyplot(PROG)  # refuse now, not after the run, if matplotlib is missing
    report: dict = {"memory": FLAGS.memory, "max_model_len": FLAGS.max_model_len, "quick": FLAGS.quick}
    try:
        for section in FLAGS.sections:
            print(f"\n({section} ...)", flush=True)
            start = time.perf_counter()
            rows = SECTIONS[section]()
            print_table(section, rows)
            report[section] = {"rows": rows, "wall_s": time.perf_counter() - start}
    except JaxkvError as err:
        exit_error(PROG, err)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"\nwrote {FLAGS.out}", file=sys.stderr)
    if FLAGS.plot:
        plot_report(report, FLAGS.plot)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
