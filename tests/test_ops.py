"""jaxkv.device.ops: dispatch by backend and override (what ``auto`` picks: test_auto.py),
ops on KVCache objects, the xla_gpu attention (jaxkv.pallas.xla) against the reference,
NaN in unread cache positions for every implementation, and heads zero-padded to a
tile-aligned cache."""

from __future__ import annotations

import functools
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from paged_batches import ragged_metadata

from jaxkv import ops
from jaxkv.device.cache import KVCache, UnknownLayerError, allocate_kv_cache
from jaxkv.device.metadata import attention_metadata
from jaxkv.pallas import reference as ref
from jaxkv.pallas import xla
from jaxkv.pallas.reference import KVShapeError
from jaxkv.planner import TPU_HEAD_DIM_MULTIPLE, KVCacheConfig, KVCacheGroup, PlanOptions, plan_kv_cache
from jaxkv.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

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


GROUP_OF = {"l0": ("l0", "l2"), "l2": ("l0", "l2"), "l1": ("l1", "l3"), "l3": ("l1", "l3")}
"""The layers of each layer's group in :func:`config`."""
ONE_DECODE = ([[1, 2]], [5], [0, 1], [1])
"""Block table, kv lens, cu_q_lens and num_seqs of one decode."""
BACKEND_DEFAULT = ops.get_implementation("auto")
"""What ``auto`` means on this backend: the setting the tests below come back to."""


def random_cache(rng, layout: str):
    cache = allocate_kv_cache(config(), layout=layout)
    return cache.replace(tuple(jnp.asarray(rng.standard_normal(b.shape), b.dtype) for b in cache.buffers))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU backend's default implementation")
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
    assert ops.get_implementation() == BACKEND_DEFAULT
    restore = ops.set_implementation("xla_gpu")
    try:
        seen = []
        thread = threading.Thread(target=lambda: seen.append(ops.get_implementation()))
        thread.start()
        thread.join()
        assert seen == ["xla_gpu"], "the setting is process-wide"
    finally:
        restore.__exit__(None, None, None)
    assert ops.get_implementation() == BACKEND_DEFAULT


def test_unknown_implementation_is_a_typed_error():
    with pytest.raises(ops.UnknownImplementationError, match="'triton'"):
        ops.set_implementation("triton")
    with pytest.raises(ops.UnknownImplementationError, match="'cuda'"):
        ops.get_implementation("cuda")
    assert ops.get_implementation() == BACKEND_DEFAULT


def test_missing_tpu_kernels_give_a_clear_error(monkeypatch):
    monkeypatch.setattr(ops, "_TPU_KERNELS", "jaxkv.pallas.no_such_kernels")
    cache = allocate_kv_cache(config())
    k = jnp.zeros((1, 2, HEAD_DIM))
    with pytest.raises(ops.KernelUnavailableError, match=r"jaxkv\.pallas\.no_such_kernels\.write_kv"):
        ops.write_kv(cache, "l0", k, k, attention_metadata(("l0",), *ONE_DECODE, np.zeros(1)), impl="pallas_tpu")


