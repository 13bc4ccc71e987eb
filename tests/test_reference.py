"""The plain jnp reference ops: paged attention against JAX's own ragged reference,
writes and block moves against numpy, both layouts."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention
from paged_batches import ragged_metadata

from jaxkv.pallas import reference as ref

BLOCK = 4
NUM_BLOCKS = 40
WIDTH = 5  # table width: 20 kv positions
MAX_SEQS = 8
NUM_TOKENS = 32
HEAD_DIM = 8


def ragged_batch(rng: np.random.Generator, seqs: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """Metadata for (q_len, kv_len) sequences (decodes first) at this file's fixed shapes."""
    return ragged_metadata(rng, seqs, block_size=BLOCK, num_blocks=NUM_BLOCKS, width=WIDTH, max_seqs=MAX_SEQS)


# Decodes (partial block, exactly one block, several blocks), then prefills: fresh,
# chunk continuing inside a block, chunk ending on a block boundary; padding after.
MIXED = [(1, 1), (1, 4), (1, 13), (1, 20), (7, 7), (3, 10), (4, 16)]


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh random data each run; the seed is printed (shown when a test fails)."""
    seed = np.random.SeedSequence().entropy
    print(f"numpy seed: {seed}")
    return np.random.default_rng(seed)


def random_inputs(rng, num_q_heads, num_kv_heads, dtype, seqs=MIXED):
    q = rng.standard_normal((NUM_TOKENS, num_q_heads, HEAD_DIM))
    kv = rng.standard_normal((NUM_BLOCKS, BLOCK, 2 * num_kv_heads, HEAD_DIM))
    batch = {k: jnp.asarray(v) for k, v in ragged_batch(rng, seqs).items()}
    return jnp.asarray(q, dtype), jnp.asarray(kv, dtype), batch


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "layer_index"))
def attention(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, **kw):
    return ref.paged_attention(q, kv, kv_lens, block_tables, cu_q_lens, num_seqs, **kw)


def jax_oracle(q, kv, batch, **kw) -> np.ndarray:
    """JAX's ragged reference, jitted with the lengths as constants (it loops over them)."""
    lens = {k: np.asarray(batch[k]) for k in ("kv_lens", "cu_q_lens", "num_seqs")}

    def run(q, kv, tables):
        with jax.default_matmul_precision("highest"):  # GPUs default fp32 matmuls to TF32
            return ref_ragged_paged_attention(q, kv, lens["kv_lens"], tables, lens["cu_q_lens"], lens["num_seqs"], **kw)

    tables = batch["block_tables"]
    # The oracle unrolls its loop over sequences; compiling it unoptimised halves the time.
    compiled = jax.jit(run).lower(q, kv, tables).compile({"xla_backend_optimization_level": 0})
    return np.asarray(compiled(q, kv, tables).astype(jnp.float32))


# GQA ratios 1/2/4 x windows: none, smaller than a block, a block minus one, exactly
# one block, two blocks; soft-cap on and off. One compile per case keeps this fast.
FP32_CASES = [
    (2, None, None),
    (4, 1, 3.0),
    (8, 3, None),
    (4, 4, None),
    (2, 8, 3.0),
    (8, None, 3.0),
]


@pytest.mark.parametrize("num_q_heads,sliding_window,soft_cap", FP32_CASES)
def test_paged_attention_matches_jax_reference_fp32(num_q_heads, sliding_window, soft_cap, rng):
    q, kv, batch = random_inputs(rng, num_q_heads, 2, jnp.float32)
    kw = {"sm_scale": HEAD_DIM**-0.5, "sliding_window": sliding_window, "soft_cap": soft_cap}
    out = np.asarray(attention(q, kv, **batch, **kw))
    total = int(batch["cu_q_lens"][-1])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:total], jax_oracle(q, kv, batch, **kw), atol=1e-5, rtol=1e-5)
    assert not out[total:].any(), "padding token rows must be zeros"


def test_paged_attention_matches_jax_reference_bf16(rng):
    q, kv, batch = random_inputs(rng, 4, 2, jnp.bfloat16)
    kw = {"sm_scale": HEAD_DIM**-0.5, "sliding_window": 4, "soft_cap": 5.0}
    out = attention(q, kv, **batch, **kw)
    assert out.dtype == jnp.bfloat16
    out = np.asarray(out.astype(jnp.float32))
    total = int(batch["cu_q_lens"][-1])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[:total], jax_oracle(q, kv, batch, **kw), atol=1e-2, rtol=1e-2)


