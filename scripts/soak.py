"""Soak test of the serving engine with the host offload tier and injected transfer failures.

Serves a multi-turn chat workload (conversations over a few shared system prompts; each
turn resends the whole context plus a new user message) through :class:`Engine` with a
small device pool (requests preempt), a small host tier (it evicts) and random store and
load failures (``--fail_rate`` per block row), for every model x store policy (the host
eviction policy alternates LRU / ARC), several ``generate`` calls per configuration so
later calls hit blocks that earlier ones left on device and on host. The same prompts go
through an engine of the same model and plan without offload (and without faults), and
every request's tokens must equal that reference. After each ``generate`` call the
engine's :meth:`Engine.audit` must find no leaked device blocks and no leaked host blocks.

Prints one row per configuration (requests, preemptions, faults injected, host loads,
leaks, tokens equal, RSS) and the totals with the process RSS at start and end; exits 1
if any request's tokens differ, anything leaked, or the engine raised.

    python scripts/soak.py                       # 1,000 requests, ~ a few minutes on CPU
    python scripts/soak.py --num_requests 40 --out /tmp/soak.json
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from absl import app, flags, logging

from jaxkv import ops
from jaxkv.commands.cli import flags_parser
from jaxkv.models.tiny import MODEL_CONFIGS, get_model_config
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.serving.engine import Engine, GenerationResult
from jaxkv.serving.offload_connector import STORE_POLICIES, OffloadConfig

PROG = "soak.py"
FLAGS = flags.FLAGS
flags.DEFINE_integer("num_requests", 1000, "requests in total, split over the configurations", lower_bound=1)
flags.DEFINE_list("models", list(MODEL_CONFIGS), "models to soak (a recurrent one in the engine's default layout)")
flags.DEFINE_list("stores", list(STORE_POLICIES), "store policies to soak")
flags.DEFINE_list("policies", ["lru", "arc"], "host eviction policies, used by the configurations in turn")
flags.DEFINE_integer("seed", 0, "workload and failure seed")
flags.DEFINE_float("fail_rate", 0.2, "probability that one block row of a store or a load fails", 0.0, 1.0)
flags.DEFINE_integer("max_new_tokens", 6, "tokens generated per request", lower_bound=1)
flags.DEFINE_integer("batch_size", 16, "requests per generate call", lower_bound=1)
flags.DEFINE_integer("num_conversations", 24, "conversations in flight per configuration", lower_bound=1)
flags.DEFINE_integer("num_system_prompts", 3, "distinct shared system prompts", lower_bound=1)
flags.DEFINE_list("system_len", ["40", "96"], "lo,hi tokens of a system prompt")
flags.DEFINE_list("user_len", ["8", "32"], "lo,hi tokens of a user message")
flags.DEFINE_integer("max_prompt_len", 200, "a conversation restarts before its prompt would exceed this")
flags.DEFINE_integer("max_model_len", 256, "the plan's max_model_len", lower_bound=2)
flags.DEFINE_float("device_requests", 2.5, "device pool, in blocks of one max_model_len request", lower_bound=1.0)
flags.DEFINE_float("host_requests", 3.0, "host tier, in blocks of one max_model_len request", lower_bound=0.1)
flags.DEFINE_integer("max_num_seqs", 8, "most requests running at once", lower_bound=1)
flags.DEFINE_integer("max_num_batched_tokens", 128, "token budget of one step", lower_bound=1)
flags.DEFINE_enum(
    "impl", "auto", list(ops.IMPLEMENTATIONS), "jaxkv.device.ops implementation (auto: the device's, as a user gets)"
)
flags.DEFINE_integer("max_reported_mismatches", 5, "mismatching requests printed per configuration")
flags.DEFINE_string("out", None, "write the report as JSON to this path")
for _name in ("system_len", "user_len"):
    flags.register_validator(
        _name,
        lambda v: len(v) == 2 and all(x.strip().isdigit() for x in v) and 1 <= int(v[0]) <= int(v[1]),
        message=f"--{_name} must be lo,hi with 1 <= lo <= hi",
    )


# ----------------------------------------------------------------- helpers
def rss_mib() -> float:
    """The process's resident set size in MiB (VmRSS; peak RSS where /proc is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def int_range(values: Sequence[str]) -> tuple[int, int]:
    """``lo,hi`` flag values as ints."""
    return int(values[0]), int(values[1])


