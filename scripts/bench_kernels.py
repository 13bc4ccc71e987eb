"""Benchmark jaxkv's kernels and GPU path against the jnp reference and JAX's bundled kernel.

Per case (decode / windowed decode / prefill / mixed paged attention, write_kv,
copy_blocks) up to four columns, timed in the same run (best of --repeats, after a
warm-up call that compiles):

  kernel      jaxkv.pallas.tpu; on CPU it runs in the TPU *interpreter*, so the time
              only shows that it runs (interpretation overhead, not performance);
  reference   jaxkv.pallas.reference (plain jnp, XLA on whatever backend this is);
  jax_rpa     jax.experimental.pallas.ops.tpu.ragged_paged_attention (TPU only);
  xla_gpu     jaxkv.pallas.xla, the GPU default (plain XLA, runs anywhere): paged
              attention; write_kv and copy_blocks as scatters declared in bounds with
              unique indices (the reference's scatters without those promises).

On a GPU or TPU, each compiled column also reports achieved bandwidth as a fraction of
the device-to-device copy bandwidth measured in the same run (a jitted ``x + 1`` over
--copy_mib MiB: read + write). Bytes per case are the minimum the op must move: the
pages its queries can see (whole pages) plus q and the output for attention; the new
tokens read and written for write_kv; each block read and written for copy_blocks.
Every attention row also gives the largest max |error| of the other columns against
the reference.

  PYTHONPATH=. python scripts/bench_kernels.py --out /tmp/bench_kernels.json
"""

from __future__ import annotations

import functools
import json
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
from timing import best_seconds

from jaxkv.pallas import reference as ref
from jaxkv.pallas import tpu as kernels
from jaxkv.pallas import xla as xla_ops

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "Write results as JSON to this path.")
flags.DEFINE_enum("preset", "auto", ["auto", "cpu", "accelerator"], "Case sizes; auto picks by backend.")
flags.DEFINE_enum(
    "dtype",
    "auto",
    ["auto", "float32", "bfloat16"],
    "Cache/query dtype (auto: f32 on CPU, bf16 else).",
)
flags.DEFINE_integer("repeats", 3, "Timed repeats per column (best is reported); the interpreter gets at most 2.")
flags.DEFINE_integer("copy_mib", 1024, "Size of the device-to-device copy that measures peak bandwidth.")
flags.DEFINE_float("reference_gib", 16.0, "Skip the reference where its token-major gather would exceed this.")
flags.DEFINE_integer("seed", 0, "Seed of the random inputs.")

COLUMNS = ("kernel", "reference", "jax_rpa", "xla_gpu")
KERNEL_NA = "n/a: Mosaic TPU kernel (on GPU see the xla_gpu column)"
Interpret = pltpu.InterpretParams | bool | None  # None: the kernel cannot run here


@dataclass
class Case:
    """One benchmark row: callables per column (None: does not run here) and bytes moved."""

    op: str
    name: str
    shape: str
    bytes_moved: int
    impls: dict[str, Callable[[], jax.Array] | None]
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Attn:
    """A paged-attention workload: (q_len, kv_len) per sequence and the model dims."""

    name: str
    seqs: tuple[tuple[int, int], ...]
    block_size: int
    num_kv_heads: int
    num_queries_per_kv: int  # query heads per KV head (GQA)
    head_dim: int
    window: int | None = None
    soft_cap: float | None = None
    num_layers_per_block: int | None = None  # cross-layer layout with this many layers


PRESETS: dict[str, dict] = {
    "cpu": {
        "attention": [
            Attn("decode", ((1, 60), (1, 33), (1, 64), (1, 17)), 16, 2, 2, 64),
            Attn(
                "decode+window",
                ((1, 60), (1, 33), (1, 64), (1, 17)),
                16,
                2,
                2,
                64,
                window=24,
                soft_cap=30.0,
                num_layers_per_block=4,
            ),
            Attn("prefill", ((48, 64),), 16, 2, 2, 64),
            Attn("mixed", ((1, 40), (1, 25), (1, 50), (32, 48)), 16, 2, 2, 64),
        ],
        "write_kv": {
            "decode": 4,
            "prefill": 64,
            "num_blocks": 32,
            "block_size": 16,
            "num_kv_heads": 2,
            "head_dim": 64,
        },
        "copy_blocks": {
            "pairs": 8,
            "num_blocks": 32,
            "num_layers_per_block": 4,
            "block_size": 16,
            "num_kv_heads": 2,
            "head_dim": 64,
        },
    },
    "accelerator": {
        "attention": [
            Attn("decode", ((1, 4096),) * 32, 16, 8, 4, 128),
            Attn("decode-long", ((1, 32768),) * 8, 16, 8, 4, 128),
            Attn("decode+window", ((1, 8192),) * 32, 16, 8, 4, 128, window=1024, soft_cap=50.0),
            Attn("decode-xlayer", ((1, 4096),) * 32, 16, 8, 4, 128, num_layers_per_block=6),
            Attn("prefill", ((256, 1024),) * 2, 16, 8, 4, 128),
            Attn("mixed", ((1, 2048),) * 24 + ((256, 1024),), 16, 8, 4, 128),
        ],
        "write_kv": {
            "decode": 256,
            "prefill": 4096,
            "num_blocks": 8192,
            "block_size": 16,
            "num_kv_heads": 8,
            "head_dim": 128,
        },
        "copy_blocks": {
            "pairs": 256,
            "num_blocks": 2048,
            "num_layers_per_block": 8,
            "block_size": 16,
            "num_kv_heads": 8,
            "head_dim": 128,
        },
    },
}


