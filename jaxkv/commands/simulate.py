"""Replay a request trace through jaxkv's KV cache manager and report how the cache did.

Plans the KV cache of a preset model for a memory budget, replays a trace (default: a
synthetic multi-turn chat trace over shared system prompts) with a vLLM-like
continuous-batching scheduler (jaxkv.serving.simulator), and prints the plan, progress lines
and a final table: prefix hit rate, peak/mean KV usage, preemptions, host time per
scheduler step. No device work is done.

    jaxkv-simulate
    jaxkv-simulate --memory 24GiB --arrival_rate 4 --out /tmp/sim.json
    jaxkv-simulate --preset tiny-hybrid --memory 32MiB --max_model_len 2048 \\
        --system_prompt_len 256 --user_turn_len 16,128 --output_len 16,64
    jaxkv-simulate --trace my_trace.json --noprefix_caching
    jaxkv-simulate --plot /tmp/sim.png      # KV usage and hit rate over time

The default (gemma-3-27b, 12 GiB, 300 three-turn conversations arriving at 2 per
second) fills the pool and evicts cached blocks, with a handful of preemptions.

Bad input (a flag value out of range, an unreadable size, a plan of more than
jaxkv.serving.simulator.MAX_NUM_BLOCKS blocks, a trace file that is not UTF-8 JSON of
the schema, a synthetic knob that cannot fit --max_model_len) prints one line
``PROGRAM: error: ...`` on stderr (PROGRAM: the file name the program was started from)
and exits with status 2. A trace request's ``max_output_tokens`` beyond --max_model_len
is fine: generation stops there.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from jaxkv.commands.cli import (
    CommandLineError,
    exit_error,
    flags_parser,
    is_int_range,
    parse_size,
    program_name,
    pyplot,
    save_figure,
)
from jaxkv.core.hashing import HASH_ALGORITHMS
from jaxkv.core.manager import KVCacheManager
from jaxkv.errors import JaxkvError
from jaxkv.planner import KVCacheConfig, PlanOptions, plan_kv_cache
from jaxkv.presets import get_preset, list_presets
from jaxkv.serving.simulator import (
    PlanTooLargeError,
    Progress,
    SimulationResult,
    Simulator,
    TraceError,
    TraceRequest,
    check_num_blocks,
    load_trace,
    save_trace,
    synthetic_trace,
)

COMMAND = "jaxkv-simulate"
"""The installed name: the help's examples show it as the program was started."""
MAX_TRACE_BYTES = 1 << 30
"""The largest trace file read (a trace of millions of requests is well under it)."""
PLOT_SAMPLES = 400
"""About this many points per curve of --plot (sampled every few steps)."""


