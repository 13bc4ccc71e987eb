"""Mosaic TPU kernels (jaxkv.pallas.tpu) in the TPU interpreter vs the jnp reference.

Every case draws fresh random inputs (the seed is in each failure message; set
JAXKV_TEST_SEED to replay one). Bytes the kernels must not read are NaN
(:mod:`paged_batches`), and the interpreter fills its scratch memory with NaN, so a
stray read shows up as NaN in the output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
from paged_batches import (
    AttentionCase,
    Batch,
    SeededRng,
    bits,
    compare_attention,
    make_batch,
    random_seqs,
)

from jaxkv.pallas import reference as ref
from jaxkv.pallas import tpu as kernels
from jaxkv.pallas.reference import KVShapeError
from jaxkv.pallas.tpu.paged_attention import AttentionTuning
from jaxkv.pallas.tpu.write_kv import _full_block_runs

INTERPRET = pltpu.InterpretParams()


@pytest.fixture(autouse=True)
def fresh_interpreter():
    """Reset the interpreter's global memory/race state (a failed kernel leaves it set)."""
    pltpu.reset_tpu_interpret_mode_state()


# ---------------------------------------------------------------------------------------
# paged attention


def check_attention(rng: SeededRng, batch: Batch, *, interpret: pltpu.InterpretParams = INTERPRET, **kw) -> np.ndarray:
    """The TPU kernel in the interpreter against the reference (see :func:`compare_attention`)."""
    return compare_attention(functools.partial(kernels.paged_attention, interpret=interpret), rng, batch, **kw)