def attention_case(
    w: Attn,
    dtype: jnp.dtype,
    rng: np.random.Generator,
    interpret: Interpret,
    on_tpu: bool,
    ref_budget: float,
) -> Case:
    """Random cache, distinct random pages per sequence, decodes first."""
    bs, h, d = w.block_size, w.num_kv_heads, w.head_dim
    pages = [-(-kv // bs) for _, kv in w.seqs]
    width = max(pages)
    num_blocks = 1 + sum(pages)
    layer_shape = (num_blocks,) + ((w.num_layers_per_block,) if w.num_layers_per_block else ()) + (bs, 2 * h, d)
    kv = jnp.asarray(rng.standard_normal(layer_shape, np.float32), dtype)
    tables = np.zeros((len(w.seqs), width), np.int32)
    ids = iter(rng.permutation(np.arange(1, num_blocks)).astype(np.int32))
    for i, n in enumerate(pages):
        tables[i, :n] = [next(ids) for _ in range(n)]
    q_lens = [q for q, _ in w.seqs]
    num_tokens = sum(q_lens)
    q = jnp.asarray(rng.standard_normal((num_tokens, h * w.num_queries_per_kv, d), np.float32), dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    meta = (
        jnp.asarray([kv for _, kv in w.seqs], jnp.int32),
        jnp.asarray(tables),
        cu,
        jnp.asarray([len(w.seqs)], jnp.int32),
    )
    layer_index = 1 if w.num_layers_per_block else None
    kw = {"sm_scale": d**-0.5, "sliding_window": w.window, "soft_cap": w.soft_cap}
    args = (q, kv) + meta

    page_bytes = bs * 2 * h * d * jnp.dtype(dtype).itemsize
    needed = 0
    for q_len, kv_len in w.seqs:
        lo = max(kv_len - q_len - (w.window or kv_len) + 1, 0) // bs
        needed += -(-kv_len // bs) - lo
    bytes_moved = needed * page_bytes + 2 * q.size * q.dtype.itemsize

    impls: dict[str, Callable[[], jax.Array] | None] = {}
    notes: dict[str, str] = {}
    if interpret is None:
        impls["kernel"], notes["kernel"] = None, KERNEL_NA
    else:
        kernel = jax.jit(functools.partial(kernels.paged_attention, layer_index=layer_index, interpret=interpret, **kw))
        impls["kernel"] = lambda: kernel(*args)
    gather_bytes = (
        num_tokens * width * bs * (2 * h * d * (jnp.dtype(dtype).itemsize + 4) + h * w.num_queries_per_kv * 12)
    )
    if gather_bytes <= ref_budget:
        reference = jax.jit(functools.partial(ref.paged_attention, layer_index=layer_index, **kw))
        impls["reference"] = lambda: reference(*args)
    else:
        impls["reference"] = None
        notes["reference"] = "skipped: token-major gather too large"
    if on_tpu and layer_index is None:
        rpa = jax.jit(functools.partial(ragged_paged_attention, **kw))
        impls["jax_rpa"] = lambda: rpa(*args)
    else:
        impls["jax_rpa"] = None
        notes["jax_rpa"] = "n/a: TPU only" if not on_tpu else "n/a: per-layer layout only"
    xla = jax.jit(functools.partial(xla_ops.paged_attention, layer_index=layer_index, **kw))
    impls["xla_gpu"] = lambda: xla(*args)
    ctx = sorted({kv for _, kv in w.seqs})
    shape = (
        f"{len(w.seqs)} seqs, {num_tokens} tok, ctx {ctx[0]}..{ctx[-1]}, bs {bs}, "
        f"H {h}x{w.num_queries_per_kv}, D {d}"
        + (f", W {w.window}" if w.window else "")
        + (", cross-layer" if layer_index is not None else "")
    )
    return Case("paged_attention", w.name, shape, bytes_moved, impls, notes)


def donating(fn: Callable, state: list) -> Callable[[], jax.Array]:
    """Call ``fn`` on the current buffer(s), donated, and keep the result for the next call."""

    def step() -> jax.Array:
        state[0] = fn(state[0])
        return state[0]

    return step


def write_case(
    name: str,
    num_tokens: int,
    p: dict,
    dtype: jnp.dtype,
    rng: np.random.Generator,
    interpret: Interpret,
) -> Case:
    """Decode: one token per random block; prefill: whole consecutive blocks."""
    bs, h, d, n = p["block_size"], p["num_kv_heads"], p["head_dim"], p["num_blocks"]
    shape = (n, bs, 2 * h, d)
    if name == "decode":
        blocks = rng.choice(np.arange(1, n), num_tokens, replace=False)
        slots = blocks * bs + rng.integers(0, bs, num_tokens)
    else:
        start = int(rng.integers(1, n - num_tokens // bs))
        slots = start * bs + np.arange(num_tokens)
    slots = jnp.asarray(slots, jnp.int32)
    k, v = (jnp.asarray(rng.standard_normal((num_tokens, h, d), np.float32), dtype) for _ in range(2))
    impls: dict[str, Callable[[], jax.Array] | None] = {"kernel": None, "jax_rpa": None}
    notes = {"kernel": KERNEL_NA, "jax_rpa": "n/a"}
    fns = {"reference": ref.write_kv, "xla_gpu": xla_ops.write_kv}
    if interpret is not None:
        fns["kernel"] = functools.partial(kernels.write_kv, interpret=interpret)
    for col, fn in fns.items():
        jitted = jax.jit(lambda buf, fn=fn: fn(buf, k, v, slots), donate_argnums=0)
        impls[col] = donating(jitted, [jnp.asarray(rng.standard_normal(shape, np.float32), dtype)])
    bytes_moved = 2 * 2 * k.size * k.dtype.itemsize
    return Case("write_kv", name, f"{num_tokens} tok, bs {bs}, H {h}, D {d}", bytes_moved, impls, notes)


def copy_case(p: dict, dtype: jnp.dtype, rng: np.random.Generator, interpret: Interpret) -> Case:
    """Copy-on-write of ``pairs`` whole cross-layer blocks into fresh blocks."""
    n, s, bs, h, d, pairs = (
        p["num_blocks"],
        p["num_layers_per_block"],
        p["block_size"],
        p["num_kv_heads"],
        p["head_dim"],
        p["pairs"],
    )
    ids = rng.permutation(np.arange(1, n))[: 2 * pairs].astype(np.int32)
    src, dst = jnp.asarray(ids[:pairs]), jnp.asarray(ids[pairs:])
    shape = (n, s, bs, 2 * h, d)
    impls: dict[str, Callable[[], jax.Array] | None] = {"kernel": None, "jax_rpa": None}
    notes = {"kernel": KERNEL_NA, "jax_rpa": "n/a"}
    fns = {"reference": ref.copy_blocks, "xla_gpu": xla_ops.copy_blocks}
    if interpret is not None:
        fns["kernel"] = functools.partial(kernels.copy_blocks, interpret=interpret)
    for col, fn in fns.items():
        jitted = jax.jit(lambda bufs, fn=fn: fn(bufs, src, dst), donate_argnums=0)
        impls[col] = donating(jitted, [(jnp.asarray(rng.standard_normal(shape, np.float32), dtype),)])
    block_bytes = s * bs * 2 * h * d * jnp.dtype(dtype).itemsize
    shape_text = f"{pairs} blocks of {block_bytes // 1024} KiB, {s} layers each"
    return Case("copy_blocks", "cow", shape_text, 2 * pairs * block_bytes, impls, notes)


def copy_bandwidth(mib: int) -> float:
    """Device-to-device bytes/s of an elementwise copy (read + write) of ``mib`` MiB."""
    x = jnp.zeros((mib * 2**20 // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1)
    return 2 * x.nbytes / best_seconds(lambda: f(x), 5)


def max_error(a: jax.Array, b: jax.Array) -> float:
    """Max |a - b| in float32; NaN if ``a`` has a non-finite value."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b))) if np.isfinite(a).all() else float("nan")


def run(preset: str, dtype_name: str, repeats: int, copy_mib: int, reference_gib: float, seed: int) -> dict:
    backend = jax.default_backend()
    on_cpu, on_tpu = backend == "cpu", backend == "tpu"
    preset = preset if preset != "auto" else ("cpu" if on_cpu else "accelerator")
    dtype = jnp.dtype(dtype_name if dtype_name != "auto" else ("float32" if on_cpu else "bfloat16"))
    interpret: Interpret = False if on_tpu else (pltpu.InterpretParams() if on_cpu else None)
    rng = np.random.default_rng(seed)
    p = PRESETS[preset]
    cases = [attention_case(w, dtype, rng, interpret, on_tpu, reference_gib * 2**30) for w in p["attention"]]
    cases += [
        write_case(name, p["write_kv"][name], p["write_kv"], dtype, rng, interpret) for name in ("decode", "prefill")
    ]
    cases.append(copy_case(p["copy_blocks"], dtype, rng, interpret))
    peak = None if on_cpu else copy_bandwidth(copy_mib)
    interpreted = {"kernel"} if not on_tpu else set()

    rows = []
    for case in cases:
        row = {
            "op": case.op,
            "case": case.name,
            "shape": case.shape,
            "bytes": case.bytes_moved,
            "notes": case.notes,
        }
        outputs = {}
        for col in COLUMNS:
            fn = case.impls.get(col)
            if fn is None:
                row[f"{col}_s"] = None
                continue
            interp = col in interpreted
            row[f"{col}_s"] = best_seconds(fn, min(repeats, 2) if interp else repeats)
            outputs[col] = fn()
            measured = peak is not None and not interp
            fraction = case.bytes_moved / row[f"{col}_s"] / peak if measured else None
            row[f"{col}_hbm_fraction"] = fraction
        if "reference" in outputs and case.op == "paged_attention":
            for col in ("kernel", "xla_gpu"):
                if col in outputs:
                    row[f"{col}_max_abs_err"] = max_error(outputs[col], outputs["reference"])
        if row.get("kernel_s") and row.get("reference_s"):
            row["kernel_speedup_vs_reference"] = row["reference_s"] / row["kernel_s"]
        rows.append(row)
    return {
        "config": {
            "preset": preset,
            "dtype": dtype.name,
            "repeats": repeats,
            "seed": seed,
            "copy_mib": copy_mib,
        },
        "machine": {
            "backend": backend,
            "device": jax.devices()[0].device_kind,
            "kernel_mode": {False: "compiled (Mosaic)", None: "n/a (TPU-only kernel)"}.get(
                interpret, "TPU interpreter (not a performance number)"
            ),
            "copy_bandwidth_gb_s": None if peak is None else peak / 1e9,
            "jax": jax.__version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },
        "results": rows,
    }


def format_table(results: dict) -> str:
    """The results as a fixed-width table (ms; HBM fraction in brackets where measured)."""
    m = results["machine"]
    lines = [
        f"device: {m['device']} ({m['backend']}); kernel column: {m['kernel_mode']}",
        "copy bandwidth: " + (f"{m['copy_bandwidth_gb_s']:.0f} GB/s" if m["copy_bandwidth_gb_s"] else "n/a on CPU"),
        (
            f"{'op':<16} {'case':<14} "
            + " ".join(f"{col + ' ms':>16}" for col in COLUMNS)
            + f" {'ref/kern':>9} {'max|err|':>9}  shape"
        ),
    ]

    def cell(r: dict, col: str) -> str:
        s = r[f"{col}_s"]
        if s is None:
            return "n/a" if "n/a" in r["notes"].get(col, "n/a") else "skipped"
        frac = r.get(f"{col}_hbm_fraction")
        return f"{s * 1e3:.3f}" + (f" [{frac:.0%}]" if frac is not None else "")

    for r in results["results"]:
        ratio = r.get("kernel_speedup_vs_reference")
        errs = [r[k] for k in r if k.endswith("_max_abs_err")]
        err = float("nan") if np.isnan(errs).any() else max(errs, default=None)
        lines.append(
            f"{r['op']:<16} {r['case']:<14} "
            + " ".join(f"{cell(r, col):>16}" for col in COLUMNS)
            + f" {(f'{ratio:.3f}' if ratio else '-'):>9} "
            f"{(f'{err:.1e}' if err is not None else '-'):>9}  {r['shape']}"
        )
    if m["backend"] == "cpu":
        lines.append(
            "kernel = the Mosaic TPU kernel in the TPU interpreter: its time and ref/kern only show that it runs."
        )
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    results = run(FLAGS.preset, FLAGS.dtype, FLAGS.repeats, FLAGS.copy_mib, FLAGS.reference_gib, FLAGS.seed)
    print(format_table(results))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