def test_paged_attention_empty_batch_and_zero_length_sequences(rng):
    q, kv, batch = random_inputs(rng, 4, 2, jnp.float32, seqs=[(1, 9), (0, 5), (2, 2)])
    out = np.asarray(attention(q, kv, **batch, sm_scale=1.0))
    want = jax_oracle(q, kv, batch, sm_scale=1.0)
    np.testing.assert_allclose(out[:3], want, atol=1e-5, rtol=1e-5)
    assert not out[3:].any()
    q, kv, batch = random_inputs(rng, 4, 2, jnp.float32, seqs=[])
    out = attention(q, kv, **batch, sm_scale=1.0)
    assert not np.asarray(out).any()


def test_cross_layer_buffer_gives_the_per_layer_result(rng):
    q, _, batch = random_inputs(rng, 4, 2, jnp.float32)
    cross = jnp.asarray(rng.standard_normal((NUM_BLOCKS, 3, BLOCK, 4, HEAD_DIM)), jnp.float32)
    kw = {"sm_scale": 0.5, "sliding_window": 6}
    per_layer = attention(q, cross[:, 2], **batch, **kw)
    in_place = attention(q, cross, **batch, layer_index=2, **kw)
    np.testing.assert_array_equal(np.asarray(in_place), np.asarray(per_layer))


def test_paged_attention_rejects_bad_shapes(rng):
    q, kv, batch = random_inputs(rng, 3, 2, jnp.float32)
    with pytest.raises(ref.KVShapeError, match=r"\(32, 3, 8\)"):
        ref.paged_attention(q, kv, **batch, sm_scale=1.0)
    q, kv, batch = random_inputs(rng, 2, 2, jnp.float32)
    with pytest.raises(ref.KVShapeError, match="layer_index=0"):
        ref.paged_attention(q, kv, **batch, sm_scale=1.0, layer_index=0)
    with pytest.raises(ref.KVShapeError, match="sliding_window must be positive, got 0"):
        ref.paged_attention(q, kv, **batch, sm_scale=1.0, sliding_window=0)


