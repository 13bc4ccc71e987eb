"""Host time of a serving step's metadata, and of the whole step call, against another jaxkv tree.

A step's metadata (:meth:`jaxkv.serving.runner.ModelRunner.metadata`: block tables, slot
mappings, lengths, packed and sent in one transfer) is built for ``--seqs`` running decode
sequences of ``--context`` tokens each, on ``--model`` (default tiny-hybrid: 5 sliding-window
groups of window 32 and 1 full-attention group, blocks of 16). The scheduler is the real one
(:class:`~jaxkv.serving.scheduler.Scheduler` over a :class:`~jaxkv.core.manager.KVCacheManager`);
the model is stubbed for the metadata figure (every sampled token is 1, no forward pass), so
only ``runner.metadata(chunks)`` plus waiting for its transfer is timed (a tree whose metadata
stays on the host for the step's call to send has none to wait for: the ``call`` figure has it), ``--steps`` decode
steps in a row. ``call`` times the runner's whole step (``execute_sampled``: metadata, sampling
inputs, the jitted tiny forward and the read-back) at ``--call_seqs`` sequences of
``--call_context`` tokens, where the forward pass is small: its difference between the trees is
the per-call cost the trees differ in (the forward is the same).

Each tree runs in a subprocess of its own (``PYTHONPATH`` = the tree), ``new`` (this one) and
``base`` (``--base``, another checkout; without it only this tree runs) alternating ``--rounds``
times; every figure is the median over its rounds of per-step medians, and ratios are base / new
of those.

    PYTHONPATH=. python3 scripts/bench_metadata.py --base ../jaxkv-main --out bench_metadata.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

from jaxkv.commands.cli import exit_error, flags_parser, write_json

PROG = "bench_metadata.py"
_ROOT = Path(__file__).resolve().parents[1]

flags.DEFINE_string("model", "tiny-hybrid", "the tiny model whose step metadata is built")
flags.DEFINE_list("seqs", ["8", "32", "64", "128"], "running decode sequences, one figure each")
flags.DEFINE_integer("context", 1024, "tokens of each decoding sequence", lower_bound=1)
flags.DEFINE_integer("steps", 30, "timed steps per figure", lower_bound=1)
flags.DEFINE_integer("call_seqs", 8, "sequences of the whole-call figure (0: none)", lower_bound=0)
flags.DEFINE_integer("call_context", 64, "tokens of each sequence of the whole-call figure", lower_bound=1)
flags.DEFINE_integer("rounds", 3, "rounds of each tree, alternating", lower_bound=1)
flags.DEFINE_string("base", None, "another jaxkv checkout to time beside this one")
flags.DEFINE_string("out", None, "write the figures as JSON here")
flags.DEFINE_boolean("worker", False, "(internal) time this process's tree and print JSON")
FLAGS = flags.FLAGS


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


def _worker(seqs: list[int]) -> dict:
    """This process's figures (run with the tree under test first on ``sys.path``)."""
    import jax

    import jaxkv

    result: dict = {"jaxkv": str(Path(jaxkv.__file__).parent.parent), "metadata": {}, "call": {}}
    for n in seqs:
        runner, scheduler, out = _decoding(FLAGS.model, n, FLAGS.context, FLAGS.steps + 5)
        wall, cpu = [], []
        for step in range(FLAGS.steps + 5):
            start, start_cpu = time.perf_counter(), time.thread_time()
            meta = runner.metadata(out.chunks)
            jax.block_until_ready(meta.packed)
            if step >= 5:  # the first steps write every row afresh
                wall.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
            scheduler.update(out, [1] * len(out.chunks))
            out = scheduler.schedule()
        result["metadata"][n] = {"wall_ms": 1e3 * statistics.median(wall), "cpu_ms": 1e3 * statistics.median(cpu)}
    if not FLAGS.call_seqs:
        return result
    runner, scheduler, out = _decoding(FLAGS.model, FLAGS.call_seqs, FLAGS.call_context, FLAGS.steps + 5)
    from jaxkv.serving.sampler import RowSampling
    from jaxkv.serving.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    wall = []
    for step in range(FLAGS.steps + 5):
        rows = [RowSampling(greedy, 0, c.num_computed_tokens + 1) for c in out.chunks]
        start = time.perf_counter()
        sampled, _ = runner.execute_sampled(out.chunks, rows)
        tokens = sampled.token_ids.tolist()
        if step >= 5:
            wall.append(time.perf_counter() - start)
        scheduler.update(out, tokens)
        out = scheduler.schedule()
    result["call"] = {"seqs": FLAGS.call_seqs, "context": FLAGS.call_context, "wall_ms": 1e3 * statistics.median(wall)}
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
        exit_error(PROG, f"the worker in {tree} failed: {proc.stderr.strip().splitlines()[-1:]}", status=1)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    del argv
    try:
        seqs = [int(n) for n in FLAGS.seqs]
    except ValueError:
        exit_error(PROG, f"--seqs must be ints, got {','.join(FLAGS.seqs)}")
    if FLAGS.worker:
        print(json.dumps(_worker(seqs)))
        return
    names = ("model", "seqs", "context", "steps", "call_seqs", "call_context")
    argv = [f"--{name}={FLAGS[name].serialize().split('=', 1)[1]}" for name in names]
    trees = {"new": _ROOT} if FLAGS.base is None else {"base": Path(FLAGS.base), "new": _ROOT}
    runs: dict[str, list[dict]] = {side: [] for side in trees}
    for _ in range(FLAGS.rounds):
        for side, tree in trees.items():
            runs[side].append(_run_tree(tree, argv))

    def med(side: str, *keys: str) -> float:
        values = []
        for run in runs[side]:
            value = run
            for key in keys:
                value = value[key]
            values.append(value)
        return statistics.median(values)

    rows = []
    print(f"{FLAGS.model}, {FLAGS.context}-token decodes, medians of {FLAGS.rounds} rounds x {FLAGS.steps} steps")
    print(f"{'seqs':>5} " + " ".join(f"{side + ' wall ms':>13} {side + ' cpu ms':>12}" for side in runs) + "  ratio")
    for n in seqs:
        key = str(n)
        row: dict = {"seqs": n}
        for side in runs:
            for kind in ("wall_ms", "cpu_ms"):
                row[f"{side}_{kind}"] = med(side, "metadata", key, kind)
        ratio = row["base_wall_ms"] / row["new_wall_ms"] if "base" in runs else None
        row["ratio"] = ratio
        rows.append(row)
        cells = " ".join(f"{row[side + '_wall_ms']:>13.3f} {row[side + '_cpu_ms']:>12.3f}" for side in runs)
        print(f"{n:>5} {cells}  " + (f"{ratio:.1f}x" if ratio is not None else "n/a"))
    call = {side: med(side, "call", "wall_ms") for side in runs} if FLAGS.call_seqs else {}
    if call:
        sides = ", ".join(f"{side} {ms:.3f} ms" for side, ms in call.items())
        print(f"whole step call ({FLAGS.call_seqs} seqs, {FLAGS.call_context} tokens): {sides}")
    if FLAGS.out:
        settings = {name: FLAGS[name].value for name in ("model", "context", "steps", "call_seqs", "rounds", "base")}
        write_json(PROG, FLAGS.out, {"settings": settings, "metadata": rows, "call_ms": call, "runs": runs})


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