ATTENTION_CASES = {
    "fp32-mha-per-layer": AttentionCase(
        jnp.float32,
        num_kv_heads=2,
        num_queries_per_kv=1,
        head_dim=8,
        block_size=4,
        num_decodes=3,
        num_prefills=2,
        max_len=13,
    ),
    "fp32-gqa2-cross-layer": AttentionCase(
        jnp.float32,
        num_kv_heads=2,
        num_queries_per_kv=2,
        head_dim=8,
        block_size=4,
        num_decodes=2,
        num_prefills=2,
        max_len=14,
        layer_index=1,
        tuning=AttentionTuning(pages_per_chunk=2),
    ),
    "fp32-gqa4-window-cap": AttentionCase(
        jnp.float32,
        num_kv_heads=1,
        num_queries_per_kv=4,
        head_dim=16,
        block_size=4,
        num_decodes=2,
        num_prefills=2,
        max_len=17,
        window=5,
        soft_cap=4.0,
        tuning=AttentionTuning(pages_per_chunk=1),
    ),
    "fp32-window-eq-block": AttentionCase(
        jnp.float32,
        num_kv_heads=2,
        num_queries_per_kv=2,
        head_dim=8,
        block_size=4,
        num_decodes=1,
        num_prefills=2,
        max_len=15,
        window=4,
        layer_index=0,
        tuning=AttentionTuning(queries_per_tile=8),
    ),
    "fp32-window-1": AttentionCase(
        jnp.float32,
        num_kv_heads=1,
        num_queries_per_kv=2,
        head_dim=8,
        block_size=2,
        num_decodes=2,
        num_prefills=1,
        max_len=9,
        window=1,
        tuning=AttentionTuning(pages_per_chunk=3),
    ),
    "fp32-prefill-only-tiles": AttentionCase(
        jnp.float32,
        num_kv_heads=1,
        num_queries_per_kv=2,
        head_dim=8,
        block_size=4,
        num_decodes=0,
        num_prefills=3,
        max_len=20,
        window=6,
        soft_cap=2.5,
        layer_index=2,
        tuning=AttentionTuning(queries_per_tile=8, pages_per_chunk=2),
    ),
    "bf16-gqa4": AttentionCase(
        jnp.bfloat16,
        num_kv_heads=1,
        num_queries_per_kv=4,
        head_dim=16,
        block_size=4,
        num_decodes=3,
        num_prefills=1,
        max_len=12,
    ),
    "bf16-window-cap-cross": AttentionCase(
        jnp.bfloat16,
        num_kv_heads=2,
        num_queries_per_kv=2,
        head_dim=16,
        block_size=8,
        num_decodes=2,
        num_prefills=2,
        max_len=19,
        window=7,
        soft_cap=3.0,
        layer_index=1,
        tuning=AttentionTuning(pages_per_chunk=1),
    ),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_matches_reference(rng, case):
    c = ATTENTION_CASES[case]
    batch = c.batch(rng)
    check_attention(
        rng,
        batch,
        layer_index=c.layer_index,
        window=c.window,
        soft_cap=c.soft_cap,
        tuning=c.tuning or AttentionTuning(),
    )


def test_paged_attention_full_batch_and_empty_sequences(rng):
    """num_seqs == max_seqs (no padded sequence), with real zero-length query runs
    at the start, in the middle and at the end."""
    seqs = [(0, 3), (1, 6), (0, 5), (1, 1), (5, 9), (0, 4)]
    batch = make_batch(
        rng,
        seqs,
        max_seqs=len(seqs),
        block_size=4,
        num_kv_heads=1,
        num_queries_per_kv=2,
        head_dim=8,
        dtype=jnp.float32,
        extra_tokens=0,
    )
    check_attention(rng, batch, tuning=AttentionTuning(queries_per_tile=8))


def test_paged_attention_no_sequences_gives_zeros(rng):
    batch = make_batch(
        rng,
        [],
        max_seqs=3,
        block_size=4,
        num_kv_heads=1,
        num_queries_per_kv=2,
        head_dim=8,
        dtype=jnp.float32,
        extra_tokens=5,
    )
    out = check_attention(rng, batch)
    assert not out.any()


def test_paged_attention_window_covers_everything(rng):
    """A window wider than every sequence is plain causal attention."""
    seqs = random_seqs(rng, 2, 2, 10)
    batch = make_batch(
        rng, seqs, max_seqs=4, block_size=4, num_kv_heads=1, num_queries_per_kv=2, head_dim=8, dtype=jnp.float32
    )
    windowed = check_attention(rng, batch, window=64)
    causal = kernels.paged_attention(*batch.args(batch.kv_poisoned), sm_scale=0.35, interpret=INTERPRET)
    np.testing.assert_allclose(windowed, np.asarray(causal), atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_paged_attention_matches_jax_bundled_reference(rng):
    """Second, independent oracle: JAX's own ref_ragged_paged_attention (real rows)."""
    seqs = random_seqs(rng, 2, 2, 14)
    batch = make_batch(
        rng,
        seqs,
        max_seqs=5,
        block_size=4,
        num_kv_heads=2,
        num_queries_per_kv=2,
        head_dim=8,
        dtype=jnp.float32,
        window=6,
    )
    out = check_attention(rng, batch, window=6, soft_cap=3.0)
    with jax.default_matmul_precision("highest"):  # GPUs default fp32 matmuls to TF32
        theirs = ref_ragged_paged_attention(*batch.args(batch.kv_clean), sm_scale=0.35, sliding_window=6, soft_cap=3.0)
    n = int(batch.cu_q_lens[len(seqs)])
    np.testing.assert_allclose(out[:n], np.asarray(theirs), atol=1e-5, rtol=1e-5, err_msg=f"seed={rng.seed}")


def test_paged_attention_never_fetches_pages_outside_the_span(rng):
    """Freed (out-of-window) and padding table entries point past the cache: the
    interpreter raises on any DMA from them, so passing proves they are skipped."""
    seqs = [(1, 23), (1, 9), (3, 21), (6, 6)]
    batch = make_batch(
        rng,
        seqs,
        max_seqs=6,
        block_size=4,
        num_kv_heads=1,
        num_queries_per_kv=2,
        head_dim=8,
        dtype=jnp.float32,
        window=5,
        width_slack=2,
    )
    out_of_range = batch.kv_poisoned.shape[0] + 7
    tables = jnp.where(batch.tables == 0, out_of_range, batch.tables)
    args = (batch.q, batch.kv_poisoned, batch.kv_lens, tables, batch.cu_q_lens, batch.num_seqs)
    out = kernels.paged_attention(
        *args, sm_scale=0.35, sliding_window=5, interpret=INTERPRET, tuning=AttentionTuning(pages_per_chunk=2)
    )
    want = ref.paged_attention(*batch.args(batch.kv_clean), sm_scale=0.35, sliding_window=5)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5, equal_nan=False)


def test_paged_attention_no_races_eager_dmas(rng):
    """The double-buffered DMAs under the race detector, executed eagerly at start."""
    seqs = random_seqs(rng, 3, 2, 14)
    batch = make_batch(
        rng,
        seqs,
        max_seqs=6,
        block_size=4,
        num_kv_heads=2,
        num_queries_per_kv=2,
        head_dim=8,
        dtype=jnp.float32,
        window=7,
        num_layers_per_block=2,
        layer_index=1,
    )
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager")
    check_attention(
        rng,
        batch,
        layer_index=1,
        window=7,
        interpret=params,
        tuning=AttentionTuning(queries_per_tile=8, pages_per_chunk=2),
    )
    assert not mosaic_interpret.races.races_found


def test_paged_attention_under_jit(rng):
    """Static args stay static under an outer jit (how jaxkv.device.ops calls it)."""
    seqs = random_seqs(rng, 2, 1, 10)
    batch = make_batch(
        rng, seqs, max_seqs=4, block_size=4, num_kv_heads=1, num_queries_per_kv=2, head_dim=8, dtype=jnp.float32
    )
    f = jax.jit(functools.partial(kernels.paged_attention, sm_scale=0.35, interpret=INTERPRET))
    out = f(*batch.args(batch.kv_poisoned))
    want = ref.paged_attention(*batch.args(batch.kv_clean), sm_scale=0.35)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5, equal_nan=False)


