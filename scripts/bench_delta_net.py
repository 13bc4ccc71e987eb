"""Benchmark one Gated DeltaNet layer's serving step in its two forms, on this backend.

Per case (packed prefill tokens T split evenly over B sequences, padded to --max_seqs
state rows) two columns of ``ragged_delta_net`` timed in the same run (best of
--repeats, after a warm-up call that compiles) (float32, HIGHEST-precision matmuls in
both):

  scan        the baseline: ``form="scan"``, one dependent step per packed token (T);
  chunked     ``form="chunked"`` at --chunk_size: the state-free work in parallel, then
              one dependent step per (grid chunk, sequence) piece.

The table gives each column's sequential step count, its time, the speed-up (scan time
/ chunked time, > 1: chunked is faster) and the max |difference| of the outputs. The
form a backend runs by default (``delta_net.default_form``) should be the faster here.
Head sizes default to the tiny-qwen3-next model's.

  PYTHONPATH=. python scripts/bench_delta_net.py --out /tmp/bench_delta_net.json
"""

from __future__ import annotations

import functools
import json
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxkv.benchmarks.timing import best_seconds
from jaxkv.commands.cli import flags_parser
from jaxkv.models.delta_net import default_form, ragged_delta_net, seq_of_token

PROG = "bench_delta_net.py"
FLAGS = flags.FLAGS
flags.DEFINE_list("tokens", ["1024", "8192"], "packed prefill tokens per step")
flags.DEFINE_list("seqs", ["1", "4"], "sequences sharing the tokens evenly")
flags.DEFINE_integer("max_seqs", 8, "state rows of the step (sequences past --seqs are idle)", lower_bound=1)
flags.DEFINE_integer("chunk_size", 64, "tokens per chunk of the chunked form", lower_bound=1)
flags.DEFINE_integer("heads", 4, "delta heads")
flags.DEFINE_integer("key_dim", 32, "key dimension per head")
flags.DEFINE_integer("value_dim", 32, "value dimension per head")
flags.DEFINE_integer("kernel", 4, "causal convolution width", lower_bound=2)
flags.DEFINE_integer("repeats", 3, "timed calls per column (the best is kept)", lower_bound=1)
flags.DEFINE_string("out", None, "write the results as JSON here")


def inputs(tokens: int, seqs: int) -> dict:
    """Random pre-conv projections, log decays and betas of ``seqs`` equal sequences."""
    rng = np.random.default_rng(tokens + seqs)
    channels = FLAGS.heads * (2 * FLAGS.key_dim + FLAGS.value_dim)
    return {
        "mixed": jnp.asarray(rng.standard_normal((seqs, tokens // seqs, channels)), jnp.float32),
        "decay": -jnp.asarray(rng.uniform(0.01, 1.0, (seqs, tokens // seqs, FLAGS.heads)), jnp.float32),
        "beta": jnp.asarray(rng.uniform(0.0, 1.0, (seqs, tokens // seqs, FLAGS.heads)), jnp.float32),
        "weight": jnp.asarray(rng.standard_normal((FLAGS.kernel, channels)) * 0.5, jnp.float32),
    }


def pieces(tokens: int, seqs: int, chunk: int) -> int:
    """Grid chunks touched by each of ``seqs`` equal sequences packed in ``tokens``."""
    length = tokens // seqs
    return sum((start + length - 1) // chunk - start // chunk + 1 for start in range(0, tokens, length))


def case(tokens: int, seqs: int) -> dict:
    """Time both columns on one case; outputs compared token for token."""
    x = inputs(tokens, seqs)
    heads, key_dim = FLAGS.heads, FLAGS.key_dim
    step = functools.partial(ragged_delta_net, num_heads=heads, key_dim=key_dim, chunk_size=FLAGS.chunk_size)
    scan, chunked = (jax.jit(functools.partial(step, form=form)) for form in ("scan", "chunked"))
    rows = FLAGS.max_seqs
    cu = jnp.minimum(jnp.arange(rows + 1) * (tokens // seqs), tokens).astype(jnp.int32)
    owner = seq_of_token(cu, jnp.array([seqs]), tokens)
    conv = jnp.zeros((rows, FLAGS.kernel - 1, x["mixed"].shape[-1]))
    state = jnp.zeros((rows, heads, key_dim, FLAGS.value_dim))
    flat = {k: x[k].reshape(tokens, -1) for k in ("mixed", "decay", "beta")}

    def run_scan():
        return scan(flat["mixed"], flat["decay"], flat["beta"], x["weight"], owner, conv, state)[0]

    def run_chunked():
        return chunked(flat["mixed"], flat["decay"], flat["beta"], x["weight"], owner, conv, state)[0]

    error = float(jnp.max(jnp.abs(run_chunked() - run_scan())))
    base, fast = best_seconds(run_scan, FLAGS.repeats), best_seconds(run_chunked, FLAGS.repeats)
    return {
        "tokens": tokens,
        "seqs": seqs,
        "scan_steps": tokens,
        "chunked_steps": pieces(tokens, seqs, FLAGS.chunk_size),
        "scan_s": base,
        "chunked_s": fast,
        "speedup": base / fast,
        "max_abs_diff": error,
    }


def main(argv: list[str]) -> None:
    del argv
    rows = [case(int(t), int(s)) for t in FLAGS.tokens for s in FLAGS.seqs]
    print(
        f"Gated DeltaNet step on {jax.default_backend()}: {FLAGS.heads} heads, dk={FLAGS.key_dim}, "
        f"dv={FLAGS.value_dim}, chunk {FLAGS.chunk_size}, {FLAGS.max_seqs} state rows; "
        f"default form here: {default_form()}"
    )
    print("| T | seqs | scan steps | chunked steps | scan (ms) | chunked (ms) | speed-up | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['tokens']:,} | {r['seqs']} | {r['scan_steps']:,} | {r['chunked_steps']:,} | "
            f"{r['scan_s'] * 1e3:,.1f} | {r['chunked_s'] * 1e3:,.1f} | {r['speedup']:.2f}x | "
            f"{r['max_abs_diff']:.1e} |"
        )
    if FLAGS.out:
        meta = {
            "backend": jax.default_backend(),
            "default_form": default_form(),
            "jax": jax.__version__,
            "python": platform.python_version(),
        }
        flags_used = {name: FLAGS[name].value for name in ("chunk_size", "heads", "key_dim", "value_dim", "max_seqs")}
        with open(FLAGS.out, "w") as f:
            json.dump({"meta": meta, "flags": flags_used, "cases": rows}, f, indent=2)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    sys.exit(app.run(main, flags_parser=flags_parser(PROG)))
