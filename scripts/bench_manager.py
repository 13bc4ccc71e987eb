"""Host time of the KV cache manager, side by side with vLLM's own manager.

One request stream drives jaxkv's :class:`~jaxkv.core.manager.KVCacheManager` and, when vLLM
is importable, vLLM v1's ``KVCacheManager`` (same groups, block size and pool size)
through the same small scheduler loop. Each step, the tokens the last step sampled are
appended to every running request (those that reach their decode steps finish and are
freed); then every running request gets one decode slot, in order, and when the pool
cannot serve one the newest running request is preempted (freed, reset to 0 computed
tokens, back to the head of the queue); then FCFS admission up to ``max_running`` (a
prefix lookup, then the rest of the prompt; admission stops at the first request that
does not fit). Each side makes the calls its own serving loop makes. Timed: ``request``
(building the ``Request`` and hashing its prompt: vLLM's hashes itself when built),
``lookup`` (``get_computed_blocks``), ``alloc_prefill``, ``alloc_decode`` (a step's decode
slots: jaxkv's ``allocate_decode_slots``, one call per batch, vLLM's ``allocate_slots``
per request, as its scheduler calls it), ``free``, and ``append`` (a step's sampled tokens:
jaxkv's ``append_token_ids``, one call per batch, vLLM's ``append_output_token_ids`` per
request; vLLM hashes a block that fills there, jaxkv in the decode allocation that caches
it, inside ``alloc_decode``). Garbage
collection stays on for both; the heap is collected before each timed run, so neither
side pays for the other's garbage. The two run alternately, ``--pairs`` times each, and every
figure is the median over the pairs; an op's ratio is jaxkv / vLLM of those medians. The
total's headline ratio is the median of the per-pair ratios (each pair ran back to back,
so a machine that speeds up or slows down between pairs moves both sides of a pair
alike), printed with their range and with the ratio of the medians.

Workloads: ``base`` (64 requests, 4 shared 2048-token system prompts plus 256-1024-token
suffixes, 128 decode steps, at most 32 running, a pool that holds them all), ``pressure``
(the same stream in a pool of 40 % of its working set: admissions fail, requests are
preempted, window blocks are evicted) and ``running512`` (512 requests running at once:
512-token system prompts, 64-256-token suffixes, 32 decode steps). Models: ``full``
(one full-attention group) and ``gemma3-like`` (5 sliding-window groups of window 1024 +
1 full) and ``mixed-blocks`` (full attention with blocks 4x ``--block_size`` beside 2
window groups of 2 blocks' window at ``--block_size``: groups of different block sizes, where
a window group caches only the blocks a hit can end on) and ``recurrent`` (3 Mamba groups of a
Gated-DeltaNet-like state + 1 full, vLLM's align mode on its side; timed only: jaxkv keeps one
live state block a request where align mode keeps up to two) in vLLM's layout on both sides, and
``recurrent-shared``, the same model in jaxkv's default layout for it (``shared_pages``: a state is
as many blocks of the pool as its :data:`STATE_BYTES` fill, checkpoints where the prompt ends and
the newest decode boundary) against the same vLLM side (timed only: the layouts differ). With
``--check_decisions`` (on when vLLM is importable) the stream first runs through both managers in lockstep, untimed, and
every hit, block id list, allocation failure and the free queue after every scheduler step must agree.

    python scripts/bench_manager.py --out bench_manager.json

vLLM is a benchmark-only extra, never a dependency; BUILD.md says how to install it.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from absl import app, flags

from jaxkv.commands.cli import flags_parser
from jaxkv.core.manager import KVCacheManager, Request
from jaxkv.planner import KVCacheConfig, KVCacheGroup, SharedStates
from jaxkv.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec

PROG = "bench_manager.py"
FLAGS = flags.FLAGS
flags.DEFINE_list("models", ["full", "gemma3-like", "mixed-blocks", "recurrent", "recurrent-shared"], "models to run")
flags.DEFINE_list("workloads", ["base", "pressure", "running512"], "workloads to run")
flags.DEFINE_integer("pairs", 5, "alternating jaxkv / vLLM runs per workload; medians are reported", lower_bound=1)
flags.DEFINE_integer("block_size", 16, "tokens per block", lower_bound=1)
flags.DEFINE_integer("sliding_window", 1024, "window of the hybrid's sliding groups", lower_bound=2)
flags.DEFINE_enum("hash_algo", "sha256", ["sha256", "xxh3_128"], "jaxkv's prefix hash (vLLM uses sha256)")
flags.DEFINE_float("scale", 1.0, "multiplies the number of requests of every workload (quick runs)", lower_bound=0.01)
flags.DEFINE_boolean("check_decisions", None, "compare every decision with vLLM's (default: when vLLM is there)")
flags.DEFINE_boolean("peer", True, "time vLLM's manager too when it is importable")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_string("out", None, "write the results as JSON here")

OPS = ("request", "lookup", "alloc_prefill", "alloc_decode", "free", "append")
PRESSURE = 0.6
"""The pressure workload's pool, as a fraction of the blocks the stream holds at its peak."""
MAX_MODEL_LEN = 8192
MAMBA_SHAPES = ((3, 1024), (8, 64, 64))
"""A Gated-DeltaNet-like state (conv, recurrent) of the ``recurrent`` model's groups (vLLM's align mode)."""
STATE_BYTES = sum(2 * math.prod(shape) for shape in MAMBA_SHAPES)
"""One layer's state in bfloat16: 70 KiB."""