def test_paged_attention_rejects_bad_inputs():
    q = jnp.zeros((4, 4, 8), jnp.float32)
    kv = jnp.zeros((3, 4, 4, 8), jnp.float32)
    lens, tables = jnp.zeros((2,), jnp.int32), jnp.zeros((2, 2), jnp.int32)
    cu, n = jnp.zeros((3,), jnp.int32), jnp.zeros((1,), jnp.int32)
    good = (q, kv, lens, tables, cu, n)
    call = functools.partial(kernels.paged_attention, sm_scale=1.0, interpret=INTERPRET)
    for bad in (
        (jnp.zeros((4, 3, 8)), *good[1:]),  # 3 query heads, 2 kv heads
        (q, kv, lens, tables, jnp.zeros((2,), jnp.int32), n),  # cu_q_lens too short
        (q, kv, lens.astype(jnp.float32), *good[3:]),  # float lens
    ):
        with pytest.raises(KVShapeError):
            call(*bad)
    with pytest.raises(KVShapeError):
        call(*good, layer_index=0)  # per-layer buffer with a layer index
    with pytest.raises(KVShapeError):
        call(*good, sliding_window=0)


# ---------------------------------------------------------------------------------------
# write_kv


def random_slot_mapping(rng: SeededRng, num_blocks: int, bs: int) -> np.ndarray:
    """Decodes, an aligned multi-block prefill, an unaligned run crossing blocks, and
    padding tokens (several on null slot 0)."""
    free = iter(rng.permutation(np.arange(1, num_blocks)))
    slots = [next(free) * bs + int(rng.integers(0, bs)) for _ in range(3)]  # decodes
    start = next(free)
    second = next(free)
    slots += [start * bs + i for i in range(bs)] + [second * bs + i for i in range(bs)]  # 2 full blocks
    a, b = next(free), next(free)
    off = int(rng.integers(1, bs))
    slots += [a * bs + i for i in range(off, bs)] + [b * bs + i for i in range(off)]  # unaligned run
    slots += [0, 0, int(rng.integers(0, bs))]
    return np.asarray(slots, np.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layer_index", [None, 1])
def test_write_kv_matches_reference_and_touches_nothing_else(rng, dtype, layer_index):
    bs, h, d, n = 4, 2, 8, 16
    shape = (n,) + (() if layer_index is None else (3,)) + (bs, 2 * h, d)
    buf = rng.standard_normal(shape)
    buf[rng.random(shape) < 0.1] = np.nan  # untouched NaNs must survive bit for bit
    buf = jnp.asarray(buf, dtype)
    slots = random_slot_mapping(rng, n, bs)
    k, v = (jnp.asarray(rng.standard_normal((len(slots), h, d)), dtype) for _ in range(2))
    out = kernels.write_kv(buf, k, v, jnp.asarray(slots), layer_index=layer_index, interpret=INTERPRET)
    want = ref.write_kv(buf, k, v, jnp.asarray(slots), layer_index=layer_index)
    msg = f"seed={rng.seed}"
    np.testing.assert_array_equal(bits(out)[1:], bits(want)[1:], err_msg=msg)
    written = np.zeros(shape[:1] + (() if layer_index is None else (3,)) + (bs,), bool)
    if layer_index is None:
        written[slots // bs, slots % bs] = True
    else:
        written[slots // bs, layer_index, slots % bs] = True
    written[0] = True  # the null block is a sink: never compared
    np.testing.assert_array_equal(bits(out)[~written], bits(buf)[~written], err_msg=msg)
    np.testing.assert_array_equal(bits(out)[0], bits(buf)[0], err_msg=f"null block written ({msg})")


def test_write_kv_no_races(rng):
    bs, h, d, n = 4, 1, 8, 12
    buf = jnp.asarray(rng.standard_normal((n, bs, 2 * h, d)), jnp.float32)
    slots = random_slot_mapping(rng, n, bs)
    k, v = (jnp.asarray(rng.standard_normal((len(slots), h, d)), jnp.float32) for _ in range(2))
    out = kernels.write_kv(buf, k, v, jnp.asarray(slots), interpret=pltpu.InterpretParams(detect_races=True))
    want = ref.write_kv(buf, k, v, jnp.asarray(slots))
    np.testing.assert_array_equal(bits(out)[1:], bits(want)[1:])
    assert not mosaic_interpret.races.races_found


def test_full_block_runs_finds_aligned_runs_only():
    bs = 4
    slots = np.asarray([0, 8, 9, 10, 11, 12, 13, 14, 15, 1, 2, 3, 22, 23, 24, 25, 26, 27], np.int32)
    got = np.asarray(_full_block_runs(jnp.asarray(slots), bs))
    want = np.zeros(len(slots), np.int32)
    want[[1, 5, 14]] = 1  # blocks 2, 3 and 6; not the null block, nor 22, 23 (mid-block)
    np.testing.assert_array_equal(got, want)
    assert not np.asarray(_full_block_runs(jnp.asarray(slots[:3]), bs)).any()


# ---------------------------------------------------------------------------------------
# copy_blocks


def random_copy_pairs(rng: SeededRng, num_blocks: int, num_pairs: int, padding: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.permutation(np.arange(1, num_blocks))[: 2 * num_pairs]
    src, dst = ids[:num_pairs], ids[num_pairs:]
    src = np.concatenate([src, np.zeros(padding)]).astype(np.int32)
    dst = np.concatenate([dst, np.zeros(padding)]).astype(np.int32)
    order = rng.permutation(len(src))
    return src[order], dst[order]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_copy_blocks_matches_reference_and_touches_nothing_else(rng, dtype, layout):
    n, layers, bs, h, d = 12, 3, 4, 1, 8
    cross = rng.standard_normal((n, layers, bs, 2 * h, d))
    cross[rng.random(cross.shape) < 0.1] = np.nan
    cross = jnp.asarray(cross, dtype)
    buffers = (cross,) if layout == "cross_layer" else tuple(cross[:, i] for i in range(layers))
    src, dst = random_copy_pairs(rng, n, 4, padding=2)
    params = pltpu.InterpretParams(detect_races=layout == "cross_layer")
    out = kernels.copy_blocks(buffers, jnp.asarray(src), jnp.asarray(dst), interpret=params)
    want = ref.copy_blocks(buffers, jnp.asarray(src), jnp.asarray(dst))
    untouched = np.setdiff1d(np.arange(n), dst[src != dst])
    msg = f"seed={rng.seed}"
    assert len(out) == len(buffers)
    for o, w, b in zip(out, want, buffers, strict=False):
        np.testing.assert_array_equal(bits(o), bits(w), err_msg=msg)
        np.testing.assert_array_equal(bits(o)[untouched], bits(b)[untouched], err_msg=msg)
        np.testing.assert_array_equal(bits(o)[dst], bits(b)[src], err_msg=msg)
    assert not mosaic_interpret.races.races_found


def test_copy_states_matches_reference_over_buffers_of_any_shape_and_dtype(rng):
    n = 10
    buffers = tuple(
        jnp.asarray(rng.standard_normal((n, *shape)), dtype)
        for shape, dtype in (((4, 3), jnp.bfloat16), ((2, 8, 8), jnp.float32), ((5,), jnp.float32))
    )
    src, dst = random_copy_pairs(rng, n, 3, padding=2)
    params = pltpu.InterpretParams(detect_races=True)
    out = kernels.copy_states(buffers, jnp.asarray(src), jnp.asarray(dst), interpret=params)
    want = ref.copy_states(buffers, jnp.asarray(src), jnp.asarray(dst))
    msg = f"seed={rng.seed}"
    for o, w, b in zip(out, want, buffers, strict=False):
        assert o.shape == b.shape and o.dtype == b.dtype
        np.testing.assert_array_equal(bits(o), bits(w), err_msg=msg)
        np.testing.assert_array_equal(bits(o)[dst], bits(b)[src], err_msg=msg)
    assert not mosaic_interpret.races.races_found


def test_copy_states_rejects_bad_inputs():
    a, b = jnp.zeros((4, 3)), jnp.zeros((5, 3))
    ids = jnp.zeros((2,), jnp.int32)
    for buffers, src, dst in (
        ((), ids, ids),
        ((a, b), ids, ids),  # two row counts
        ((a,), ids, jnp.zeros((3,), jnp.int32)),
        ((a,), ids.astype(jnp.float32), ids),
    ):
        with pytest.raises(KVShapeError):
            kernels.copy_states(buffers, src, dst, interpret=INTERPRET)


def test_write_kv_rejects_bad_inputs():
    buffer = jnp.zeros((4, 4, 4, 8))  # per-layer: 2 KV heads of 8
    k = jnp.zeros((3, 2, 8))
    slots = jnp.zeros((3,), jnp.int32)
    for kk, vv, sm, match in (
        (k, jnp.zeros((3, 2, 4)), slots, r"must both be \(T, 2, 8\)"),
        (jnp.zeros((3, 1, 8)), jnp.zeros((3, 1, 8)), slots, r"must both be \(T, 2, 8\)"),
        (k, k, jnp.zeros((2,), jnp.int32), r"must be \(3,\)"),
        (k, k, slots.astype(jnp.float32), "must be int32"),
    ):
        with pytest.raises(KVShapeError, match=match):
            kernels.write_kv(buffer, kk, vv, sm, interpret=INTERPRET)


def test_copy_blocks_rejects_bad_inputs():
    a = jnp.zeros((4, 2, 4, 2, 8))
    ids = jnp.zeros((2,), jnp.int32)
    for buffers, src, dst in (
        ((), ids, ids),
        ((a, a), ids, ids),  # two cross-layer buffers
        ((a,), ids, jnp.zeros((3,), jnp.int32)),
        ((a,), ids.astype(jnp.float32), ids),
    ):
        with pytest.raises(KVShapeError):
            kernels.copy_blocks(buffers, src, dst, interpret=INTERPRET)


# ---------------------------------------------------------------------------------------
# Mosaic lowering (no TPU here: lower for the TPU platform and inspect)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kernels_lower_to_mosaic_with_aliased_cache(dtype):
    """Each kernel lowers to a Mosaic ``tpu_custom_call`` at TPU-tile-aligned shapes, and
    write/copy alias the cache input to the output (in place once donated)."""
    s = jax.ShapeDtypeStruct
    cross, per_layer = s((64, 4, 16, 8, 128), dtype), s((64, 16, 8, 128), dtype)
    meta = (s((8,), jnp.int32), s((8, 16), jnp.int32), s((9,), jnp.int32), s((1,), jnp.int32))

    def lower(f, *args) -> str:
        return jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()

    for kv, layer in ((per_layer, None), (cross, 2)):
        attn = functools.partial(
            kernels.paged_attention, layer_index=layer, sm_scale=0.1, sliding_window=32, soft_cap=30.0
        )
        assert "tpu_custom_call" in lower(attn, s((64, 16, 128), dtype), kv, *meta)
        write = functools.partial(kernels.write_kv, layer_index=layer)
        text = lower(write, kv, s((40, 4, 128), dtype), s((40, 4, 128), dtype), s((40,), jnp.int32))
        assert "tpu_custom_call" in text and "output_operand_alias" in text
    text = lower(kernels.copy_blocks, (cross,), s((5,), jnp.int32), s((5,), jnp.int32))
    assert "tpu_custom_call" in text and "output_operand_alias" in text


@pytest.mark.parametrize("knob", ["queries_per_tile", "pages_per_chunk", "vmem_limit_bytes"])
@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_a_bad_tuning_knob_is_refused_when_the_tuning_is_built(knob, bad):
    with pytest.raises(KVShapeError, match=f"AttentionTuning.{knob}"):
        AttentionTuning(**{knob: bad})