def define_flags() -> flags.FlagValues:
    """This command's flags, in a registry of its own (absl's global ``FLAGS`` is left alone)."""
    fv = flags.FlagValues()
    flags.DEFINE_enum("preset", "gemma-3-27b", list_presets(), "model architecture", flag_values=fv)
    flags.DEFINE_string("memory", "12GiB", "KV cache budget: 16GiB, 512MiB, 1.5GB or bytes", flag_values=fv)
    flags.DEFINE_integer("max_model_len", 8192, "tokens of the longest request", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("block_size", 16, "base tokens per block", lower_bound=1, flag_values=fv)
    flags.DEFINE_enum("hash_algo", "sha256", HASH_ALGORITHMS, "prefix hash algorithm", flag_values=fv)
    flags.DEFINE_string(
        "trace", None, "JSON trace file (schema in jaxkv/serving/simulator.py); default: synthetic", flag_values=fv
    )
    flags.DEFINE_integer("num_conversations", 300, "synthetic: conversations", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer(
        "turns_per_conversation", 3, "synthetic: turns per conversation", lower_bound=1, flag_values=fv
    )
    flags.DEFINE_integer(
        "num_system_prompts", 4, "synthetic: distinct shared system prompts", lower_bound=1, flag_values=fv
    )
    flags.DEFINE_integer(
        "system_prompt_len", 1024, "synthetic: tokens per system prompt", lower_bound=0, flag_values=fv
    )
    flags.DEFINE_list("user_turn_len", ["64", "512"], "synthetic: lo,hi tokens of a user message", flag_values=fv)
    flags.DEFINE_list("output_len", ["32", "256"], "synthetic: lo,hi tokens generated per turn", flag_values=fv)
    flags.DEFINE_float("arrival_rate", 2.0, "synthetic: new conversations per second (Poisson)", flag_values=fv)
    flags.DEFINE_float(
        "turn_gap_s", 10.0, "synthetic: mean seconds between a turn's arrival and the next", flag_values=fv
    )
    flags.DEFINE_integer("seed", 0, "synthetic trace seed", lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("max_num_seqs", 64, "most requests running at once", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer(
        "max_num_batched_tokens",
        2048,
        "token budget of one scheduler step (also sizes the plan)",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_float("step_ms", 20.0, "simulated milliseconds per scheduler step", flag_values=fv)
    flags.DEFINE_boolean("prefix_caching", True, "reuse cached prefix blocks (--noprefix_caching: off)", flag_values=fv)
    flags.DEFINE_integer("progress_every", 1000, "print a progress line every N steps", lower_bound=1, flag_values=fv)
    flags.DEFINE_string("out", None, "write the result as JSON to this path", flag_values=fv)
    flags.DEFINE_string("save_trace", None, "write the replayed trace as JSON to this path", flag_values=fv)
    flags.DEFINE_string(
        "plot",
        None,
        "draw KV usage and prefix hit rate over simulated time to this PNG (matplotlib)",
        flag_values=fv,
    )
    for name in ("user_turn_len", "output_len"):
        flags.register_validator(
            name, is_int_range, message=f"--{name} must be lo,hi with 1 <= lo <= hi", flag_values=fv
        )
    flags.register_validator(
        "step_ms", lambda v: 0 < v < math.inf, message="--step_ms must be a finite number > 0", flag_values=fv
    )
    return fv


def _check_synthetic_lengths(fv: flags.FlagValues, user_turn_len: tuple[int, int], output_len: tuple[int, int]) -> None:
    """Refuse knobs whose first turn cannot fit --max_model_len (before building huge lists)."""
    limit = fv.max_model_len
    if fv.system_prompt_len + user_turn_len[0] >= limit:
        raise TraceError(
            f"--system_prompt_len={fv.system_prompt_len} + --user_turn_len lo={user_turn_len[0]} leaves no room "
            f"for output in --max_model_len={limit}"
        )
    for name, (_, hi) in (("user_turn_len", user_turn_len), ("output_len", output_len)):
        if hi > limit:
            raise TraceError(f"--{name} hi={hi} exceeds --max_model_len={limit}")


def make_trace(fv: flags.FlagValues) -> list[TraceRequest]:
    """The trace file named by --trace, else the synthetic trace of the flags ``fv``."""
    if fv.trace:
        path = Path(fv.trace)
        if path.exists() and not path.is_file():
            raise CommandLineError(f"--trace={fv.trace} is not a regular file (a device or pipe reads without end)")
        if path.exists() and path.stat().st_size > MAX_TRACE_BYTES:
            raise CommandLineError(
                f"--trace={fv.trace} is {path.stat().st_size:,} bytes; the limit is {MAX_TRACE_BYTES:,}"
            )
        return load_trace(fv.trace)
    user_turn_len = (int(fv.user_turn_len[0]), int(fv.user_turn_len[1]))
    output_len = (int(fv.output_len[0]), int(fv.output_len[1]))
    _check_synthetic_lengths(fv, user_turn_len, output_len)
    return synthetic_trace(
        num_conversations=fv.num_conversations,
        turns_per_conversation=fv.turns_per_conversation,
        num_system_prompts=fv.num_system_prompts,
        system_prompt_len=fv.system_prompt_len,
        user_turn_len=user_turn_len,
        output_len=output_len,
        arrival_rate=fv.arrival_rate,
        turn_gap_s=fv.turn_gap_s,
        seed=fv.seed,
    )


def print_progress(p: Progress) -> None:
    """One progress line."""
    print(
        f"step {p.step:>7,}  t={p.time_s:8.1f}s  running {p.num_running:>3}  waiting {p.num_waiting:>4}  "
        f"finished {p.num_finished:>5,}/{p.num_requests:,}  usage {p.usage:6.1%}  preemptions {p.num_preemptions}",
        flush=True,
    )


def format_table(result: SimulationResult, wall_s: float) -> str:
    """The final report as aligned label/value rows."""
    r = result
    rows = [
        ("requests finished", f"{r.num_finished:,}/{r.num_requests:,} ({r.num_capped} stopped at max_model_len)"),
        ("scheduler steps", f"{r.num_steps:,} ({r.simulated_time_s:,.1f} s simulated)"),
        ("prefix hit rate", f"{r.prompt_hit_rate:.1%} of {r.num_prompt_tokens:,} prompt tokens, first admissions"),
        (
            "manager hit rate",
            (
                f"{r.cache_hit_rate:.1%} of {r.cache_queried_tokens:,} tokens in {r.cache_queries:,} lookups "
                "(re-queries included)"
            ),
        ),
        ("KV usage peak / mean", f"{r.peak_usage:.1%} / {r.mean_usage:.1%}"),
        ("preemptions", f"{r.num_preemptions:,}"),
        ("tokens scheduled", f"{r.num_scheduled_tokens:,} ({r.num_generated_tokens:,} generated)"),
        ("host us/step", f"mean {r.host_us_mean:,.1f}  p50 {r.host_us_p50:,.1f}  p99 {r.host_us_p99:,.1f}"),
        ("wall time", f"{wall_s:.2f} s ({r.host_s_total:.2f} s in scheduler + manager)"),
        ("outputs digest", r.outputs_digest()),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


class Timeline:
    """Progress snapshots, for --plot; prints one line per ``print_every`` (--progress_every) steps."""

    def __init__(self, print_every: int) -> None:
        self.print_every = print_every
        self.points: list[Progress] = []

    def __call__(self, p: Progress) -> None:
        self.points.append(p)
        if p.step % self.print_every == 0:
            print_progress(p)


def plot_sample_every(trace: Sequence[TraceRequest], step_ms: float, progress_every: int) -> int:
    """Steps between --plot samples: about PLOT_SAMPLES over the arrivals, dividing ``progress_every``."""
    last_arrival_steps = max((r.arrival_time for r in trace), default=0.0) * 1000 / step_ms
    target = max(1, int(last_arrival_steps) // PLOT_SAMPLES)
    return max(d for d in range(1, min(target, progress_every) + 1) if progress_every % d == 0)


def plot_timeline(prog: str, points: Sequence[Progress], path: str, title: str) -> None:
    """KV usage (top) and prefix hit rate (bottom: per sample and since the start) over simulated time."""
    plt = pyplot(prog)
    fig, (usage_ax, hit_ax) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    times = [p.time_s for p in points]
    usage_ax.plot(times, [100 * p.usage for p in points], color="tab:blue", lw=1)
    usage_ax.set_ylabel("KV usage (%)")
    usage_ax.set_ylim(0, 105)
    preempted = [p.time_s for p, q in zip(points[1:], points, strict=False) if p.num_preemptions > q.num_preemptions]
    if preempted:
        usage_ax.plot(preempted, [102] * len(preempted), "|", color="tab:red", ms=8, label="preemption")
        usage_ax.legend(loc="lower right")
    window = []
    for p, q in zip(points[1:], points, strict=False):
        queried = p.cache_queried_tokens - q.cache_queried_tokens
        window.append(100 * (p.cache_hit_tokens - q.cache_hit_tokens) / queried if queried else float("nan"))
    total = [
        100 * p.cache_hit_tokens / p.cache_queried_tokens if p.cache_queried_tokens else float("nan") for p in points
    ]
    hit_ax.plot(times[1:], window, color="tab:green", lw=0.8, alpha=0.6, label="per sample")
    hit_ax.plot(times, total, color="tab:green", lw=2, label="since start")
    hit_ax.set_ylabel("prefix hit rate (%)")
    hit_ax.set_ylim(0, 100)
    hit_ax.set_xlabel("simulated time (s)")
    hit_ax.legend(loc="lower right")
    usage_ax.set_title(title)
    save_figure(prog, fig, path)


def plan(fv: flags.FlagValues) -> KVCacheConfig:
    """The KV cache plan of the flags ``fv`` (a hybrid with recurrent layers: one memory for KV
    pages and states, the planner's default); refuses one of more than MAX_NUM_BLOCKS blocks."""
    config = plan_kv_cache(
        get_preset(fv.preset),
        parse_size(fv.memory),
        max_model_len=fv.max_model_len,
        options=PlanOptions(block_size=fv.block_size, max_num_batched_tokens=fv.max_num_batched_tokens),
    )
    try:
        check_num_blocks(config.num_blocks)
    except PlanTooLargeError as err:
        raise PlanTooLargeError(f"--memory={fv.memory}: {err}") from None
    return config


def simulate(fv: flags.FlagValues, prog: str) -> dict:
    """Plan, build the trace, replay it, print everything; return the JSON report."""
    if fv.plot:
        pyplot(prog)  # refuse now, not after the run, if matplotlib is missing
    start = time.perf_counter()
    config = plan(fv)
    print(f"{fv.preset}, {fv.memory}:")
    print(config.summary())
    trace = make_trace(fv)
    if fv.save_trace:
        save_trace(fv.save_trace, trace)
    num_prompt = sum(len(r.prompt_token_ids) for r in trace)
    print(f"trace: {len(trace):,} requests, {num_prompt:,} prompt tokens ({fv.trace or 'synthetic'})")
    manager = KVCacheManager(config, enable_caching=fv.prefix_caching, hash_algo=fv.hash_algo)
    sim = Simulator(
        manager,
        max_num_seqs=fv.max_num_seqs,
        max_num_batched_tokens=fv.max_num_batched_tokens,
        step_duration_s=fv.step_ms / 1000,
    )
    every = plot_sample_every(trace, fv.step_ms, fv.progress_every) if fv.plot else fv.progress_every
    timeline = Timeline(fv.progress_every)
    result = sim.run(trace, progress=timeline, progress_every=every)
    wall_s = time.perf_counter() - start
    print(format_table(result, wall_s))
    if fv.plot:
        memory = f"{fv.memory}{'' if fv.prefix_caching else ', no prefix caching'}"
        plot_timeline(prog, timeline.points, fv.plot, f"{fv.preset}, {memory}: {len(trace):,} requests")
    return {
        "flags": fv.flag_values_dict(),
        "plan": {
            "num_blocks": config.num_blocks,
            "block_bytes": None if config.pages is None else config.pages.block_bytes,
        },
        "result": result.to_dict(),
        "wall_s": wall_s,
    }


def run(argv: Sequence[str] | None = None) -> None:
    """The console script ``jaxkv-simulate`` on ``argv`` (default ``sys.argv``)."""
    argv = list(sys.argv if argv is None else argv)
    prog = program_name(argv, COMMAND)
    fv = define_flags()
    flags_parser(prog, fv, module=__name__, command=COMMAND)(argv)
    try:
        report = simulate(fv, prog)
        if fv.out:
            with open(fv.out, "w") as f:
                json.dump(report, f, indent=2)
            print(f"wrote {fv.out}")
    # PlanError is listed until the planner's errors subclass JaxkvError too.
    except (JaxkvError, OSError) as err:
        exit_error(prog, err)


if __name__ == "__main__":
    run()
