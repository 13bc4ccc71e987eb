"""Host time of the KV cache manager per call and per scheduler step.

Workload (the issue's): 64 requests, 4 shared 2048-token system prompts plus unique
256-1024-token suffixes, 128 decode steps each, at most 32 running. Run for one
full-attention group and for a Gemma-3-like hybrid (5 sliding-window groups + 1 full).

Block hashing is timed on its own column: like vLLM's Request, the engine hashes a
request when it arrives and after each appended token (``manager.hash_request``), so
lookups and allocations are compared on the same footing. Each of our times is also
reported as a ratio to vLLM v1's manager on the same workload, measured by the project
on these 2-core machines (reference numbers, not this run).

    python scripts/bench_manager.py --out bench_manager.json
"""

from __future__ import annotations

import gc
import json
import time
from collections import defaultdict

import numpy as np
from absl import app, flags

from jaxkv.manager import KVCacheManager, Request
from jaxkv.planner import KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec, SlidingWindowSpec

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_requests", 64, "requests in the workload")
flags.DEFINE_integer("num_system_prompts", 4, "distinct shared system prompts")
flags.DEFINE_integer("system_prompt_len", 2048, "tokens per system prompt")
flags.DEFINE_integer("min_suffix", 256, "shortest unique suffix")
flags.DEFINE_integer("max_suffix", 1024, "longest unique suffix")
flags.DEFINE_integer("decode_steps", 128, "tokens generated per request")
flags.DEFINE_integer("max_running", 32, "at most this many requests run at once")
flags.DEFINE_integer("block_size", 16, "tokens per block")
flags.DEFINE_integer("sliding_window", 1024, "window of the hybrid's sliding groups")
flags.DEFINE_enum("hash_algo", "sha256", ["sha256", "xxh3_128"], "prefix hash algorithm")
flags.DEFINE_integer("repeats", 3, "runs per model; the fastest is reported")
flags.DEFINE_integer("seed", 0, "workload seed")
flags.DEFINE_string("out", None, "write the results as JSON here")

# vLLM v1's manager on this workload, measured by the project on these machines (µs).
VLLM_US = {
    "full": {"lookup": 81.7, "alloc_prefill": 77.5, "alloc_decode": 4.7, "free": 35.1},
    "gemma3-like": {"lookup": 229.5, "alloc_prefill": 426.8, "alloc_decode": 18.5, "free": 96.4},
}
OPS = ("lookup", "alloc_prefill", "alloc_decode", "free", "hash", "step")


def make_config(model: str, num_blocks: int) -> KVCacheConfig:
    spec = FullAttentionSpec(num_kv_heads=8, head_size=128)
    if model == "full":
        specs = [spec]
    else:
        window = SlidingWindowSpec(num_kv_heads=8, head_size=128, sliding_window=FLAGS.sliding_window)
        specs = [window] * 5 + [spec]
    groups = tuple(KVCacheGroup((f"layer{i}",), s, FLAGS.block_size) for i, s in enumerate(specs))
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def make_prompts(rng: np.random.Generator) -> list[list[int]]:
    systems = [rng.integers(0, 50_000, FLAGS.system_prompt_len).tolist() for _ in range(FLAGS.num_system_prompts)]
    return [
        systems[i % len(systems)]
        + rng.integers(0, 50_000, int(rng.integers(FLAGS.min_suffix, FLAGS.max_suffix + 1))).tolist()
        for i in range(FLAGS.num_requests)
    ]