def test_pallas_tpu_dispatch_passes_layer_index_and_interpret(monkeypatch):
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
        cache = ops.write_kv(cache, "l3", k, k, attention_metadata(("l1", "l3"), *ONE_DECODE, np.array([5])))
        ops.copy_blocks(cache, jnp.array([1], jnp.int32), jnp.array([2], jnp.int32))
    with ops.set_implementation("pallas_tpu", interpret=True):
        ops.paged_attention(
            jnp.ones((1, 2, HEAD_DIM)), cache, "l2", attention_metadata(("l0", "l2"), *ONE_DECODE), sm_scale=1.0
        )
    from jax.experimental.pallas import tpu as pltpu

    (write, write_kw), (copy, _copy_kw), (attn, attn_kw) = calls
    assert (write, copy, attn) == ("write_kv", "copy_blocks", "paged_attention")
    assert write_kw["layer_index"] == 1 and attn_kw["layer_index"] == 1
    assert isinstance(write_kw["interpret"], pltpu.InterpretParams), "interpret mode off TPU"
    assert attn_kw["interpret"] is True and attn_kw["sliding_window"] == 5


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_ops_on_a_cache_match_the_reference(layout, rng):
    cache = random_cache(rng, layout)
    before = [np.asarray(b) for b in cache.buffers]
    k = jnp.asarray(rng.standard_normal((3, 2, HEAD_DIM)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((3, 2, HEAD_DIM)), jnp.float32)
    slots = jnp.array([9, 10, 0], jnp.int32)
    out = jax.jit(ops.write_kv, static_argnums=1)(cache, "l2", k, v, attention_metadata(("l2",), *ONE_DECODE, slots))
    layer_index = 1
    if layout == "cross_layer":
        expected = ref.write_kv(jnp.asarray(before[0]), k, v, slots, layer_index=layer_index)
        np.testing.assert_array_equal(np.asarray(out.buffers[0]), np.asarray(expected))
    else:
        expected = ref.write_kv(jnp.asarray(before[layer_index]), k, v, slots)
        np.testing.assert_array_equal(np.asarray(out.buffers[layer_index]), np.asarray(expected))
        np.testing.assert_array_equal(np.asarray(out.buffers[0]), before[0])
    assert out.layout == cache.layout and out.layer_indices == cache.layer_indices

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
    meta = {
        "block_tables": jnp.array([[3, 0, 0], [5, 6, 0]], jnp.int32),
        "kv_lens": jnp.array([2, 7], jnp.int32),
        "cu_q_lens": jnp.array([0, 1, 4], jnp.int32),
        "num_seqs": jnp.array([2], jnp.int32),
    }
    step = attention_metadata(("l0", "l2"), **meta)
    buffer, layer_index = out.layer_buffer("l2")

    @jax.jit
    def both(q, cache, buffer, step):
        got = ops.paged_attention(q, cache, "l2", step, sm_scale=0.3)
        want = ref.paged_attention(
            q,
            buffer,
            meta["kv_lens"],
            meta["block_tables"],
            meta["cu_q_lens"],
            meta["num_seqs"],
            layer_index=layer_index,
            sm_scale=0.3,
            sliding_window=5,  # l2's window, from the cache's spec
        )
        return got, want

    got, want = both(q, out, buffer, step)
    # ``auto`` is the reference on CPU, the XLA formulation for this float32 cache on GPU
    # (sums in another order: ~1 ulp);
    # a wrong layer or window would be off by O(1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------- xla_gpu attention (jaxkv.pallas.xla)


@functools.partial(jax.jit, static_argnames=("impl", "sm_scale", "sliding_window", "soft_cap", "layer_index"))
def attend(impl, q, kv, tables, kv_lens, cu, num_seqs, **kw):
    if impl == "xla_gpu":
        return xla.paged_attention(q, kv, kv_lens, tables, cu, num_seqs, chunk_tokens=8, **kw)
    return ref.paged_attention(q, kv, kv_lens, tables, cu, num_seqs, **kw)


@pytest.mark.parametrize(
    "num_q_heads,sliding_window,soft_cap,layer_index,dtype",
    [
        (2, None, None, None, jnp.float32),
        (4, 3, 4.0, 1, jnp.float32),
        (8, 8, None, None, jnp.float32),
        (4, 4, None, 0, jnp.bfloat16),
    ],
)
def test_xla_gpu_attention_matches_the_reference(num_q_heads, sliding_window, soft_cap, layer_index, dtype, rng):
    # Chunks of 2 blocks over a width of 7: the online softmax spans several chunks,
    # the last one padded; decodes, prefill chunks, an empty sequence and padding.
    seqs = [(1, 1), (1, 9), (1, 27), (0, 6), (6, 6), (5, 17), (4, 28)]
    meta = ragged_metadata(rng, seqs, block_size=BLOCK, num_blocks=40, width=7, max_seqs=9)
    tables, kv_lens, cu, num_seqs = (meta[k] for k in ("block_tables", "kv_lens", "cu_q_lens", "num_seqs"))
    assert cu[-1] <= 24
    shape = (40, BLOCK, 4, HEAD_DIM) if layer_index is None else (40, 2, BLOCK, 4, HEAD_DIM)
    kv = jnp.asarray(rng.standard_normal(shape), dtype)
    q = jnp.asarray(rng.standard_normal((24, num_q_heads, HEAD_DIM)), dtype)
    kw = {"sm_scale": 0.4, "sliding_window": sliding_window, "soft_cap": soft_cap, "layer_index": layer_index}
    got = attend("xla_gpu", q, kv, tables, kv_lens, cu, num_seqs, **kw)
    want = attend("reference", q, kv, tables, kv_lens, cu, num_seqs, **kw)
    assert got.dtype == dtype
    got, want = np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32))
    assert np.isfinite(got).all()
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    assert not got[int(cu[-1]) :].any()


