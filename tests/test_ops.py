"""jaxkv.ops: dispatch by backend and override, ops on KVCache objects, and the
xla_gpu attention against the reference."""

from __future__ import annotations

import functools
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ragged_metadata

from jaxkv import ops
from jaxkv.cache import allocate_kv_cache
from jaxkv.pallas import reference as ref
from jaxkv.planner import KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec, SlidingWindowSpec

BLOCK = 4
HEAD_DIM = 8


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh random data each run; the seed is printed (shown when a test fails)."""
    seed = np.random.SeedSequence().entropy
    print(f"numpy seed: {seed}")
    return np.random.default_rng(seed)


def config(num_blocks: int = 24) -> KVCacheConfig:
    full = FullAttentionSpec(num_kv_heads=2, head_size=HEAD_DIM, dtype="float32")
    local = SlidingWindowSpec(num_kv_heads=2, head_size=HEAD_DIM, dtype="float32", sliding_window=5)
    return KVCacheConfig(
        num_blocks=num_blocks,
        groups=(KVCacheGroup(("l0", "l2"), local, BLOCK), KVCacheGroup(("l1", "l3"), full, BLOCK)),
    )


def random_cache(rng, layout: str):
    cache = allocate_kv_cache(config(), layout=layout)
    return cache.replace(
        tuple(jnp.asarray(rng.standard_normal(b.shape), b.dtype) for b in cache.buffers)
    )


def test_auto_picks_the_reference_on_cpu():
    assert jax.default_backend() == "cpu"
    assert ops.get_implementation() == "reference"
    assert ops.get_implementation("xla_gpu") == "xla_gpu"


def test_set_implementation_statement_and_context_manager():
    with ops.set_implementation("xla_gpu"):
        assert ops.get_implementation() == "xla_gpu"
        with ops.set_implementation("reference"):
            assert ops.get_implementation() == "reference"
        assert ops.get_implementation() == "xla_gpu"
    assert ops.get_implementation() == "reference"
    restore = ops.set_implementation("xla_gpu")
    try:
        seen = []
        thread = threading.Thread(target=lambda: seen.append(ops.get_implementation()))
        thread.start()
        thread.join()
        assert seen == ["xla_gpu"], "the setting is process-wide"
    finally:
        restore.__exit__(None, None, None)
    assert ops.get_implementation() == "reference"


def test_unknown_implementation_is_a_typed_error():
    with pytest.raises(ops.UnknownImplementationError, match="'triton'"):
        ops.set_implementation("triton")
    with pytest.raises(ops.UnknownImplementationError, match="'cuda'"):
        ops.get_implementation("cuda")
    assert ops.get_implementation() == "reference"


def test_missing_tpu_kernels_give_a_clear_error(monkeypatch):
    monkeypatch.setattr(ops, "_TPU_KERNELS", "jaxkv.pallas.no_such_kernels")
    cache = allocate_kv_cache(config())
    k = jnp.zeros((1, 2, HEAD_DIM))
    with pytest.raises(ops.KernelUnavailableError, match="jaxkv.pallas.no_such_kernels.write_kv"):
        ops.write_kv(cache, "l0", k, k, jnp.zeros(1, jnp.int32), impl="pallas_tpu")


def test_pallas_tpu_dispatch_passes_layer_slot_and_interpret(monkeypatch):
    calls = []

    def fake(name):
        def kernel(*args, **kwargs):
            calls.append((name, kwargs))
            return args[0]  # the buffer(s) for writes and copies, q for attention

        return kernel

    module = types.ModuleType("fake_tpu_kernels")
    for name in ("write_kv", "paged_attention", "copy_blocks"):
        setattr(module, name, fake(name))
    monkeypatch.setitem(sys.modules, "fake_tpu_kernels", module)
    monkeypatch.setattr(ops, "_TPU_KERNELS", "fake_tpu_kernels")
    cache = allocate_kv_cache(config(), layout="cross_layer")
    k = jnp.ones((1, 2, HEAD_DIM))
    with ops.set_implementation("pallas_tpu"):
        cache = ops.write_kv(cache, "l3", k, k, jnp.array([5], jnp.int32))
        ops.copy_blocks(cache, jnp.array([1], jnp.int32), jnp.array([2], jnp.int32))
    with ops.set_implementation("pallas_tpu", interpret=True):
        ops.paged_attention(
            jnp.ones((1, 2, HEAD_DIM)), cache, "l2", jnp.ones((1, 2), jnp.int32),
            jnp.array([5], jnp.int32), jnp.array([0, 1], jnp.int32), jnp.array([1], jnp.int32),
            sm_scale=1.0, sliding_window=5,
        )
    from jax.experimental.pallas import tpu as pltpu

    (write, write_kw), (copy, copy_kw), (attn, attn_kw) = calls
    assert (write, copy, attn) == ("write_kv", "copy_blocks", "paged_attention")
    assert write_kw["layer_slot"] == 1 and attn_kw["layer_slot"] == 1
    assert isinstance(write_kw["interpret"], pltpu.InterpretParams), "interpret mode off TPU"
    assert attn_kw["interpret"] is True and attn_kw["sliding_window"] == 5


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_ops_on_a_cache_match_the_reference(layout, rng):
    cache = random_cache(rng, layout)
    before = [np.asarray(b) for b in cache.buffers]
    k = jnp.asarray(rng.standard_normal((3, 2, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 2, HEAD_DIM)), jnp.float32)
    slots = jnp.array([9, 10, 0], jnp.int32)
    out = jax.jit(ops.write_kv, static_argnums=1)(cache, "l2", k, v, slots)
    layer_slot = 1
    if layout == "cross_layer":
        expected = ref.write_kv(jnp.asarray(before[0]), k, v, slots, layer_slot=layer_slot)
        np.testing.assert_array_equal(np.asarray(out.buffers[0]), np.asarray(expected))
    else:
        expected = ref.write_kv(jnp.asarray(before[layer_slot]), k, v, slots)
        np.testing.assert_array_equal(np.asarray(out.buffers[layer_slot]), np.asarray(expected))
        np.testing.assert_array_equal(np.asarray(out.buffers[0]), before[0])
    assert out.kind == cache.kind and out.slot_of == cache.slot_of

    ids = jnp.array([3, 7], jnp.int32)
    blocks = ops.gather_blocks(out, ids)
    assert blocks.shape == (2, 2, BLOCK, 4, HEAD_DIM)
    copied = ops.copy_blocks(out, ids, jnp.array([11, 12], jnp.int32))
    np.testing.assert_array_equal(
        np.asarray(ops.gather_blocks(copied, jnp.array([11, 12], jnp.int32))), np.asarray(blocks)
    )
    back = ops.scatter_blocks(cache, ids, blocks)
    np.testing.assert_array_equal(np.asarray(ops.gather_blocks(back, ids)), np.asarray(blocks))

    q = jnp.asarray(rng.standard_normal((4, 4, HEAD_DIM)), jnp.float32)
    meta = dict(
        block_tables=jnp.array([[3, 0, 0], [5, 6, 0]], jnp.int32),
        kv_lens=jnp.array([2, 7], jnp.int32),
        cu_q_lens=jnp.array([0, 1, 4], jnp.int32),
        num_seqs=jnp.array([2], jnp.int32),
    )
    buffer, slot = out.layer_buffer("l2")

    @jax.jit
    def both(q, cache, buffer):
        got = ops.paged_attention(q, cache, "l2", **meta, sm_scale=0.3)
        want = ref.paged_attention(
            q, buffer, meta["kv_lens"], meta["block_tables"], meta["cu_q_lens"],
            meta["num_seqs"], layer_slot=slot, sm_scale=0.3,
        )
        return got, want

    got, want = both(q, out, buffer)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----------------------------------------------------------------- xla_gpu attention


@functools.partial(
    jax.jit, static_argnames=("impl", "sm_scale", "sliding_window", "soft_cap", "layer_slot")
)
def attend(impl, q, kv, tables, kv_lens, cu, num_seqs, **kw):
    if impl == "xla_gpu":
        return ops.xla_paged_attention(q, kv, kv_lens, tables, cu, num_seqs, chunk_tokens=8, **kw)
    return ref.paged_attention(q, kv, kv_lens, tables, cu, num_seqs, **kw)


@pytest.mark.parametrize(
    "num_q_heads,sliding_window,soft_cap,layer_slot,dtype",
    [
        (2, None, None, None, jnp.float32),
        (4, 3, 4.0, 1, jnp.float32),
        (8, 8, None, None, jnp.float32),
        (4, 4, None, 0, jnp.bfloat16),
    ],
)
def test_xla_gpu_attention_matches_the_reference(
    num_q_heads, sliding_window, soft_cap, layer_slot, dtype, rng
):
    # Chunks of 2 blocks over a width of 7: the online softmax spans several chunks,
    # the last one padded; decodes, prefill chunks, an empty sequence and padding.
    seqs = [(1, 1), (1, 9), (1, 27), (0, 6), (6, 6), (5, 17), (4, 28)]
    meta = ragged_metadata(rng, seqs, block_size=BLOCK, num_blocks=40, width=7, max_seqs=9)
    tables, kv_lens, cu, num_seqs = (meta[k] for k in ("block_tables", "kv_lens", "cu_q_lens", "num_seqs"))
    assert cu[-1] <= 24
    shape = (40, BLOCK, 4, HEAD_DIM) if layer_slot is None else (40, 2, BLOCK, 4, HEAD_DIM)
    kv = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((24, num_q_heads, HEAD_DIM)), dtype)
    kw = dict(sm_scale=0.4, sliding_window=sliding_window, soft_cap=soft_cap, layer_slot=layer_slot)
    got = attend("xla_gpu", q, kv, tables, kv_lens, cu, num_seqs, **kw)
    want = attend("reference", q, kv, tables, kv_lens, cu, num_seqs, **kw)
    assert got.dtype == dtype
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.isfinite(got).all()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    assert not got[int(cu[-1]) :].any()


def test_xla_gpu_attention_with_nothing_scheduled():
    attention = jax.jit(functools.partial(ops.xla_paged_attention, sm_scale=1.0))
    out = attention(
        jnp.ones((4, 2, HEAD_DIM)), jnp.ones((6, BLOCK, 4, HEAD_DIM)), jnp.zeros(2, jnp.int32),
        jnp.zeros((2, 3), jnp.int32), jnp.zeros(3, jnp.int32), jnp.array([0], jnp.int32),
    )
    assert not np.asarray(out).any()


def test_pallas_tpu_kernels_through_ops_in_interpret_mode(rng):
    pytest.importorskip("jaxkv.pallas.tpu")
    spec = FullAttentionSpec(num_kv_heads=2, head_size=128, dtype="float32")
    cache = allocate_kv_cache(
        KVCacheConfig(num_blocks=8, groups=(KVCacheGroup(("a", "b"), spec, 8),)),
        layout="cross_layer",
    )
    cache = cache.replace((jnp.asarray(rng.standard_normal(cache.buffers[0].shape), jnp.float32),))
    k = jnp.asarray(rng.standard_normal((4, 2, 128)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((8, 4, 128)), jnp.float32)
    meta = (
        jnp.array([[2, 3], [4, 0], [0, 0]], jnp.int32), jnp.array([11, 3, 0], jnp.int32),
        jnp.array([0, 1, 4, 4], jnp.int32), jnp.array([2], jnp.int32),
    )

    @functools.partial(jax.jit, static_argnums=0)
    def step(impl, cache, k, q):
        out = ops.write_kv(cache, "b", k, -k, jnp.array([17, 18, 19, 0], jnp.int32), impl=impl)
        src, dst = jnp.array([2, 0], jnp.int32), jnp.array([5, 0], jnp.int32)
        out = ops.copy_blocks(out, src, dst, impl=impl)
        attn = ops.paged_attention(q, out, "b", *meta, sm_scale=0.1, sliding_window=6, impl=impl)
        return out.buffers[0], attn

    results = {}
    for impl in ("reference", "pallas_tpu"):  # pallas_tpu runs interpreted off TPU
        results[impl] = tuple(np.asarray(x) for x in step(impl, cache, k, q))
    (ref_cache, ref_attn), (tpu_cache, tpu_attn) = results["reference"], results["pallas_tpu"]
    np.testing.assert_array_equal(tpu_cache[1:], ref_cache[1:])  # block 0 takes padding writes
    np.testing.assert_allclose(tpu_attn, ref_attn, atol=1e-5, rtol=1e-5)