def run_once(model: str, prompts: list[list[int]], decode_tokens: np.ndarray) -> dict[str, list[float]]:
    """Serve the workload once; return the per-call times (µs) of every operation."""
    longest = max(map(len, prompts)) + FLAGS.decode_steps
    per_request = -(-longest // FLAGS.block_size) + 1
    groups = 1 if model == "full" else 6
    num_blocks = FLAGS.max_running * per_request * groups + 4096
    mgr = KVCacheManager(
        make_config(model, num_blocks), max_model_len=longest + 16, hash_algo=FLAGS.hash_algo
    )
    times: dict[str, list[float]] = defaultdict(list)
    clock = time.perf_counter
    waiting = [Request(f"r{i}", p) for i, p in enumerate(prompts)]
    running: list[Request] = []
    generated: dict[str, int] = {}
    gc.disable()
    try:
        while waiting or running:
            t_step = clock()
            for req in list(running):
                if generated[req.request_id] == FLAGS.decode_steps:
                    t = clock()
                    mgr.free(req)
                    times["free"].append(clock() - t)
                    running.remove(req)
                    continue
                req.append_output_token_ids(int(decode_tokens[generated[req.request_id]]))
                generated[req.request_id] += 1
                t = clock()
                mgr.hash_request(req)
                t1 = clock()
                blocks = mgr.allocate_slots(req, 1)
                t2 = clock()
                times["hash"].append(t1 - t)
                times["alloc_decode"].append(t2 - t1)
                if blocks is None:
                    raise RuntimeError("the benchmark's pool is sized to never preempt")
                req.num_computed_tokens += 1
            while waiting and len(running) < FLAGS.max_running:
                req = waiting[0]
                t = clock()
                mgr.hash_request(req)
                t1 = clock()
                hit, n = mgr.get_computed_blocks(req)
                t2 = clock()
                blocks = mgr.allocate_slots(req, req.num_tokens - n, n, hit)
                t3 = clock()
                if blocks is None:
                    break
                times["hash"].append(t1 - t)
                times["lookup"].append(t2 - t1)
                times["alloc_prefill"].append(t3 - t2)
                req.num_computed_tokens = req.num_tokens
                waiting.pop(0)
                running.append(req)
                generated[req.request_id] = 0
            times["step"].append(clock() - t_step)
    finally:
        gc.enable()
    assert mgr.num_free_blocks == num_blocks - 1
    stats = mgr.prefix_cache_stats()
    times["hit_rate"] = [stats.hit_rate]
    return {k: [x * 1e6 for x in v] if k != "hit_rate" else v for k, v in times.items()}


def main(argv: list[str]) -> None:
    del argv
    rng = np.random.default_rng(FLAGS.seed)
    prompts = make_prompts(rng)
    decode_tokens = rng.integers(0, 50_000, FLAGS.decode_steps)
    results = {}
    for model in ("full", "gemma3-like"):
        runs = [run_once(model, prompts, decode_tokens) for _ in range(FLAGS.repeats)]
        best = {op: min(float(np.mean(r[op])) for r in runs) for op in OPS}
        calls = {op: len(runs[0][op]) for op in OPS}
        ref = VLLM_US[model]
        total_ref = sum(calls[op] * ref[op] for op in ref)
        total = sum(calls[op] * best[op] for op in ref)
        results[model] = {
            "mean_us": best,
            "calls": calls,
            "hit_rate": runs[0]["hit_rate"][0],
            "vllm_us": ref,
            "ratio_to_vllm": {op: best[op] / ref[op] for op in ref},
            "workload_ratio_to_vllm": total / total_ref,
            "workload_ratio_to_vllm_with_hashing": (total + calls["hash"] * best["hash"]) / total_ref,
        }
    print(
        f"KV cache manager host time, µs per call (best of {FLAGS.repeats} runs; hash={FLAGS.hash_algo}; "
        "ratio = ours / vLLM v1 reference; target <= 0.33)"
    )
    print(f"{'model':<12} {'op':<14} {'calls':>6} {'jaxkv µs':>9} {'vLLM µs':>8} {'ratio':>6}")
    for model, r in results.items():
        for op in OPS:
            ref = VLLM_US[model].get(op)
            ratio = f"{r['ratio_to_vllm'][op]:.2f}" if ref else "-"
            ref_s = f"{ref:.1f}" if ref else "-"
            print(f"{model:<12} {op:<14} {r['calls'][op]:>6} {r['mean_us'][op]:>9.2f} {ref_s:>8} {ratio:>6}")
        print(
            f"{model:<12} prefix hit rate {r['hit_rate']:.3f}; whole workload (calls x µs) vs vLLM "
            f"{r['workload_ratio_to_vllm']:.2f}, with our hashing {r['workload_ratio_to_vllm_with_hashing']:.2f}"
        )
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"workload": {k: FLAGS[k].value for k in (
                "num_requests", "num_system_prompts", "system_prompt_len", "min_suffix", "max_suffix",
                "decode_steps", "max_running", "block_size", "sliding_window", "hash_algo")},
                "results": results}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
