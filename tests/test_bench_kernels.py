"""The kernel benchmark (scripts/bench_kernels.py) and its peers (jaxkv/benchmarks/kernel_peers.py):
each peer's layout conversion against jaxkv's reference, and a quick run end to end."""

import importlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from script_runs import REPO, run_script

from jaxkv import ops
from jaxkv.pallas import reference

SCRIPTS = REPO / "scripts"
F32_TOL = 1e-4
BF16_TOL = 2e-2


def script_module(name: str):
    """Import ``scripts/<name>.py`` as a module."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.fixture(scope="module")
def peers():
    return importlib.import_module("jaxkv.benchmarks.kernel_peers")


@pytest.fixture(scope="module")
def bench():
    return script_module("bench_kernels")


def make_batch(peers, seqs, *, layers=None, window=None, soft_cap=None, dtype=jnp.float32, block_size=16, d=32):
    """A random batch in jaxkv's layout (2 KV heads x 2 query heads): distinct shuffled
    pages per sequence, NaN in the null block."""
    rng, heads, qpk = np.random.default_rng(0), 2, 2
    pages = [-(-kv // block_size) for _, kv in seqs]
    num_blocks = 1 + sum(pages)
    shape = (num_blocks, *((layers,) if layers else ()), block_size, 2 * heads, d)
    kv = rng.standard_normal(shape).astype(np.float32)
    kv[0] = np.nan  # the null block: what no query sees may hold anything
    tables = np.zeros((len(seqs), max(pages)), np.int32)
    ids = iter(rng.permutation(np.arange(1, num_blocks)))
    for i, n in enumerate(pages):
        tables[i, :n] = [next(ids) for _ in range(n)]
    q_lens = tuple(q for q, _ in seqs)
    return peers.PagedBatch(
        q=jnp.asarray(rng.standard_normal((sum(q_lens), heads * qpk, d)), dtype),
        kv=jnp.asarray(kv, dtype),
        q_lens=q_lens,
        kv_lens=tuple(kv for _, kv in seqs),
        block_tables=tables,
        layer_index=layers - 1 if layers else None,
        sm_scale=d**-0.5,
        sliding_window=window,
        soft_cap=soft_cap,
    )


def expected(batch):
    return reference.paged_attention(
        batch.q,
        batch.kv,
        *batch.metadata(),
        layer_index=batch.layer_index,
        sm_scale=batch.sm_scale,
        sliding_window=batch.sliding_window,
        soft_cap=batch.soft_cap,
    )


def max_abs_err(a, b):
    diff = float(jnp.max(jnp.abs(a - b)))
    assert np.isfinite(diff), "a NaN or inf never passes"
    return diff


DECODES = ((1, 60), (1, 33), (1, 64), (1, 17))


ALIGNED = ((1, 64), (1, 48), (1, 96), (1, 32))  # with a window of 32, every window starts on a page


@pytest.mark.parametrize(
    "seqs, case",
    [(DECODES, {}), (DECODES, {"layers": 3, "soft_cap": 5.0}), (ALIGNED, {"window": 32})],
    ids=["per-layer", "cross-layer+cap", "page-aligned-window"],
)
@pytest.mark.slow
def test_jax_paged_attention_in_interpret_mode_matches_the_reference(peers, seqs, case):
    batch = make_batch(peers, seqs, **case)
    run = peers.jax_paged_attention(batch, interpret=True)
    assert max_abs_err(run.rows(run.call()), expected(batch)) < F32_TOL


def test_jax_paged_attention_refuses_prefill_and_windows_inside_a_page(peers):
    with pytest.raises(peers.NotApplicable, match="decode only"):
        peers.jax_paged_attention(make_batch(peers, ((1, 40), (8, 48))))
    with pytest.raises(peers.NotApplicable, match="inside a page"):
        peers.jax_paged_attention(make_batch(peers, DECODES, window=24))


def cudnn_semantics(q, k, v, q_seqlen, kv_seqlen, page_table, *, scale):
    """What cuDNN's paged attention computes (padding mask, BTNH), read with plain jnp:
    each sequence's pages gathered through its table, then length-masked attention."""
    del q_seqlen  # one query per sequence: the padding mask is the kv length alone
    batch, pages = page_table.shape[0], page_table.shape[2]
    table = page_table[:, 0, :, 0]
    k, v = (x[table].reshape(batch, pages * x.shape[1], *x.shape[2:]) for x in (k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    logits = jnp.einsum("btnd,bsnd->bnts", q, k) * scale
    seen = jnp.arange(k.shape[1])[None, None, None, :] < kv_seqlen[:, None, None, None]
    probs = jax.nn.softmax(jnp.where(seen, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bnts,bsnd->btnd", probs, jnp.where(jnp.isnan(v), 0.0, v))


@pytest.mark.parametrize(
    "seqs, case",
    [(DECODES, {}), (DECODES, {"layers": 2}), (ALIGNED, {"window": 32})],
    ids=["per-layer", "cross-layer", "page-aligned-window"],
)
def test_the_cudnn_layout_passes_its_checks_and_reads_the_same_attention(peers, seqs, case):
    batch = make_batch(peers, seqs, **case, dtype=jnp.bfloat16)  # cuDNN takes 16-bit floats only
    run = peers.cudnn_paged_attention(batch)
    q, k, v, q_seqlen, kv_seqlen, table = run.args
    cudnn = peers.cudnn_attention
    cudnn.check_layout(q, k, v, None, q_seqlen, kv_seqlen, None, None, table, table, cudnn.AttentionLayout.BTNH)
    assert k.shape[0] == batch.num_seqs * table.shape[2]  # cuDNN's pool is exactly B x pages per row
    out = cudnn_semantics(*(x.astype(jnp.float32) for x in run.args[:3]), *run.args[3:], scale=batch.sm_scale)
    assert max_abs_err(run.rows(out), expected(batch).astype(jnp.float32)) < BF16_TOL


def test_cudnn_refuses_prefill_and_soft_caps(peers):
    with pytest.raises(peers.NotApplicable, match="top-left"):
        peers.cudnn_paged_attention(make_batch(peers, ((1, 40), (8, 48))))
    with pytest.raises(peers.NotApplicable, match="soft cap"):
        peers.cudnn_paged_attention(make_batch(peers, DECODES, soft_cap=5.0))


@pytest.mark.parametrize(
    "seqs, case",
    [
        (DECODES, {}),
        (DECODES, {"layers": 3, "window": 24, "soft_cap": 5.0}),
        (((48, 64),), {"window": 20}),
        (((1, 40), (1, 25), (1, 50), (32, 48)), {"soft_cap": 5.0}),
    ],
    ids=["decode", "window+cap+cross-layer", "prefill+window", "mixed"],
)
@pytest.mark.slow
def test_the_dense_bound_over_a_contiguous_copy_matches_the_reference(peers, seqs, case):
    batch = make_batch(peers, seqs, **case)
    run = peers.dense_bound(batch)
    assert run.note.startswith("dense XLA")  # no GPU here
    assert max_abs_err(run.rows(run.call()), expected(batch)) < F32_TOL


def test_a_pallas_implementation_runs_compiled_on_its_backend_interpreted_on_cpu_else_not(bench, monkeypatch):
    monkeypatch.setattr(ops, "IMPLEMENTATIONS", ("auto", "reference", "pallas_tpu", "xla_gpu", "pallas_gpu"))
    assert bench.jaxkv_columns("cpu") == {
        "reference": "compiled",
        "pallas_tpu": "interpreted",
        "xla_gpu": "compiled",
        "pallas_gpu": "interpreted",
    }
    gpu = bench.jaxkv_columns("gpu")
    assert gpu["pallas_gpu"] == "compiled" and gpu["pallas_tpu"].startswith("n/a")
    assert bench.jaxkv_columns("tpu")["pallas_gpu"] == "n/a: Pallas kernels for gpu"


def failing_case(bench, error):
    def fail():
        raise error

    return bench.Case("paged_attention", "decode", "", 1, {"pallas_gpu": fail, "jax_paged_attention": fail})


def test_a_column_whose_kernels_cannot_load_is_na_and_a_failing_peer_is_reported(bench):
    case = failing_case(bench, ops.KernelUnavailableError("no mosaic_gpu here"))
    assert bench.time_column(case, "pallas_gpu", 1) == (None, None)
    assert case.notes["pallas_gpu"] == "n/a: no mosaic_gpu here"
    case = failing_case(bench, RuntimeError("triton lowering"))
    assert bench.time_column(case, "jax_paged_attention", 1) == (None, None)
    assert case.notes["jax_paged_attention"] == "failed: RuntimeError: triton lowering"
    with pytest.raises(RuntimeError):  # a jaxkv column's own failure is a bug, never hidden
        bench.time_column(case, "pallas_gpu", 1)


@pytest.mark.subprocess
def test_a_quick_run_reports_every_column_with_small_errors(tmp_path):
    out = tmp_path / "bench.json"
    done = run_script("bench_kernels.py", "--quick", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    jaxkv_columns = set(report["columns"]["jaxkv"])
    assert jaxkv_columns == set(ops.IMPLEMENTATIONS) - {"auto"}
    peer_columns = {"jax_rpa", "jax_paged_attention", "cudnn_paged_attention", "dense_bound"}
    assert set(report["columns"]["peers"]) == peer_columns
    attention = [r for r in report["results"] if r["op"] == "paged_attention"]
    assert {r["case"] for r in attention} == {"decode+window", "mixed"}
    for row in attention:
        assert all(f"{col}_s" in row for col in jaxkv_columns | peer_columns)
        assert row["notes"]["jax_paged_attention"] == row["notes"]["cudnn_paged_attention"] == "n/a (GPU only)"
        ran = [c for c in (jaxkv_columns | peer_columns) - {"reference"} if row[f"{c}_s"] is not None]
        assert {"xla_gpu", "dense_bound"} <= set(ran)
        assert all(row[f"{c}_max_abs_err"] < F32_TOL for c in ran)
        assert row["speedups"]["xla_gpu_vs_dense_bound"] > 0 and row["speedups"]["xla_gpu_vs_reference"] > 0
    assert {r["op"] for r in report["results"]} == {"paged_attention", "write_kv", "copy_blocks"}
    assert "speed-up of jaxkv" in done.stdout


@pytest.mark.subprocess
def test_named_cases_run_alone_in_their_order_each_printed_as_it_finishes(tmp_path):
    out = tmp_path / "bench.json"
    done = run_script("bench_kernels.py", "--quick", "--cases=copy_blocks,write_kv-decode", "--out", str(out))
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert [(r["op"], r["case"]) for r in report["results"]] == [("copy_blocks", "cow"), ("write_kv", "decode")]
    progress = [line for line in done.stdout.splitlines() if line.startswith("[")]
    assert progress[0].startswith("[1/2] copy_blocks cow: reference ")
    assert progress[1].startswith("[2/2] write_kv decode: reference ")


def test_the_case_names_are_those_a_run_builds(bench):
    for preset in ("cpu", "accelerator", "quick"):
        built = bench.case_builders(bench.PRESETS[preset], jnp.float32, None, {}, "cpu", 0.0)
        assert list(built) == bench.case_names(preset)


@pytest.mark.subprocess
def test_an_unknown_case_is_one_line_and_status_2():
    done = run_script("bench_kernels.py", "--preset=accelerator", "--cases=decode,nope")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "bench_kernels.py: error: --cases: unknown case nope; valid: "
        "decode,decode-long,decode+window,decode+window-nocap,decode-xlayer,prefill,prefill-512,mixed,"
        "write_kv-decode,write_kv-prefill,copy_blocks"
    ]