@dataclass
class FaultInjector:
    """A failure hook failing each block row with probability ``p``; counts what it failed."""

    rng: np.random.Generator
    p: float
    num_calls: int = 0
    num_rows: int = 0
    num_failed: int = 0

    def __call__(self, device_block_ids: np.ndarray, host_blocks: np.ndarray) -> np.ndarray:
        mask = self.rng.random(len(device_block_ids)) < self.p
        self.num_calls += 1
        self.num_rows += len(mask)
        self.num_failed += int(mask.sum())
        return mask


@dataclass
class ChatWorkload:
    """Multi-turn conversations over a few shared system prompts.

    Each call's batch takes distinct conversations at random (idle ones lose their
    device blocks to the others, then come back); a prompt is the conversation's whole
    context plus a new user message. A conversation whose next prompt could exceed
    ``max_prompt_len`` starts again from a system prompt.
    """

    rng: np.random.Generator
    vocab_size: int
    num_conversations: int
    num_system_prompts: int
    system_len: tuple[int, int]
    user_len: tuple[int, int]
    max_prompt_len: int
    systems: list[list[int]] = field(init=False)
    contexts: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.systems = [self._tokens(*self.system_len) for _ in range(self.num_system_prompts)]
        self.contexts = [self._start() for _ in range(self.num_conversations)]

    def _tokens(self, lo: int, hi: int) -> list[int]:
        return self.rng.integers(0, self.vocab_size, int(self.rng.integers(lo, hi + 1))).tolist()

    def _start(self) -> list[int]:
        return list(self.systems[int(self.rng.integers(len(self.systems)))])

    def next_batch(self, n: int) -> tuple[list[int], list[list[int]]]:
        """``n`` (at most ``num_conversations``) conversation indices and their prompts."""
        picked = self.rng.choice(self.num_conversations, min(n, self.num_conversations), replace=False).tolist()
        prompts = []
        for c in picked:
            if len(self.contexts[c]) + self.user_len[1] > self.max_prompt_len:
                self.contexts[c] = self._start()
            prompts.append(self.contexts[c] + self._tokens(*self.user_len))
        return picked, prompts

    def record(self, picked: Sequence[int], prompts: Sequence[list[int]], outputs: Sequence[Sequence[int]]) -> None:
        """Each conversation's context becomes its prompt and the reply."""
        for c, prompt, out in zip(picked, prompts, outputs, strict=True):
            self.contexts[c] = prompt + list(out)


@dataclass
class ConfigResult:
    """What one model x store x policy configuration did."""

    model: str
    store: str
    policy: str
    num_requests: int = 0
    num_calls: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    store_faults: int = 0
    load_faults: int = 0
    loaded_tokens: int | None = None
    failed_loads: int | None = None
    device_blocks_leaked: int | None = None
    host_blocks_leaked: int | None = None
    first_leak_call: int | None = None
    tokens_equal: int = 0
    mismatches: list[dict] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    rss_mib: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.device_blocks_leaked == 0
            and self.host_blocks_leaked == 0
            and self.tokens_equal == self.num_requests
        )


def plan_memory(model: str) -> tuple[int, int]:
    """Device and host bytes for ``model``: ``--device_requests`` and ``--host_requests``
    max_model_len requests' worth of blocks (plus the null block on device)."""
    specs = get_model_config(model).layer_specs()
    big = plan_kv_cache(
        specs,
        1 << 30,
        max_model_len=FLAGS.max_model_len,
        options=PlanOptions(max_num_batched_tokens=FLAGS.max_num_batched_tokens),
    )
    per_request = sum(big.blocks_per_request())
    block_bytes = big.pages.block_bytes
    device = (math.ceil(FLAGS.device_requests * per_request) + 1) * block_bytes
    host = math.ceil(FLAGS.host_requests * per_request) * block_bytes
    return device, host


def build_engine(model: str, memory_bytes: int, offload: OffloadConfig | None) -> Engine:
    """An engine of ``model`` on the soak's plan, with or without the host tier."""
    return Engine.build(
        model,
        memory_bytes=memory_bytes,
        max_model_len=FLAGS.max_model_len,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        max_num_seqs=FLAGS.max_num_seqs,
        offload=offload,
    )


