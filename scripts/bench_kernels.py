"""Benchmark jaxkv's device ops per implementation, beside peer kernels on the same inputs.

Per case (decode / windowed decode / prefill / mixed paged attention, write_kv,
copy_blocks) one column per jaxkv implementation (``jaxkv.device.ops.IMPLEMENTATIONS`` but
``auto``, called through ``jaxkv.device.ops`` with ``impl=``: a new implementation gets a
column without editing this script) and, for paged attention, one per peer
(``jaxkv/benchmarks/kernel_peers.py``), timed in the same run (best of --repeats, after a warm-up
call that compiles):

  reference            jaxkv.pallas.reference (plain jnp, XLA on whatever backend this is);
  pallas_tpu           the Mosaic TPU kernels; on CPU they run in the TPU *interpreter*, so
                       the time only shows that they run; n/a on GPU;
  xla_gpu              jaxkv.pallas.xla, the GPU default (plain XLA, runs anywhere);
  pallas_<backend>     any other Pallas implementation: compiled on its backend,
                       interpreted on CPU, n/a elsewhere (or where its kernels cannot
                       load: KernelUnavailableError);
  jax_rpa              peer: JAX's TPU ragged paged attention (TPU only);
  jax_paged_attention  peer: JAX's bundled GPU paged attention (Pallas-Triton; GPU only,
                       decodes only);
  cudnn_paged_attention peer: cuDNN's paged attention via the private jax._src.cudnn
                       (GPU only, decodes only, no soft cap);
  dense_bound          peer: dense attention over a contiguous copy of each sequence's
                       visible K/V (no page table): the bound a paged kernel can approach
                       (cuDNN on GPU where it takes the case, else XLA; every backend).

Peers get their own K/V layout, converted once outside the timed call. Every attention
column reports its max |error| against the reference (NaN if its output is not finite),
and every jaxkv column its speed-up over the reference and each peer (peer time /
jaxkv time, > 1: jaxkv is faster). On a GPU or TPU each compiled column also reports
achieved bandwidth as a fraction of a device-to-device copy of the same bytes measured
in the same run (a jitted ``x + 1``: read + write). Bytes per case are the minimum the op
must move: the pages its queries can see (whole pages) plus q and the output for
attention; the new tokens read and written for write_kv; each block read and written
for copy_blocks.

  PYTHONPATH=. python scripts/bench_kernels.py --out /tmp/bench_kernels.json
  PYTHONPATH=. python scripts/bench_kernels.py --quick   # small shapes, one repeat
  PYTHONPATH=. python scripts/bench_kernels.py --cases=decode,decode-long   # some cases, in this order

Each case is printed (flushed) as it finishes, after the copy bandwidth, then the tables.
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

from jaxkv import ops
from jaxkv.benchmarks.kernel_peers import PEERS, NotApplicable, PagedBatch
from jaxkv.benchmarks.timing import best_seconds
from jaxkv.commands.cli import exit_error, flags_parser
from jaxkv.device.cache import KVCache
from jaxkv.device.metadata import attention_metadata
from jaxkv.pallas.reference import KVShapeError
from jaxkv.specs import FullAttentionSpec, SlidingWindowSpec

PROG = "bench_kernels.py"
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
flags.DEFINE_bool("quick", False, "Smoke run: two small attention cases and one repeat, on any backend.")
flags.DEFINE_list(
    "cases",
    None,
    "Run only these cases of the preset, in this order (attention workload names, write_kv-decode, "
    "write_kv-prefill, copy_blocks); each is printed as it finishes. Default: all.",
)

LAYER = "attn"  # the one layer of the benchmark's caches
PEER_NAMES = tuple(p.name for p in PEERS)
Impl = Callable[[], jax.Array] | None  # None: the column does not run this case here


def jaxkv_columns(backend: str) -> dict[str, str]:
    """Each jaxkv implementation but ``auto``, with how it runs here: "compiled",
    "interpreted" (a Pallas implementation for another backend, on CPU) or "n/a: why"."""
    modes = {}
    for name in ops.IMPLEMENTATIONS:
        if name == "auto":
            continue
        kind, _, target = name.partition("_")
        if kind != "pallas" or target == backend:
            modes[name] = "compiled"
        elif backend == "cpu":
            modes[name] = "interpreted"
        else:
            modes[name] = f"n/a: Pallas kernels for {target}"
    return modes


@dataclass
class Case:
    """One benchmark row: callables per column (None: does not run here) and bytes moved.

    ``rows`` maps a peer's output to the reference's rows (jaxkv columns need none).
    """

    op: str
    name: str
    shape: str
    bytes_moved: int
    impls: dict[str, Impl]
    notes: dict[str, str] = field(default_factory=dict)
    rows: dict[str, Callable[[jax.Array], jax.Array]] = field(default_factory=dict)


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
            Attn("decode+window-nocap", ((1, 8192),) * 32, 16, 8, 4, 128, window=1024),
            Attn("decode-xlayer", ((1, 4096),) * 32, 16, 8, 4, 128, num_layers_per_block=6),
            Attn("prefill", ((256, 1024),) * 2, 16, 8, 4, 128),
            Attn("prefill-512", ((512, 1536),) * 2, 16, 8, 4, 128),  # 512 new tokens after 1024 cached
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
PRESETS["quick"] = {  # smoke run: windowed cross-layer decodes and a mixed prefill+decode batch
    **PRESETS["cpu"],
    "attention": [w for w in PRESETS["cpu"]["attention"] if w.name in ("decode+window", "mixed")],
}


def one_layer_cache(
    buffer: jax.Array, layer_index: int | None, num_kv_heads: int, window: int | None = None
) -> KVCache:
    """A cache over ``buffer`` whose only layer is :data:`LAYER` (at ``layer_index`` if
    cross-layer), of sliding ``window`` (None: full attention)."""
    kw = {"num_kv_heads": num_kv_heads, "head_size": buffer.shape[-1], "dtype": buffer.dtype}
    spec = FullAttentionSpec(**kw) if window is None else SlidingWindowSpec(**kw, sliding_window=window)
    return KVCache(
        buffers=(buffer,),
        layout="per_layer" if layer_index is None else "cross_layer",
        layer_indices=((LAYER, layer_index or 0),),
        layer_specs=((LAYER, spec),),
        block_size=buffer.shape[-3],
        num_kv_heads=num_kv_heads,
        head_dim=buffer.shape[-1],
    )


def unavailable(notes: dict[str, str], impls: dict[str, Impl], modes: dict[str, str]) -> list[str]:
    """Record the jaxkv columns that do not run here; return those that do."""
    runnable = []
    for name, mode in modes.items():
        if mode.startswith("n/a"):
            impls[name], notes[name] = None, mode
        else:
            runnable.append(name)
    return runnable


def attention_batch(w: Attn, dtype: jnp.dtype, rng: np.random.Generator) -> PagedBatch:
    """Random cache, distinct random pages per sequence, decodes first."""
    bs, h, d = w.block_size, w.num_kv_heads, w.head_dim
    pages = [-(-kv // bs) for _, kv in w.seqs]
    num_blocks = 1 + sum(pages)
    layer_shape = (num_blocks,) + ((w.num_layers_per_block,) if w.num_layers_per_block else ()) + (bs, 2 * h, d)
    tables = np.zeros((len(w.seqs), max(pages)), np.int32)
    ids = iter(rng.permutation(np.arange(1, num_blocks)).astype(np.int32))
    for i, n in enumerate(pages):
        tables[i, :n] = [next(ids) for _ in range(n)]
    q_lens = tuple(q for q, _ in w.seqs)
    return PagedBatch(
        q=jnp.asarray(rng.standard_normal((sum(q_lens), h * w.num_queries_per_kv, d), np.float32), dtype),
        kv=jnp.asarray(rng.standard_normal(layer_shape, np.float32), dtype),
        q_lens=q_lens,
        kv_lens=tuple(kv for _, kv in w.seqs),
        block_tables=tables,
        layer_index=1 if w.num_layers_per_block else None,
        sm_scale=d**-0.5,
        sliding_window=w.window,
        soft_cap=w.soft_cap,
    )


def attention_case(
    w: Attn, dtype: jnp.dtype, rng: np.random.Generator, modes: dict[str, str], backend: str, ref_budget: float
) -> Case:
    """jaxkv's implementations through ``jaxkv.device.ops`` and every peer, on one random batch."""
    batch = attention_batch(w, dtype, rng)
    q, bs, h, d = batch.q, w.block_size, w.num_kv_heads, w.head_dim
    width = batch.block_tables.shape[1]
    needed = sum(-(-kv // bs) - start // bs for kv, start in zip(batch.kv_lens, batch.visible_start(), strict=True))
    bytes_moved = needed * bs * 2 * h * d * jnp.dtype(dtype).itemsize + 2 * q.size * q.dtype.itemsize

    impls: dict[str, Impl] = {}
    notes: dict[str, str] = {}
    cache = one_layer_cache(batch.kv, batch.layer_index, h, w.window)
    kv_lens, tables, cu, num_seqs = batch.metadata()
    meta = attention_metadata((LAYER,), tables, kv_lens, cu, num_seqs, num_tokens=q.shape[0])
    kw = {"sm_scale": batch.sm_scale, "soft_cap": w.soft_cap}
    gather_bytes = q.shape[0] * width * bs * (2 * h * d * (jnp.dtype(dtype).itemsize + 4) + q.shape[1] * 12)
    for name in unavailable(notes, impls, modes):
        if name == "reference" and gather_bytes > ref_budget:
            impls[name], notes[name] = None, "skipped: token-major gather too large"
            continue
        fn = jax.jit(lambda q, cache, name=name: ops.paged_attention(q, cache, LAYER, meta, impl=name, **kw))
        impls[name] = lambda fn=fn: fn(q, cache)

    rows = {}
    for peer in PEERS:
        impls[peer.name] = None
        if peer.backends is not None and backend not in peer.backends:
            notes[peer.name] = f"n/a ({'/'.join(sorted(peer.backends)).upper()} only)"
            continue
        try:
            run = peer.prepare(batch)
        except NotApplicable as why:
            notes[peer.name] = f"n/a: {why}"
            continue
        impls[peer.name], rows[peer.name], notes[peer.name] = run.call, run.rows, run.note

    ctx = sorted(set(batch.kv_lens))
    shape = (
        f"{batch.num_seqs} seqs, {q.shape[0]} tok, ctx {ctx[0]}..{ctx[-1]}, bs {bs}, "
        f"H {h}x{w.num_queries_per_kv}, D {d}"
        + (f", W {w.window}" if w.window else "")
        + (f", cap {w.soft_cap:g}" if w.soft_cap else "")
        + (", cross-layer" if batch.layer_index is not None else "")
    )
    return Case("paged_attention", w.name, shape, bytes_moved, impls, notes, rows)


def donating(fn: Callable, state: list) -> Callable[[], jax.Array]:
    """Call ``fn`` on the current cache, donated, and keep the result for the next call."""

    def step() -> jax.Array:
        state[0] = fn(state[0])
        return state[0].buffers

    return step


def write_case(
    name: str, num_tokens: int, p: dict, dtype: jnp.dtype, rng: np.random.Generator, modes: dict[str, str]
) -> Case:
    """Decode: one token per random block; prefill: whole consecutive blocks."""
    bs, h, d, n = p["block_size"], p["num_kv_heads"], p["head_dim"], p["num_blocks"]
    if name == "decode":
        blocks = rng.choice(np.arange(1, n), num_tokens, replace=False)
        slots = blocks * bs + rng.integers(0, bs, num_tokens)
    else:
        start = int(rng.integers(1, n - num_tokens // bs))
        slots = start * bs + np.arange(num_tokens)
    meta = attention_metadata((LAYER,), [[0]], [0], [0, 0], [0], slots)
    k, v = (jnp.asarray(rng.standard_normal((num_tokens, h, d), np.float32), dtype) for _ in range(2))
    impls: dict[str, Impl] = {}
    notes: dict[str, str] = {}
    for impl in unavailable(notes, impls, modes):
        jitted = jax.jit(lambda c, impl=impl: ops.write_kv(c, LAYER, k, v, meta, impl=impl), donate_argnums=0)
        buffer = jnp.asarray(rng.standard_normal((n, bs, 2 * h, d), np.float32), dtype)
        impls[impl] = donating(jitted, [one_layer_cache(buffer, None, h)])
    bytes_moved = 2 * 2 * k.size * k.dtype.itemsize
    return Case("write_kv", name, f"{num_tokens} tok, bs {bs}, H {h}, D {d}", bytes_moved, impls, notes)


def copy_case(p: dict, dtype: jnp.dtype, rng: np.random.Generator, modes: dict[str, str]) -> Case:
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
    impls: dict[str, Impl] = {}
    notes: dict[str, str] = {}
    for impl in unavailable(notes, impls, modes):
        jitted = jax.jit(lambda c, impl=impl: ops.copy_blocks(c, src, dst, impl=impl), donate_argnums=0)
        buffer = jnp.asarray(rng.standard_normal((n, s, bs, 2 * h, d), np.float32), dtype)
        impls[impl] = donating(jitted, [one_layer_cache(buffer, 0, h)])
    block_bytes = s * bs * 2 * h * d * jnp.dtype(dtype).itemsize
    shape_text = f"{pairs} blocks of {block_bytes // 1024} KiB, {s} layers each"
    return Case("copy_blocks", "cow", shape_text, 2 * pairs * block_bytes, impls, notes)


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device bytes/s of an elementwise copy (read + write) of ``nbytes`` bytes."""
    x = jnp.zeros((max(nbytes // 4, 1),), jnp.float32)
    f = jax.jit(lambda x: x + 1)
    return 2 * x.nbytes / best_seconds(lambda: f(x), 5)


def max_error(a: jax.Array, b: jax.Array) -> float:
    """Max |a - b| in float32; NaN if ``a`` has a non-finite value."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b))) if np.isfinite(a).all() else float("nan")


def time_column(case: Case, col: str, repeats: int) -> tuple[float | None, jax.Array | None]:
    """Best seconds and one output of ``col``, or Nones with the reason in ``case.notes``.

    A jaxkv column whose kernels cannot load, or whose tiles do not fit the shapes, is
    n/a; a peer that fails on this machine (a private or deprecated API, any error) is
    reported as failed, not fatal.
    """
    fn = case.impls[col]
    try:
        return best_seconds(fn, repeats), fn()
    except (ops.KernelUnavailableError, KVShapeError) as err:  # kernels missing, or tiles that do not fit
        case.notes[col] = f"n/a: {err}"
    except Exception as err:
        if col not in PEER_NAMES:
            raise
        case.notes[col] = f"failed: {type(err).__name__}: {str(err)[:200]}"
    return None, None


def measure(case: Case, columns: list[str], interpreted: set[str], repeats: int, on_cpu: bool) -> dict:
    """One JSON row: time, bandwidth fraction and error per column, speed-ups of jaxkv's."""
    row = {"op": case.op, "case": case.name, "shape": case.shape, "bytes": int(case.bytes_moved), "notes": case.notes}
    copy = None if on_cpu else copy_bandwidth(case.bytes_moved)
    row["copy_gb_s"] = None if copy is None else copy / 1e9
    outputs = {}
    for col in columns:
        seconds, out = (None, None)
        if case.impls.get(col) is not None:
            seconds, out = time_column(case, col, min(repeats, 2) if col in interpreted else repeats)
        row[f"{col}_s"] = seconds
        measured = seconds is not None and copy is not None and col not in interpreted
        row[f"{col}_hbm_fraction"] = case.bytes_moved / seconds / copy if measured else None
        if out is not None:
            outputs[col] = case.rows[col](out) if col in case.rows else out
    if case.op == "paged_attention" and "reference" in outputs:
        for col, out in outputs.items():
            if col != "reference":
                row[f"{col}_max_abs_err"] = max_error(out, outputs["reference"])
    baselines = ["reference", *PEER_NAMES]
    row["speedups"] = {
        f"{col}_vs_{base}": row[f"{base}_s"] / row[f"{col}_s"]
        for col in columns
        if col not in baselines and col not in interpreted and row[f"{col}_s"]
        for base in baselines
        if row.get(f"{base}_s")
    }
    return row


def case_builders(
    p: dict, dtype: jnp.dtype, rng: np.random.Generator, modes: dict[str, str], backend: str, ref_budget: float
) -> dict[str, Callable[[], Case]]:
    """Each case of preset ``p`` by its ``--cases`` name (an attention workload's name,
    ``write_kv-decode``, ``write_kv-prefill``, ``copy_blocks``), built when called: a run
    holds one case's buffers at a time."""
    builders: dict[str, Callable[[], Case]] = {
        w.name: functools.partial(attention_case, w, dtype, rng, modes, backend, ref_budget) for w in p["attention"]
    }
    for name in ("decode", "prefill"):
        builders[f"write_kv-{name}"] = functools.partial(
            write_case, name, p["write_kv"][name], p["write_kv"], dtype, rng, modes
        )
    builders["copy_blocks"] = functools.partial(copy_case, p["copy_blocks"], dtype, rng, modes)
    return builders


def preset_name(preset: str, quick: bool, backend: str) -> str:
    """The preset a run uses: ``quick`` with ``--quick``, else ``--preset`` (auto: by backend)."""
    if quick:
        return "quick"
    return preset if preset != "auto" else ("cpu" if backend == "cpu" else "accelerator")


def case_names(preset: str) -> list[str]:
    """The ``--cases`` names of ``preset``, in run order."""
    p = PRESETS[preset]
    return [w.name for w in p["attention"]] + ["write_kv-decode", "write_kv-prefill", "copy_blocks"]


def progress_line(row: dict, columns: list[str]) -> str:
    """One finished case: each column's ms [copy-bandwidth fraction] and max |error|."""
    cells = []
    for col in columns:
        seconds = row.get(f"{col}_s")
        if seconds is None:
            continue
        frac, err = row.get(f"{col}_hbm_fraction"), row.get(f"{col}_max_abs_err")
        cells.append(
            f"{col} {seconds * 1e3:.3f} ms"
            + (f" [{frac:.0%}]" if frac is not None else "")
            + (f" err {err:.1e}" if err is not None else "")
        )
    return f"{row['op']} {row['case']}: " + ", ".join(cells or ["no column ran"])


def run(
    preset: str,
    dtype_name: str,
    repeats: int,
    copy_mib: int,
    reference_gib: float,
    seed: int,
    quick: bool = False,
    cases: list[str] | None = None,
) -> dict:
    """Every case of the preset (or those named in ``cases``), each printed as it finishes."""
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    preset = preset_name(preset, quick, backend)
    repeats = 1 if quick else repeats
    dtype = jnp.dtype(dtype_name if dtype_name != "auto" else ("float32" if on_cpu else "bfloat16"))
    modes = jaxkv_columns(backend)
    rng = np.random.default_rng(seed)
    builders = case_builders(PRESETS[preset], dtype, rng, modes, backend, reference_gib * 2**30)
    chosen = list(builders) if cases is None else cases
    peak = None if on_cpu else copy_bandwidth(copy_mib * 2**20)
    print(f"device: {jax.devices()[0].device_kind} ({backend}), jax {jax.__version__}; cases: {', '.join(chosen)}")
    print("copy bandwidth: " + ("n/a on CPU" if peak is None else f"{peak / 1e9:.0f} GB/s"), flush=True)
    columns = [*modes, *PEER_NAMES]
    interpreted = {name for name, mode in modes.items() if mode == "interpreted"}
    rows = []
    for i, name in enumerate(chosen):
        rows.append(measure(builders[name](), columns, interpreted, repeats, on_cpu))
        print(f"[{i + 1}/{len(chosen)}] {progress_line(rows[-1], columns)}", flush=True)
    return {
        "config": {
            "preset": preset,
            "dtype": dtype.name,
            "repeats": repeats,
            "seed": seed,
            "copy_mib": copy_mib,
            "cases": chosen,
        },
        "machine": {
            "backend": backend,
            "device": jax.devices()[0].device_kind,
            "copy_bandwidth_gb_s": None if peak is None else peak / 1e9,
            "jax": jax.__version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
        },
        "columns": {"jaxkv": modes, "peers": list(PEER_NAMES)},
        "results": rows,
    }


def format_table(results: dict) -> str:
    """Three fixed-width tables: times (ms; copy-bandwidth fraction in brackets where
    measured), max |error| against the reference, and jaxkv's speed-ups."""
    m = results["machine"]
    columns = [*results["columns"]["jaxkv"], *results["columns"]["peers"]]
    interpreted = [name for name, mode in results["columns"]["jaxkv"].items() if mode == "interpreted"]
    width = max(len(c) for c in columns) + 1
    lines = [
        f"device: {m['device']} ({m['backend']}), jax {m['jax']}",
        "copy bandwidth: " + (f"{m['copy_bandwidth_gb_s']:.0f} GB/s" if m["copy_bandwidth_gb_s"] else "n/a on CPU"),
    ]

    def cell(r: dict, col: str) -> str:
        s = r.get(f"{col}_s")
        if s is None:
            note = r["notes"].get(col, "n/a")
            return "failed" if note.startswith("failed") else "skipped" if note.startswith("skipped") else "n/a"
        frac = r.get(f"{col}_hbm_fraction")
        return f"{s * 1e3:.3f}" + (f" [{frac:.0%}]" if frac is not None else "")

    def error(r: dict, col: str) -> str:
        err = r.get(f"{col}_max_abs_err")
        return "-" if err is None else f"{err:.1e}"

    head = f"{'op':<16} {'case':<20} "
    rows = results["results"]
    lines.append("\ntime, ms [fraction of copy bandwidth]")
    lines.append(head + " ".join(f"{c:>{width}}" for c in columns) + "  shape")
    for r in rows:
        lines.append(
            f"{r['op']:<16} {r['case']:<20} " + " ".join(f"{cell(r, c):>{width}}" for c in columns) + f"  {r['shape']}"
        )
    lines.append("\nmax |error| vs reference")
    attention_columns = [c for c in columns if c != "reference"]
    lines.append(head + " ".join(f"{c:>{width}}" for c in attention_columns))
    for r in rows:
        if r["op"] == "paged_attention":
            lines.append(
                f"{r['op']:<16} {r['case']:<20} " + " ".join(f"{error(r, c):>{width}}" for c in attention_columns)
            )
    lines.append("\nspeed-up of jaxkv (baseline time / jaxkv time)")
    for r in rows:
        pairs = ", ".join(f"{k.replace('_vs_', ' vs ')} {v:.2f}x" for k, v in r["speedups"].items())
        lines.append(f"{r['op']:<16} {r['case']:<20} {pairs or '-'}")
    notes = sorted({f"{c}: {note}" for r in rows for c, note in r["notes"].items()})
    lines.append("\nnotes:\n  " + "\n  ".join(notes) if notes else "")
    if interpreted:
        lines.append(f"{', '.join(interpreted)}: interpreted here, its time only shows that it runs (no speed-ups).")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    del argv
    if FLAGS.cases is not None:
        valid = case_names(preset_name(FLAGS.preset, FLAGS.quick, jax.default_backend()))
        unknown = [name for name in FLAGS.cases if name not in valid] or (["(none named)"] if not FLAGS.cases else [])
        if unknown:
            exit_error(PROG, f"--cases: unknown case {', '.join(unknown)}; valid: {','.join(valid)}")
    results = run(
        FLAGS.preset,
        FLAGS.dtype,
        FLAGS.repeats,
        FLAGS.copy_mib,
        FLAGS.reference_gib,
        FLAGS.seed,
        FLAGS.quick,
        FLAGS.cases,
    )
    print(format_table(results))
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
