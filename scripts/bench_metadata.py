"""Host time of a serving step's metadata, and of the whole step call, against another jaxkv tree.

A step's metadata (:meth:`jaxkv.serving.runner.ModelRunner.metadata`: block tables, slot
mappings, lengths, packed and sent in one transfer) is built for ``--seqs`` running decode
sequences of ``--context`` tokens each, on ``--model`` (default tiny-hybrid: 5 sliding-window
groups of window 32 and 1 full-attention group, blocks of 16). The scheduler is the real one
(:class:`~jaxkv.serving.scheduler.Scheduler` over a :class:`~jaxkv.core.manager.KVCacheManager`);
the model is stubbed for the metadata figure (every sampled token is 1, no forward pass), so
only ``runner.metadata(chunks)`` plus waiting for its transfer is timed, ``--steps`` decode
steps in a row. ``call`` times the runner's whole step (``execute_sampled``: metadata, sampling
inputs, the jitted tiny forward and the read-back) at ``--call_seqs`` sequences of
``--call_context`` tokens, where the forward pass is small: its difference between the trees is
the per-call cost the trees differ in (the forward is the same).

Each tree runs in a subprocess of its own (``PYTHONPATH`` = the tree), ``new`` (this one) and
``base`` (``--base``, default ``/work/main``) alternating ``--rounds`` times; every figure is the
median over its rounds of per-step medians, and ratios are base / new of those.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]


def _decoding(model_name: str, num_seqs: int, context: int, steps: int):
    """A runner and a scheduler whose ``num_seqs`` requests all decode, ``context`` tokens in."""
    import numpy as np

    from jaxkv.core.manager import KVCacheManager, Request
    from jaxkv.models.tiny import TinyLM, get_model_config
    from jaxkv.planner import PlanOptions, plan_kv_cache
    from jaxkv.serving.runner import ModelRunner, default_buckets
    from jaxkv.serving.scheduler import Scheduler

    config = get_model_config(model_name)
    budget = 2048
    max_len = context + steps + 64
    specs = config.layer_specs()
    per_token = 6 * 2 * 2 * 64 * 4  # layers * (k, v) * kv heads * head dim * float32: ample
    memory = int(num_seqs * max_len * per_token * 1.5) + (16 << 20)
    plan = plan_kv_cache(specs, memory, max_model_len=max_len, options=PlanOptions(max_num_batched_tokens=budget))
    scheduler = Scheduler(KVCacheManager(plan), max_num_seqs=num_seqs, max_num_batched_tokens=budget)
    runner = ModelRunner(TinyLM(config, seed=0), plan, default_buckets(plan, num_seqs, budget))
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        scheduler.add_request(Request(f"r{i}", rng.integers(1, 500, context).tolist()), steps + 32)
    while True:
        out = scheduler.schedule()
        if all(c.num_new_tokens == 1 for c in out.chunks) and len(out.chunks) == num_seqs:
            return runner, scheduler, out
        scheduler.update(out, [1] * len(out.chunks))


def _worker(args: argparse.Namespace) -> dict:
    """This process's figures (run with the tree under test first on ``sys.path``)."""
    import jax

    import jaxkv

    result: dict = {"jaxkv": str(Path(jaxkv.__file__).parent.parent), "metadata": {}, "call": {}}
    for n in args.seqs:
        runner, scheduler, out = _decoding(args.model, n, args.context, args.steps + 5)
        wall, cpu = [], []
        for step in range(args.steps + 5):
            start, start_cpu = time.perf_counter(), time.thread_time()
            meta = runner.metadata(out.chunks)
            jax.block_until_ready(meta.packed)
            if step >= 5:  # the first steps write every row afresh
                wall.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
            scheduler.update(out, [1] * len(out.chunks))
            out = scheduler.schedule()
        result["metadata"][n] = {"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * statistics.median(cpu)}
    if not args.call_seqs:
        return result
    runner, scheduler, out = _decoding(args.model, args.call_seqs, args.call_context, args.steps + 5)
    from jaxkv.serving.sampler import RowSampling
    from jaxkv.serving.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    wall = []
    for step in range(args.steps + 5):
        rows = [RowSampling(greedy, 0, c.num_computed_tokens + 1) for c in out.chunks]
        start = time.perf_counter()
        sampled, _ = runner.execute_sampled(out.chunks, rows)
        tokens = sampled.token_ids.tolist()
        if step >= 5:
            wall.append(time.perf_counter() - start)
        scheduler.update(out, tokens)
        out = scheduler.schedule()
    result["call"] = {"seqs": args.call_seqs, "context": args.call_context, "wall_ms": 1e3 * statistics.median(wall)}
    return result


def _run_tree(tree: Path, argv: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--worker", *argv],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(f"worker in {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-hybrid")
    parser.add_argument("--seqs", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--call_seqs", type=int, default=8, help="0: no whole-call figure")
    parser.add_argument("--call_context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base", type=Path, default=Path("/work/main"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args)))
        return
    argv = [a for a in sys.argv[1:] if not a.startswith("--out") and a != str(args.out)]
    runs: dict[str, list[dict]] = {"base": [], "new": []}
    for _ in range(args.rounds):
        runs["base"].append(_run_tree(args.base, argv))
        runs["new"].append(_run_tree(_ROOT, argv))

    def med(side: str, *keys: str) -> float:
        values = []
        for run in runs[side]:
            value = run
            for key in keys:
                value = value[key]
            values.append(value)
        return statistics.median(values)

    rows = []
    print(f"{args.model}, {args.context}-token decodes, medians of {args.rounds} rounds x {args.steps} steps")
    print(f"{'seqs':>5} {'base wall ms':>13} {'new wall ms':>12} {'ratio':>6} {'base cpu ms':>12} {'new cpu ms':>11}")
    for n in args.seqs:
        key = str(n)
        row = {
            "seqs": n,
            **{f"{side}_{kind}": med(side, "metadata", key, kind) for side in runs for kind in ("wall_ms", "cpu_ms")},
        }
        row["ratio"] = row["base_wall_ms"] / row["new_wall_ms"]
        rows.append(row)
        print(
            f"{n:>5} {row['base_wall_ms']:>13.3f} {row['new_wall_ms']:>12.3f} {row['ratio']:>5.1f}x "
            f"{row['base_cpu_ms']:>12.3f} {row['new_cpu_ms']:>11.3f}"
        )
    call = {side: med(side, "call", "wall_ms") for side in runs} if args.call_seqs else {}
    if call:
        print(
            f"whole step call ({args.call_seqs} seqs, {args.call_context} tokens): base {call['base']:.3f} ms, "
            f"new {call['new']:.3f} ms, saved {call['base'] - call['new']:.3f} ms"
        )
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "args": vars(args) | {"base": str(args.base), "out": str(args.out)},
                    "metadata": rows,
                    "call_ms": call,
                    "runs": runs,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