def audit(engine: Engine, res: ConfigResult, call: int) -> None:
    """Record the engine's leaks after ``call`` (and the first call that leaked); an
    engine without :meth:`Engine.audit` is an error, but the soak goes on serving."""
    if not hasattr(engine, "audit"):
        res.error = "Engine.audit() is missing: leaks unchecked"
        return
    report = engine.audit()
    res.device_blocks_leaked = int(report.device_blocks_leaked)
    res.host_blocks_leaked = int(report.host_blocks_leaked)
    if (res.device_blocks_leaked or res.host_blocks_leaked) and res.first_leak_call is None:
        res.first_leak_call = call


def compare(
    res: ConfigResult, call: int, prompts: Sequence[list[int]], got: GenerationResult, want: GenerationResult
) -> None:
    """Count requests whose tokens equal the reference's; keep the first mismatches."""
    for i, (g, w) in enumerate(zip(got.outputs, want.outputs, strict=True)):
        if g.output_token_ids == w.output_token_ids:
            res.tokens_equal += 1
        elif len(res.mismatches) < FLAGS.max_reported_mismatches:
            res.mismatches.append(
                {
                    "call": call,
                    "index": i,
                    "prompt_len": len(prompts[i]),
                    "cached": g.num_cached_tokens,
                    "preemptions": g.num_preemptions,
                    "got": list(g.output_token_ids),
                    "want": list(w.output_token_ids),
                }
            )


def run_config(index: int, model: str, store: str, policy: str, num_requests: int, reference: Engine) -> ConfigResult:
    """Serve ``num_requests`` chat requests with faults; check tokens against ``reference`` and leaks."""
    res = ConfigResult(model, store, policy)
    start = time.perf_counter()
    rng = np.random.default_rng([FLAGS.seed, index])
    fail_store = FaultInjector(np.random.default_rng([FLAGS.seed, index, 1]), FLAGS.fail_rate)
    fail_load = FaultInjector(np.random.default_rng([FLAGS.seed, index, 2]), FLAGS.fail_rate)
    device_bytes, host_bytes = plan_memory(model)
    offload = OffloadConfig(host_bytes, policy=policy, store=store, fail_store=fail_store, fail_load=fail_load)
    workload = ChatWorkload(
        rng,
        get_model_config(model).vocab_size,
        FLAGS.num_conversations,
        FLAGS.num_system_prompts,
        int_range(FLAGS.system_len),
        int_range(FLAGS.user_len),
        FLAGS.max_prompt_len,
    )
    try:
        engine = build_engine(model, device_bytes, offload)
        while res.num_requests < num_requests:
            picked, prompts = workload.next_batch(min(FLAGS.batch_size, num_requests - res.num_requests))
            res.num_calls += 1
            got = engine.generate(prompts, FLAGS.max_new_tokens)
            want = reference.generate(prompts, FLAGS.max_new_tokens)
            res.num_requests += len(prompts)
            res.num_preemptions += got.num_preemptions
            res.num_prompt_tokens += got.num_prompt_tokens
            res.num_cached_tokens += got.num_cached_prompt_tokens
            compare(res, res.num_calls, prompts, got, want)
            workload.record(picked, prompts, [o.output_token_ids for o in want.outputs])
            audit(engine, res, res.num_calls)
        stats = engine.connector.stats if engine.connector is not None else None
        res.loaded_tokens = getattr(stats, "num_loaded_tokens", None)
        res.failed_loads = getattr(stats, "num_failed_loads", None)
    except Exception as err:
        lines = traceback.format_exception(err)
        res.error = f"call {res.num_calls}: {type(err).__name__}: {err}"
        print(f"\n[{model} {store} {policy}] crashed in call {res.num_calls}:\n" + "".join(lines[-6:]), flush=True)
    res.store_faults = fail_store.num_failed
    res.load_faults = fail_load.num_failed
    res.wall_s = time.perf_counter() - start
    res.rss_mib = rss_mib()
    return res