def test_xla_gpu_attention_with_nothing_scheduled():
    attention = jax.jit(functools.partial(xla.paged_attention, sm_scale=1.0))
    out = attention(
        jnp.ones((4, 2, HEAD_DIM)),
        jnp.ones((6, BLOCK, 4, HEAD_DIM)),
        jnp.zeros(2, jnp.int32),
        jnp.zeros((2, 3), jnp.int32),
        jnp.zeros(3, jnp.int32),
        jnp.array([0], jnp.int32),
    )
    assert not np.asarray(out).any()


# ------------------------------------------------- NaN where no query may look


def poison_unread(cache: KVCache, layer: str, meta: dict[str, np.ndarray], window: int | None) -> KVCache:
    """``cache`` with NaN at every position no query of ``meta`` may read through ``layer``:
    other layers' pages, the null block, unused blocks (other requests' data), positions
    past each kv length and before each query's window."""
    ids = jnp.arange(cache.num_blocks, dtype=jnp.int32)
    blocks = np.array(ops.gather_blocks(cache, ids))  # (N, L, bs, 2H, D)
    readable = np.zeros(blocks.shape[:3], bool)
    index = cache.layer_index(layer)
    q_lens = np.diff(meta["cu_q_lens"])
    for i in range(int(meta["num_seqs"][0])):
        kv_len, q_len = int(meta["kv_lens"][i]), int(q_lens[i])
        first = kv_len - q_len - (window or kv_len) + 1  # the first query's window start
        for p in range(max(first, 0), kv_len if q_len else 0):
            readable[meta["block_tables"][i, p // BLOCK], index, p % BLOCK] = True
    blocks[~readable] = np.nan
    return ops.scatter_blocks(cache, ids, jnp.asarray(blocks))


@pytest.mark.parametrize("layout,layer,window", [("cross_layer", "l2", 5), ("per_layer", "l3", None)])
@pytest.mark.parametrize("impl", ["reference", "xla_gpu", "pallas_tpu"])
def test_nan_where_no_query_may_look_never_reaches_the_output(impl, layout, layer, window, rng):
    """Masking selects, never multiplies (0 * NaN is NaN): a cache holding NaN wherever no
    query may look gives the finite result of a clean cache, for every implementation."""
    if impl == "pallas_tpu":
        pytest.importorskip("jaxkv.pallas.tpu")  # runs interpreted off TPU
    # Decodes, an empty run, prefill chunks; two padded sequences and 3 padding tokens.
    seqs = [(1, 1), (1, 9), (0, 6), (6, 6), (5, 17)]
    meta = ragged_metadata(rng, seqs, block_size=BLOCK, num_blocks=24, width=5, max_seqs=7)
    clean = random_cache(rng, layout)
    poisoned = poison_unread(clean, layer, meta, window)
    assert np.isnan(np.asarray(poisoned.buffers[0])).any()
    q = jnp.asarray(rng.standard_normal((16, 4, HEAD_DIM)), jnp.float32)
    step = attention_metadata(GROUP_OF[layer], **meta)

    @functools.partial(jax.jit, static_argnums=0)
    def attend(impl, cache):
        return ops.paged_attention(q, cache, layer, step, sm_scale=0.3, impl=impl)

    got = np.asarray(attend(impl, poisoned))
    assert np.isfinite(got).all(), f"NaN reached rows {np.unique(np.nonzero(~np.isfinite(got))[0])}"
    np.testing.assert_allclose(got, np.asarray(attend(impl, clean)), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(got, np.asarray(attend("reference", clean)), atol=1e-5, rtol=1e-5)
    assert not got[13:].any(), "padding rows are zeros"


def test_pallas_tpu_kernels_through_ops_in_interpret_mode(rng):
    pytest.importorskip("jaxkv.pallas.tpu")
    spec = SlidingWindowSpec(num_kv_heads=2, head_size=128, dtype="float32", sliding_window=6)
    cache = allocate_kv_cache(
        KVCacheConfig(num_blocks=8, groups=(KVCacheGroup(("a", "b"), spec, 8),)),
        layout="cross_layer",
    )
    cache = cache.replace((jnp.asarray(rng.standard_normal(cache.buffers[0].shape), jnp.float32),))
    k = jnp.asarray(rng.standard_normal((8, 2, 128)), jnp.float32)  # 4 real, 4 padding tokens
    q = jnp.asarray(rng.standard_normal((8, 4, 128)), jnp.float32)
    meta = attention_metadata(
        ("a", "b"), [[2, 3], [4, 0], [0, 0]], [11, 3, 0], [0, 1, 4, 4], [2], [17, 18, 19, 0], num_tokens=8
    )

    @functools.partial(jax.jit, static_argnums=0)
    def step(impl, cache, k, q):
        out = ops.write_kv(cache, "b", k, -k, meta, impl=impl)
        src, dst = jnp.array([2, 0], jnp.int32), jnp.array([5, 0], jnp.int32)
        out = ops.copy_blocks(out, src, dst, impl=impl)
        attn = ops.paged_attention(q, out, "b", meta, sm_scale=0.1, impl=impl)
        return out.buffers[0], attn

    results = {}
    for impl in ("reference", "pallas_tpu"):  # pallas_tpu runs interpreted off TPU
        results[impl] = tuple(np.asarray(x) for x in step(impl, cache, k, q))
    (ref_cache, ref_attn), (tpu_cache, tpu_attn) = results["reference"], results["pallas_tpu"]
    np.testing.assert_array_equal(tpu_cache[1:], ref_cache[1:])  # block 0 takes padding writes
    np.testing.assert_allclose(tpu_attn, ref_attn, atol=1e-5, rtol=1e-5)


def bf16_cache(rng, head_size: int = 64) -> KVCache:
    spec = SlidingWindowSpec(num_kv_heads=1, head_size=head_size, dtype="bfloat16", sliding_window=20)
    cache = allocate_kv_cache(
        KVCacheConfig(num_blocks=8, groups=(KVCacheGroup(("a", "b"), spec, 16),)), layout="cross_layer"
    )
    return cache.replace((jnp.asarray(rng.standard_normal(cache.buffers[0].shape), jnp.bfloat16),))


GPU_META = attention_metadata(
    ("a", "b"),
    [[2, 3], [4, 0], [0, 0]],  # block tables
    [27, 3, 0],  # kv lens
    [0, 1, 4, 4],  # cu_q_lens
    [2],  # num_seqs
    [33, 34, 35, 0],  # slots
    num_tokens=8,
)


def test_pallas_gpu_through_ops_matches_the_reference(rng):
    """The Mosaic GPU kernel (interpreted off GPU) for attention, XLA's writes and copies."""
    cache = bf16_cache(rng)
    k = jnp.asarray(rng.standard_normal((8, 1, 64)), jnp.bfloat16)  # 4 real, 4 padding tokens
    q = jnp.asarray(rng.standard_normal((8, 4, 64)), jnp.bfloat16)

    @functools.partial(jax.jit, static_argnums=0)
    def step(impl, cache, k, q):
        out = ops.write_kv(cache, "b", k, -k, GPU_META, impl=impl)
        out = ops.copy_blocks(out, jnp.array([2, 0], jnp.int32), jnp.array([5, 0], jnp.int32), impl=impl)
        return out.buffers[0], ops.paged_attention(q, out, "b", GPU_META, sm_scale=0.125, impl=impl)

    (ref_cache, ref_attn), (gpu_cache, gpu_attn) = (
        tuple(np.asarray(x, np.float32) for x in step(impl, cache, k, q)) for impl in ("reference", "pallas_gpu")
    )
    np.testing.assert_array_equal(gpu_cache[1:], ref_cache[1:])
    np.testing.assert_allclose(gpu_attn, ref_attn, atol=1e-2, rtol=1e-2)


def test_the_gpu_kernel_asked_for_by_name_refuses_shapes_its_tiles_do_not_fit(rng):
    """By name there is no fallback (``auto`` falls back: tests/test_auto.py)."""
    cache = random_cache(rng, "per_layer")  # float32, head dim 8: not the kernel's
    meta = ragged_metadata(rng, [(1, 7), (3, 9)], block_size=BLOCK, num_blocks=24, width=5, max_seqs=3)
    meta = attention_metadata(GROUP_OF["l1"], **meta)
    q = jnp.asarray(rng.standard_normal((4, 4, HEAD_DIM)), jnp.float32)
    with pytest.raises(KVShapeError, match="bf16 or fp16"):
        ops.paged_attention(q, cache, "l1", meta, sm_scale=0.3, impl="pallas_gpu")


@pytest.mark.parametrize(
    "op", ["write_kv", "paged_attention", "copy_blocks", "copy_states", "gather_blocks", "scatter_blocks"]
)
def test_every_op_runs_under_a_named_scope(op):
    assert getattr(ops, op).__wrapped__.__name__ == op


def test_an_op_is_labelled_by_name_in_the_lowered_program(rng):
    cache = random_cache(rng, "cross_layer")
    src, dst = jnp.asarray([1], jnp.int32), jnp.asarray([2], jnp.int32)
    lowered = jax.jit(lambda c: ops.copy_blocks(c, src, dst, impl="reference")).lower(cache)
    assert "jaxkv.copy_blocks" in lowered.as_text(debug_info=True)


# ---------------------------------------------------------------- tile alignment

LOGICAL_HEAD = 64
TILE_SPECS = {
    f"l{i}": SlidingWindowSpec(num_kv_heads=2, head_size=LOGICAL_HEAD, dtype="float32", sliding_window=5)
    if i % 2 == 0
    else FullAttentionSpec(num_kv_heads=2, head_size=LOGICAL_HEAD, dtype="float32")
    for i in range(4)
}


def tile_cache(head_dim_multiple: int, layout: str):
    """A zeroed cache planned for heads of 64, padded to ``head_dim_multiple``."""
    plan = plan_kv_cache(
        TILE_SPECS,
        1 << 30,
        max_model_len=32,
        options=PlanOptions(
            block_size=BLOCK, layout=layout, num_blocks_override=24, head_dim_multiple=head_dim_multiple
        ),
    )
    return allocate_kv_cache(plan)


def history_slots(meta: dict[str, np.ndarray], seqs: list[tuple[int, int]], pad_to: int) -> np.ndarray:
    """Global slots of every kv position of every sequence, then padding into the null block."""
    slots = [
        meta["block_tables"][i, p // BLOCK] * BLOCK + p % BLOCK
        for i, (_, kv_len) in enumerate(seqs)
        for p in range(kv_len)
    ]
    return np.array(slots + [0] * (pad_to - len(slots)), np.int32)


def write_then_attend(impl, cache, k, v, q, meta):
    """Write K/V into the sliding-window layer l0 (window 5), then attend through it."""
    cache = ops.write_kv(cache, "l0", k, v, meta, impl=impl)
    out = ops.paged_attention(q, cache, "l0", meta, sm_scale=1 / np.sqrt(LOGICAL_HEAD), impl=impl)
    return cache, out


jit_write_then_attend = jax.jit(write_then_attend, static_argnums=0)


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
@pytest.mark.parametrize("impl", ["reference", "xla_gpu", "pallas_tpu"])
def test_heads_of_64_in_a_cache_padded_to_128_lanes_give_the_unpadded_results(impl, layout, rng):
    if impl == "pallas_tpu":
        pytest.importorskip("jaxkv.pallas.tpu")  # runs interpreted off TPU
    # Two decodes and a prefill chunk of a longer sequence, GQA 4:2, padding rows.
    seqs = [(1, 9), (1, 30), (7, 19)]
    meta = ragged_metadata(rng, seqs, block_size=BLOCK, num_blocks=24, width=8, max_seqs=4)
    slots = history_slots(meta, seqs, pad_to=64)
    k, v = (jnp.asarray(rng.standard_normal((64, 2, LOGICAL_HEAD)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((12, 4, LOGICAL_HEAD)), jnp.float32)
    meta = attention_metadata(("l0", "l2"), **meta, slot_mapping=slots)

    plain = tile_cache(1, layout)
    tiled = tile_cache(TPU_HEAD_DIM_MULTIPLE, layout)
    assert (plain.head_dim, tiled.head_dim) == (LOGICAL_HEAD, 128)
    plain_cache, want = jit_write_then_attend(impl, plain, k, v, q, meta)
    tiled_cache, got = jit_write_then_attend(impl, tiled, k, v, q, meta)

    assert got.shape == want.shape == q.shape
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all() and got[:9].any() and not got[9:].any()  # 9 real tokens
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    for padded, unpadded in zip(tiled_cache.buffers, plain_cache.buffers, strict=True):
        padded, unpadded = np.asarray(padded), np.asarray(unpadded)
        assert not padded[..., LOGICAL_HEAD:].any(), "padded head columns stay exactly zero"
        np.testing.assert_array_equal(padded[1:, ..., :LOGICAL_HEAD], unpadded[1:])  # block 0: padding
    assert np.asarray(plain_cache.buffers[0])[1:].any(), "l0 (layer index 0) was written"


def primitive_names(jaxpr) -> set[str]:
    """Every primitive of a jaxpr, nested jaxprs (jit, loops, conds) included."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    names |= primitive_names(sub)
    return names


def test_equal_head_dims_trace_no_pad_and_smaller_ones_are_padded():
    # The reference traces no pad of its own, so any pad here is the ops' alignment.
    impl = "reference"
    meta = ragged_metadata(np.random.default_rng(), [(1, 3)], block_size=BLOCK, num_blocks=24, width=8, max_seqs=2)
    meta = attention_metadata(("l0", "l2"), **meta, num_tokens=8)

    def traced(cache) -> set[str]:
        x = jnp.ones((8, 2, LOGICAL_HEAD))
        step = functools.partial(write_then_attend, impl, meta=meta)
        return primitive_names(jax.make_jaxpr(step)(cache, k=x, v=x, q=x).jaxpr)

    assert "pad" not in traced(tile_cache(1, "cross_layer"))
    assert "pad" in traced(tile_cache(TPU_HEAD_DIM_MULTIPLE, "cross_layer"))


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_a_head_dim_larger_than_the_cache_is_refused_and_the_cache_kept(layout, rng):
    cache = tile_cache(TPU_HEAD_DIM_MULTIPLE, layout)
    cache = cache.replace(tuple(jnp.asarray(rng.standard_normal(b.shape), b.dtype) for b in cache.buffers))
    before = [np.asarray(b) for b in cache.buffers]
    slots = attention_metadata(("l0", "l2"), *ONE_DECODE, np.array([5, 6]))
    write = jax.jit(ops.write_kv, static_argnums=1, donate_argnums=0)
    big = jnp.ones((2, 2, 130))
    too_big = r"k \(2, 2, 130\) has head dim 130, larger than the cache's head_dim 128"
    with pytest.raises(KVShapeError, match=too_big):
        write(cache, "l0", big, big, slots)
    with pytest.raises(KVShapeError, match=r"k \(2, 2, 64\) and v \(2, 2, 32\)"):
        write(cache, "l0", jnp.ones((2, 2, 64)), jnp.ones((2, 2, 32)), slots)
    meta = ragged_metadata(rng, [(2, 6)], block_size=BLOCK, num_blocks=24, width=8, max_seqs=2)
    with pytest.raises(KVShapeError, match="head dim 129, larger than the cache's head_dim 128"):
        ops.paged_attention(jnp.ones((2, 4, 129)), cache, "l1", attention_metadata(("l1", "l3"), **meta), sm_scale=1.0)
    assert not any(b.is_deleted() for b in cache.buffers), "nothing was donated"
    for b, old in zip(cache.buffers, before, strict=True):
        np.testing.assert_array_equal(np.asarray(b), old)


# ---------------------------------------------------- what the cache supplies


def test_a_layer_unknown_to_the_cache_or_to_the_metadata_is_refused(rng):
    cache = random_cache(rng, "cross_layer")
    meta = attention_metadata(GROUP_OF["l0"], *ONE_DECODE, np.array([5]))
    k = jnp.ones((1, 2, HEAD_DIM))
    with pytest.raises(UnknownLayerError, match="layer 'l9' has no page in this cache"):
        ops.write_kv(cache, "l9", k, k, meta)
    with pytest.raises(UnknownLayerError, match="layer 'l1' is in no KV cache group of this step's metadata"):
        ops.paged_attention(jnp.ones((1, 4, HEAD_DIM)), cache, "l1", meta, sm_scale=1.0)


def test_each_layer_attends_within_the_window_of_its_own_spec(rng):
    """l2 (window 5) and l3 (full) over the same pages: each is the reference with its own window."""
    cache = random_cache(rng, "per_layer")
    cache = cache.replace((cache.buffers[1], cache.buffers[1]))  # index 1 holds l2 and l3
    meta = ragged_metadata(rng, [(1, 11), (4, 9)], block_size=BLOCK, num_blocks=24, width=5, max_seqs=2)
    q = jnp.asarray(rng.standard_normal((5, 4, HEAD_DIM)), jnp.float32)
    buffer, _ = cache.layer_buffer("l2")
    args = (q, buffer, *(jnp.asarray(meta[k]) for k in ("kv_lens", "block_tables", "cu_q_lens", "num_seqs")))
    for layer, window in (("l2", 5), ("l3", None)):
        got = ops.paged_attention(q, cache, layer, attention_metadata(GROUP_OF[layer], **meta), sm_scale=0.3)
        want = ref.paged_attention(*args, sm_scale=0.3, sliding_window=window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    full = ref.paged_attention(*args, sm_scale=0.3)
    assert not np.allclose(np.asarray(full), np.asarray(ref.paged_attention(*args, sm_scale=0.3, sliding_window=5)))


def test_chunked_local_attention_is_refused_rather_than_run_as_full_attention():
    spec = ChunkedLocalAttentionSpec(num_kv_heads=2, head_size=HEAD_DIM, dtype="float32", attention_chunk_size=8)
    cache = allocate_kv_cache(KVCacheConfig(num_blocks=8, groups=(KVCacheGroup(("c",), spec, BLOCK),)))
    meta = attention_metadata(("c",), *ONE_DECODE)
    with pytest.raises(ops.UnsupportedAttentionError, match="layer 'c' has spec ChunkedLocalAttentionSpec"):
        ops.paged_attention(jnp.ones((1, 4, HEAD_DIM)), cache, "c", meta, sm_scale=1.0)