# --------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("layer_index", [None, 1])
def test_write_kv_touches_only_its_slots(layer_index, rng):
    heads, tokens = 2, 12
    shape = (NUM_BLOCKS, BLOCK, 2 * heads, HEAD_DIM)
    if layer_index is not None:
        shape = (NUM_BLOCKS, 3, BLOCK, 2 * heads, HEAD_DIM)
    before = rng.standard_normal(shape).astype(np.float32)
    real = 9
    slots = np.zeros(tokens, np.int32)  # padding tokens write slot 0 of the null block
    slots[:real] = rng.choice(np.arange(BLOCK, NUM_BLOCKS * BLOCK), real, replace=False)
    k = rng.standard_normal((tokens, heads, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((tokens, heads, HEAD_DIM)).astype(np.float32)
    write = jax.jit(functools.partial(ref.write_kv, layer_index=layer_index))
    after = np.asarray(write(jnp.asarray(before), k, v, slots))

    def page(buf: np.ndarray) -> np.ndarray:
        return buf if layer_index is None else buf[:, layer_index]

    block, offset = slots[:real] // BLOCK, slots[:real] % BLOCK
    written = page(after)[block, offset]
    np.testing.assert_array_equal(written[:, 0::2], k[:real])
    np.testing.assert_array_equal(written[:, 1::2], v[:real])
    expected = before.copy()
    if layer_index is None:
        expected[block, offset] = written
    else:
        expected[block, layer_index, offset] = written
    # Everything but the written slots and the null block is bit-identical.
    np.testing.assert_array_equal(after[1:], expected[1:])
    if layer_index is not None:
        other = [s for s in range(3) if s != layer_index]
        np.testing.assert_array_equal(after[0, other], before[0, other])


def test_write_kv_casts_to_the_buffer_dtype():
    buf = jnp.zeros((4, BLOCK, 2, HEAD_DIM), jnp.bfloat16)
    k = jnp.full((1, 1, HEAD_DIM), 1.5, jnp.float32)
    out = ref.write_kv(buf, k, -k, jnp.array([5], jnp.int32))
    assert out.dtype == jnp.bfloat16
    assert float(out[1, 1, 0, 0]) == 1.5 and float(out[1, 1, 1, 0]) == -1.5


# ------------------------------------------------------------- copy / gather / scatter


def block_buffers(rng, layout: str) -> tuple[jax.Array, ...]:
    cross = rng.standard_normal((NUM_BLOCKS, 3, BLOCK, 2, HEAD_DIM)).astype(np.float32)
    if layout == "cross_layer":
        return (jnp.asarray(cross),)
    return tuple(jnp.asarray(cross[:, s]) for s in range(3))


def as_blocks(buffers) -> np.ndarray:
    """(num_blocks, layers, ...) whatever the layout."""
    if len(buffers) == 1:
        return np.asarray(buffers[0])
    return np.stack([np.asarray(b) for b in buffers], axis=1)


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_copy_blocks_leaves_untouched_blocks_bit_identical(layout, rng):
    buffers = block_buffers(rng, layout)
    before = as_blocks(buffers)
    perm = rng.permutation(np.arange(1, NUM_BLOCKS))
    dst, src = perm[:6], perm[3:9]  # sources overlap destinations: copies read old data
    src_p = np.concatenate([src, [0, 0]]).astype(np.int32)  # padded with 0 -> 0
    dst_p = np.concatenate([dst, [0, 0]]).astype(np.int32)
    after = as_blocks(jax.jit(ref.copy_blocks)(buffers, src_p, dst_p))
    expected = before.copy()
    expected[dst] = before[src]
    np.testing.assert_array_equal(after, expected)


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_gather_scatter_round_trip(layout, rng):
    buffers = block_buffers(rng, layout)
    before = as_blocks(buffers)
    ids = rng.choice(np.arange(1, NUM_BLOCKS), 5, replace=False).astype(np.int32)
    got = np.asarray(jax.jit(ref.gather_blocks)(buffers, ids))
    assert got.shape == (5, 3, BLOCK, 2, HEAD_DIM)
    np.testing.assert_array_equal(got, before[ids])
    # scatter(gather(ids)) changes nothing; gather(scatter(data)) gives the data back.
    np.testing.assert_array_equal(as_blocks(ref.scatter_blocks(buffers, ids, got)), before)
    data = rng.standard_normal(got.shape).astype(np.float32)
    written = jax.jit(ref.scatter_blocks)(buffers, ids, data)
    np.testing.assert_array_equal(np.asarray(ref.gather_blocks(written, ids)), data)
    expected = before.copy()
    expected[ids] = data
    np.testing.assert_array_equal(as_blocks(written), expected)


def test_cross_layer_gather_is_one_contiguous_slice_per_block(rng):
    (buffer,) = block_buffers(rng, "cross_layer")
    ids = jnp.array([7, 2], jnp.int32)
    got = ref.gather_blocks((buffer,), ids)
    # All layers' pages of a block sit together: the block is buffer[id], a C-contiguous
    # sub-array of block_bytes (leading axis = block id), not a per-layer gather.
    assert got.shape == (2, *buffer.shape[1:])
    host = np.asarray(buffer)
    assert host[7].flags.c_contiguous and host[7].nbytes == host.nbytes // NUM_BLOCKS
    np.testing.assert_array_equal(np.asarray(got), host[np.asarray(ids)])
    jaxpr = jax.make_jaxpr(ref.gather_blocks)((buffer,), ids)
    (gather,) = [e for e in jaxpr.eqns if e.primitive.name == "gather"]
    assert gather.params["slice_sizes"] == (1, *buffer.shape[1:])


def test_block_ops_reject_mismatched_buffers():
    one = jnp.zeros(1, jnp.int32)
    with pytest.raises(ref.KVShapeError, match="per-layer buffers of one shape"):
        ref.copy_blocks((jnp.zeros((2, 4, 2, 8)), jnp.zeros((3, 4, 2, 8))), one, one)
    with pytest.raises(ref.KVShapeError, match=r"data \(1, 2, 4, 2, 8\)"):
        ref.scatter_blocks((jnp.zeros((2, 4, 2, 8)),), one, jnp.zeros((1, 2, 4, 2, 8)))