# ------------------------------------------------------------------ report
def fmt(value: object) -> str:
    """A table cell: '-' for unknown."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def table(results: Sequence[ConfigResult]) -> str:
    """One row per configuration."""
    cols = (
        "model",
        "store",
        "policy",
        "requests",
        "calls",
        "preemptions",
        "faults store",
        "faults load",
        "host loaded tok",
        "failed loads",
        "dev leaked",
        "host leaked",
        "tokens equal",
        "wall s",
        "RSS MiB",
    )
    rows = [
        (
            r.model,
            r.store,
            r.policy,
            r.num_requests,
            r.num_calls,
            r.num_preemptions,
            r.store_faults,
            r.load_faults,
            r.loaded_tokens,
            r.failed_loads,
            r.device_blocks_leaked,
            r.host_blocks_leaked,
            f"{r.tokens_equal}/{r.num_requests}",
            r.wall_s,
            r.rss_mib,
        )
        for r in results
    ]
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(cols)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(cols, widths, strict=True)), "-|-".join("-" * w for w in widths)]
    lines += [
        " | ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    return "\n".join(lines)


def totals(results: Sequence[ConfigResult]) -> dict:
    """Counters summed over the configurations (leaks: None if any audit is missing)."""

    def total(name: str) -> int | None:
        values = [getattr(r, name) for r in results]
        return None if any(v is None for v in values) else sum(values)

    return {
        "requests": sum(r.num_requests for r in results),
        "preemptions": sum(r.num_preemptions for r in results),
        "faults_store": sum(r.store_faults for r in results),
        "faults_load": sum(r.load_faults for r in results),
        "device_blocks_leaked": total("device_blocks_leaked"),
        "host_blocks_leaked": total("host_blocks_leaked"),
        "tokens_equal": sum(r.tokens_equal for r in results),
        "errors": sum(r.error is not None for r in results),
    }


def configurations() -> list[tuple[str, str, str]]:
    """(model, store, policy) for every model x store; policies alternate."""
    pairs = [(m, s) for m in FLAGS.models for s in FLAGS.stores]
    return [(m, s, FLAGS.policies[i % len(FLAGS.policies)]) for i, (m, s) in enumerate(pairs)]


def soak(rss_start: float) -> tuple[list[ConfigResult], dict]:
    """Run every configuration; print the table and summary; return results and totals."""
    configs = configurations()
    share, extra = divmod(FLAGS.num_requests, len(configs))
    print(
        f"soak: {FLAGS.num_requests} requests over {len(configs)} configurations, fail rate {FLAGS.fail_rate}, "
        f"{FLAGS.max_new_tokens} new tokens, device {FLAGS.device_requests} / host {FLAGS.host_requests} "
        f"max_model_len={FLAGS.max_model_len} requests, seed {FLAGS.seed}",
        flush=True,
    )
    references: dict[str, Engine] = {}
    results = []
    for i, (model, store, policy) in enumerate(configs):
        if model not in references:
            references[model] = build_engine(model, plan_memory(model)[0], None)
        res = run_config(i, model, store, policy, share + (i < extra), references[model])
        print(
            f"[{i + 1}/{len(configs)}] {model} {store} {policy}: {res.num_requests} requests, "
            f"{res.tokens_equal} equal, leaks {fmt(res.device_blocks_leaked)}/{fmt(res.host_blocks_leaked)}, "
            f"{res.wall_s:.1f} s{'' if res.ok else '  FAILED'}",
            flush=True,
        )
        for m in res.mismatches:
            print(f"    mismatch: {m}")
        results.append(res)
    t = totals(results)
    print()
    print(table(results))
    print()
    rows = [
        ("requests", t["requests"]),
        ("preemptions", t["preemptions"]),
        (
            "faults injected",
            f"{t['faults_store'] + t['faults_load']} ({t['faults_store']} store, {t['faults_load']} load)",
        ),
        ("device blocks leaked", fmt(t["device_blocks_leaked"])),
        ("host blocks leaked", fmt(t["host_blocks_leaked"])),
        ("tokens equal", f"{t['tokens_equal']}/{t['requests']} (vs the engine without offload)"),
        ("errors", t["errors"]),
        ("RSS", f"{rss_start:.1f} MiB at start, {rss_mib():.1f} MiB at end"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    return results, t


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    rss_start = rss_mib()
    with ops.set_implementation(FLAGS.impl):
        results, t = soak(rss_start)
    ok = all(r.ok for r in results)
    if FLAGS.out:
        report = {
            "flags": {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])},
            "configs": [{**asdict(r), "ok": r.ok} for r in results],
            "totals": t,
            "rss_mib": {"start": rss_start, "end": rss_mib()},
            "ok": ok,
        }
        with open(FLAGS.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {FLAGS.out}")
    if not ok:
        sys.exit("soak FAILED: leaks, token mismatches or errors (see above)")
    print("soak passed")


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