@dataclass(frozen=True)
class Workload:
    """A request stream and the pool it runs in."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    decode_steps: int
    max_running: int
    num_blocks: int


def make_workload(name: str, model: str, seed: int, scale: float) -> Workload:
    rng = np.random.default_rng(seed)
    if name == "running512":
        num, systems, system_len, suffix, steps, running = 512, 4, 512, (64, 256), 32, 512
    else:
        num, systems, system_len, suffix, steps, running = 64, 4, 2048, (256, 1024), 128, 32
    num = max(1, round(num * scale))
    shared = [rng.integers(0, 50_000, system_len).tolist() for _ in range(systems)]
    prompts = tuple(
        tuple(shared[i % systems] + rng.integers(50_000, 100_000, int(rng.integers(*suffix))).tolist())
        for i in range(num)
    )
    per_request = -(-(max(map(len, prompts)) + steps) // FLAGS.block_size)
    groups = len(group_specs(model))
    roomy = Workload(name, prompts, steps, running, groups * per_request * (min(running, num) + systems) + 2)
    if name != "pressure":
        return roomy
    # 60 % of the blocks the stream holds at its peak in a pool that fits everything.
    _, min_free = run_loop([JaxkvSide(model, roomy.num_blocks)], roomy, None)
    peak = roomy.num_blocks - 1 - min_free
    return Workload(name, prompts, steps, running, max(int(peak * PRESSURE), groups * per_request + 2))


def group_specs(model: str) -> list[tuple[str, int | None, int]]:
    """(kind, window, block size) per group."""
    bs = FLAGS.block_size
    if model == "full":
        return [("full", None, bs)]
    if model == "mixed-blocks":
        return [("full", None, 4 * bs)] + [("window", 2 * bs, bs)] * 2
    if model.startswith("recurrent"):
        return [("mamba", None, bs)] * 3 + [("full", None, bs)]
    return [("window", FLAGS.sliding_window, bs)] * 5 + [("full", None, bs)]


# ------------------------------------------------------------------------ the two sides
class JaxkvSide:
    """jaxkv's manager behind the loop's small interface."""

    name = "jaxkv"

    def __init__(self, model: str, num_blocks: int) -> None:
        made = {
            "full": lambda w: FullAttentionSpec(num_kv_heads=8, head_size=128),
            "window": lambda w: SlidingWindowSpec(num_kv_heads=8, head_size=128, sliding_window=w),
            "mamba": lambda w: MambaSpec(shapes=MAMBA_SHAPES, dtypes=("bfloat16", "bfloat16")),
        }
        specs = [made[kind](window) for kind, window, _ in group_specs(model)]
        sizes = [bs for _, _, bs in group_specs(model)]
        groups = tuple(KVCacheGroup((f"layer{i}",), s, bs) for i, (s, bs) in enumerate(zip(specs, sizes, strict=True)))
        shared = None
        if model == "recurrent-shared":  # a state is pages of the pool, as many as its bytes fill
            shared = SharedStates(-(-STATE_BYTES // specs[-1].page_size_bytes(FLAGS.block_size)), STATE_BYTES)
        config = KVCacheConfig(num_blocks=num_blocks, groups=groups, states=shared)
        self.manager = KVCacheManager(config, max_model_len=MAX_MODEL_LEN, hash_algo=FLAGS.hash_algo)

    def request(self, rid: str, tokens: Sequence[int]) -> Request:
        req = Request(rid, tokens)
        self.manager.hash_request(req)
        return req

    def lookup(self, req: Request) -> tuple[object, int]:
        return self.manager.get_computed_blocks(req)

    def allocate(self, req: Request, num_new: int, num_hit: int = 0, hit: object = None) -> object:
        return self.manager.allocate_slots(req, num_new, num_hit, hit)

    def append(self, reqs: list[Request]) -> None:
        self.manager.append_token_ids(reqs, [7] * len(reqs))

    def allocate_decodes(self, reqs: list[Request], start: int) -> int:
        return self.manager.allocate_decode_slots(reqs[start:] if start else reqs)

    def free(self, req: Request) -> None:
        self.manager.free(req)

    def free_queue(self) -> list[int]:
        return self.manager.pool.free_block_ids()

    def num_free(self) -> int:
        return self.manager.num_free_blocks


class VllmSide:
    """vLLM v1's own manager (and Request, which hashes itself) behind the same interface."""

    name = "vllm"

    def __init__(self, model: str, num_blocks: int) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec as VFull
        from vllm.v1.kv_cache_interface import KVCacheConfig as VConfig
        from vllm.v1.kv_cache_interface import KVCacheGroupSpec
        from vllm.v1.kv_cache_interface import MambaSpec as VMamba
        from vllm.v1.kv_cache_interface import SlidingWindowSpec as VWindow
        from vllm.v1.request import Request as VRequest

        init_none_hash(sha256)
        bs = FLAGS.block_size
        common = dict(num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
        mamba = dict(shapes=MAMBA_SHAPES, dtypes=(torch.bfloat16, torch.bfloat16), mamba_cache_mode="align")
        made = {
            "full": lambda w, size: VFull(**common, block_size=size),
            "window": lambda w, size: VWindow(**common, block_size=size, sliding_window=w),
            "mamba": lambda w, size: VMamba(block_size=size, **mamba),
        }
        specs = [made[kind](w, size) for kind, w, size in group_specs(model)]
        config = VConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
        )
        lcm = math.lcm(*(size for _, _, size in group_specs(model)))
        self.manager = VllmManager(
            config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=lcm, hash_block_size=bs, enable_caching=True
        )
        self._hasher = get_request_block_hasher(bs, sha256)
        self._params = SamplingParams(max_tokens=MAX_MODEL_LEN)
        self._request_cls = VRequest

    def request(self, rid: str, tokens: Sequence[int]) -> object:
        return self._request_cls(rid, list(tokens), self._params, None, block_hasher=self._hasher)

    def lookup(self, req: object) -> tuple[object, int]:
        blocks, n, _ = self.manager.get_computed_blocks(req)
        return blocks, n

    def allocate(self, req: object, num_new: int, num_hit: int = 0, hit: object = None) -> object:
        return self.manager.allocate_slots(req, num_new, num_hit, hit)

    def append(self, reqs: list) -> None:
        for req in reqs:
            req.append_output_token_ids(7)

    def allocate_decodes(self, reqs: list, start: int) -> int:
        allocate = self.manager.allocate_slots
        for k in range(start, len(reqs)):
            if allocate(reqs[k], 1) is None:
                return k - start
        return len(reqs) - start

    def free(self, req: object) -> None:
        self.manager.free(req)

    def free_queue(self) -> list[int]:
        return [b.block_id for b in self.manager.block_pool.free_block_queue.get_all_free_blocks()]

    def num_free(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()


def vllm_available() -> bool:
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except ImportError:
        return False
    return True


# ----------------------------------------------------------------------- the loop
class DecisionMismatch(Exception):
    """The two managers decided differently; the message says where."""


def block_ids(blocks: object) -> tuple[tuple[int, ...], ...] | None:
    return None if blocks is None else tuple(tuple(g) for g in blocks.get_block_ids())


def run_loop(sides: Sequence, workload: Workload, times: list[dict[str, float]] | None) -> tuple[int, int]:
    """Serve the workload on every side in lockstep; return the number of preemptions
    and the fewest free blocks seen after a step (of the first side).

    With one side, ``times[0]`` collects its host time per op. With two, nothing is
    timed and every decision is compared (:class:`DecisionMismatch` on the first
    difference)."""
    clock = time.perf_counter

    def call(op: str, fn: Callable, *args_per_side: Sequence) -> list:
        out = []
        for k, side in enumerate(sides):
            start = clock()
            out.append(fn(side, *args_per_side[k]))
            if times is not None:
                times[k][op] += clock() - start
        return out

    reqs = [
        call("request", lambda s, p, i=i: s.request(f"r{i}", p), *[(p,)] * len(sides))
        for i, p in enumerate(workload.prompts)
    ]
    generated = [0] * len(reqs)
    waiting: deque[int] = deque(range(len(reqs)))
    running: list[int] = []
    preemptions = step = 0
    min_free = workload.num_blocks

    def agree(what: str, results: list) -> None:
        if len(results) > 1 and results[0] != results[1]:
            raise DecisionMismatch(f"step {step}, {what}: jaxkv {results[0]!r:.300} != vLLM {results[1]!r:.300}")

    def preempt(i: int) -> None:
        nonlocal preemptions
        call("free", lambda s, r: s.free(r), *[(r,) for r in reqs[i]])
        for r in reqs[i]:
            r.num_computed_tokens = 0
        waiting.appendleft(i)
        preemptions += 1

    while waiting or running:
        step += 1
        preempted = False
        if running:
            # The last step's sampled tokens: one for every running request.
            call("append", lambda s, rs: s.append(rs), *[([reqs[i][k] for i in running],) for k in range(len(sides))])
            for i in running:
                generated[i] += 1
            for i in [i for i in running if generated[i] >= workload.decode_steps]:
                call("free", lambda s, r: s.free(r), *[(r,) for r in reqs[i]])
            running = [i for i in running if generated[i] < workload.decode_steps]
        pos = 0
        while pos < len(running):
            batch = [[reqs[i][k] for i in running] for k in range(len(sides))]
            served = call("alloc_decode", lambda s, rs, p: s.allocate_decodes(rs, p), *[(b, pos) for b in batch])
            agree(f"decodes from r{running[pos]}", served)
            for i in running[pos : pos + served[0]]:
                for r in reqs[i]:
                    r.num_computed_tokens += 1
            pos += served[0]
            if pos < len(running):
                preempt(running.pop())
                preempted = True
        while waiting and not preempted and len(running) < workload.max_running:
            i = waiting[0]
            found = call("lookup", lambda s, r: s.lookup(r), *[(r,) for r in reqs[i]])
            agree(f"lookup of r{i}", [(n, block_ids(b)) for b, n in found])
            num_tokens = [r.num_tokens for r in reqs[i]]
            got = call(
                "alloc_prefill",
                lambda s, r, n, b, t: s.allocate(r, t - n, n, b),
                *[(r, n, b, t) for r, (b, n), t in zip(reqs[i], found, num_tokens, strict=True)],
            )
            agree(f"prefill of r{i}", [block_ids(g) for g in got])
            if got[0] is None:
                if not running:
                    raise RuntimeError(f"request r{i} does not fit an idle pool of {workload.num_blocks} blocks")
                break
            for r in reqs[i]:
                r.num_computed_tokens = r.num_tokens
            waiting.popleft()
            running.append(i)
        if len(sides) > 1:
            agree("free queue", [side.free_queue() for side in sides])
        min_free = min(min_free, sides[0].num_free())
    return preemptions, min_free


# ---------------------------------------------------------------------- reporting
def time_side(cls: type, model: str, workload: Workload) -> tuple[dict[str, float], int]:
    """One timed run of one side. The heap is collected once its manager is built, just
    before the timed calls (untimed): the other side's last manager is garbage with
    reference cycles (vLLM's free queue is a doubly linked list of blocks), and the new
    manager's pool (vLLM's block objects, jaxkv's per-block lists) is young, so the run's
    first collections would charge one side for the other's garbage and for building its
    own manager (a serving loop builds it once, at startup). Collection stays on during
    the run, each side paying for its own."""
    side = cls(model, workload.num_blocks)
    gc.collect()
    times = [defaultdict(float)]
    preemptions, _ = run_loop([side], workload, times)
    return dict(times[0]), preemptions


def median_times(runs: list[dict[str, float]]) -> dict[str, float]:
    return {op: statistics.median(r.get(op, 0.0) for r in runs) for op in OPS}


def bench(model: str, name: str, peer: bool, check: bool) -> dict:
    workload = make_workload(name, model, FLAGS.seed, FLAGS.scale)
    result: dict = {"model": model, "workload": name, "num_requests": len(workload.prompts)}
    result["num_blocks"] = workload.num_blocks
    if check and model == "recurrent":
        result["decisions"] = "not compared (vLLM's align mode holds up to 2 state blocks a request, jaxkv 1)"
    elif check and model == "recurrent-shared":
        result["decisions"] = "not compared (jaxkv's shared pages against vLLM's layout)"
    elif check:
        try:
            run_loop([JaxkvSide(model, workload.num_blocks), VllmSide(model, workload.num_blocks)], workload, None)
            result["decisions"] = "identical"
        except DecisionMismatch as err:
            result["decisions"] = f"MISMATCH at {err}"
    runs: dict[str, list] = {"jaxkv": [], "vllm": []}
    for pair in range(FLAGS.pairs):
        order = [JaxkvSide, VllmSide] if pair % 2 == 0 else [VllmSide, JaxkvSide]
        for cls in order:
            if cls is VllmSide and not peer:
                continue
            times, preemptions = time_side(cls, model, workload)
            runs[cls.name].append(times)
            result[f"{cls.name}_preemptions"] = preemptions
    for side, side_runs in runs.items():
        if side_runs:
            result[side] = median_times(side_runs)
            result[f"{side}_total"] = statistics.median(sum(r.values()) for r in side_runs)
    if runs["vllm"]:
        pair_ratios = [sum(a.values()) / sum(b.values()) for a, b in zip(runs["jaxkv"], runs["vllm"], strict=True)]
        result["total_ratio_range"] = (min(pair_ratios), max(pair_ratios))
        result["total_ratio_median"] = statistics.median(pair_ratios)
    return result


def print_table(results: list[dict]) -> None:
    print(
        f"KV cache manager host time, ms per workload (median of {FLAGS.pairs} alternating runs; "
        f"jaxkv hash={FLAGS.hash_algo}, vLLM sha256)"
    )
    print(f"{'model':12s} {'workload':11s} {'op':14s} {'jaxkv ms':>10s} {'vLLM ms':>10s} {'ratio':>6s}")
    for r in results:
        for op in (*OPS, "total"):
            ours = r["jaxkv_total"] if op == "total" else r["jaxkv"][op]
            peer = (r["vllm_total"] if op == "total" else r["vllm"][op]) if "vllm" in r else None
            ratio = f"{ours / peer:6.2f}" if peer else "   n/a"
            peer_s = f"{peer * 1e3:10.2f}" if peer is not None else f"{'n/a':>10s}"
            print(f"{r['model']:12s} {r['workload']:11s} {op:14s} {ours * 1e3:10.2f} {peer_s} {ratio}")
        extra = f"preemptions jaxkv {r.get('jaxkv_preemptions')} / vLLM {r.get('vllm_preemptions', 'n/a')}"
        if "total_ratio_range" in r:
            low, high = r["total_ratio_range"]
            extra += f", total ratio: median of pairs {r['total_ratio_median']:.2f} (pairs {low:.2f}-{high:.2f})"
        print(f"{r['model']:12s} {r['workload']:11s} {extra}; decisions: {r.get('decisions', 'not checked')}")


def main(argv: Sequence[str]) -> None:
    del argv
    peer = FLAGS.peer and vllm_available()
    check = peer if FLAGS.check_decisions is None else FLAGS.check_decisions and vllm_available()
    if not peer:
        print("vLLM is not importable: jaxkv columns only (see BUILD.md to install the peer)")
    results = [bench(model, name, peer, check) for model in FLAGS.models for name in FLAGS.workloads]
    print_table(results)
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"hash_algo": FLAGS.hash_algo, "pairs": FLAGS.pairs, "results": results}, f, indent=2)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
