"""jaxkv.pallas.xla's writes and block copies (scatters declared in-bounds with unique
indices) against the reference, in both layouts, with padding into the null block; and
jaxkv.device.ops dispatching to them for xla_gpu. The XLA attention is tested in test_ops.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import ops
from jaxkv.device.cache import KVCache, allocate_kv_cache
from jaxkv.device.metadata import attention_metadata
from jaxkv.pallas import reference as ref
from jaxkv.pallas import xla
from jaxkv.pallas.reference import KVShapeError
from jaxkv.planner import KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec

NUM_BLOCKS, LAYERS, BLOCK, HEADS, HEAD_DIM = 12, 3, 4, 2, 8


@pytest.fixture
def rng() -> np.random.Generator:
    """Fresh random data each run; the seed is printed (shown when a test fails)."""
    seed = np.random.SeedSequence().entropy
    print(f"numpy seed: {seed}")
    return np.random.default_rng(seed)


def buffer(rng, layout: str, dtype=jnp.float32) -> jax.Array:
    lead = (NUM_BLOCKS, LAYERS) if layout == "cross_layer" else (NUM_BLOCKS,)
    return jnp.asarray(rng.standard_normal((*lead, BLOCK, 2 * HEADS, HEAD_DIM)), dtype)


def slots_with_padding(rng, num_real: int, num_padding: int) -> jax.Array:
    """Distinct real slots outside the null block, then padding slots 0 (all the same)."""
    real = rng.choice(np.arange(BLOCK, NUM_BLOCKS * BLOCK), num_real, replace=False)
    return jnp.asarray(np.concatenate([real, np.zeros(num_padding, np.int64)]), jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout, layer_index", [("per_layer", None), ("cross_layer", 0), ("cross_layer", 2)])
def test_write_kv_matches_the_reference_outside_the_null_block(rng, layout, layer_index, dtype):
    kv_buffer = buffer(rng, layout, dtype)
    slots = slots_with_padding(rng, 9, 4)
    k, v = (jnp.asarray(rng.standard_normal((13, HEADS, HEAD_DIM)), jnp.float32) for _ in "kv")
    want = ref.write_kv(kv_buffer, k, v, slots, layer_index=layer_index)
    got = jax.jit(xla.write_kv, static_argnames="layer_index")(kv_buffer, k, v, slots, layer_index=layer_index)
    assert got.shape == want.shape and got.dtype == want.dtype
    # Block 0 is the padding sink: its content after racing padding writes is never read.
    np.testing.assert_array_equal(np.asarray(got[1:], np.float32), np.asarray(want[1:], np.float32))


@pytest.mark.parametrize("layout", ["per_layer", "cross_layer"])
def test_copy_blocks_matches_the_reference_with_padding_pairs(rng, layout):
    buffers = tuple(buffer(rng, layout) for _ in range(LAYERS if layout == "per_layer" else 1))
    ids = rng.permutation(np.arange(1, NUM_BLOCKS))[:6]
    src = jnp.asarray(np.concatenate([ids[:3], [0, 0]]), jnp.int32)
    dst = jnp.asarray(np.concatenate([ids[3:], [0, 0]]), jnp.int32)
    want = ref.copy_blocks(buffers, src, dst)
    got = jax.jit(xla.copy_blocks)(buffers, src, dst)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(KVShapeError, match=r"src \(2,\) and dst \(3,\)"):
        xla.copy_blocks(buffers, src[:2], dst[:3])


def test_copy_states_matches_the_reference_with_padding_pairs(rng):
    buffers = (jnp.asarray(rng.standard_normal((9, 4, 3)), jnp.bfloat16), jnp.asarray(rng.standard_normal((9, 6))))
    src = jnp.asarray([2, 5, 0, 0], jnp.int32)
    dst = jnp.asarray([7, 1, 0, 0], jnp.int32)
    want = ref.copy_states(buffers, src, dst)
    got = jax.jit(xla.copy_states)(buffers, src, dst)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
    with pytest.raises(KVShapeError, match="one row count"):
        xla.copy_states((buffers[0], buffers[1][:3]), src, dst)


def test_ops_dispatch_writes_and_copies_to_xla_in_place(rng, monkeypatch):
    spec = FullAttentionSpec(num_kv_heads=HEADS, head_size=HEAD_DIM, dtype="float32")
    layers = tuple(f"l{i}" for i in range(LAYERS))
    cache = allocate_kv_cache(KVCacheConfig(NUM_BLOCKS, (KVCacheGroup(layers, spec, BLOCK),)), layout="cross_layer")
    kv_buffer = buffer(rng, "cross_layer")
    cache = cache.replace((kv_buffer,))
    calls = []
    for name in ("write_kv", "copy_blocks"):
        monkeypatch.setattr(
            xla,
            name,
            lambda *a, _f=getattr(xla, name), _n=name, **kw: calls.append(_n) or _f(*a, **kw),  # noqa: B008
        )
    k = jnp.asarray(rng.standard_normal((5, HEADS, HEAD_DIM)), jnp.float32)
    slots = slots_with_padding(rng, 4, 1)
    written = set(np.asarray(slots) // BLOCK) - {0}
    fresh = min(set(range(1, NUM_BLOCKS)) - written)
    pair = jnp.asarray([min(written), 0], jnp.int32), jnp.asarray([fresh, 0], jnp.int32)  # copy-on-write, padding

    meta = attention_metadata(layers, [[1]], [1], [0, 1], [1], slots)

    def step(cache: KVCache, impl: str) -> KVCache:
        cache = ops.write_kv(cache, "l1", k, -k, meta, impl=impl)
        return ops.copy_blocks(cache, *pair, impl=impl)

    want = jax.jit(step, static_argnums=1)(cache, "reference")
    pointer = kv_buffer.unsafe_buffer_pointer()
    got = jax.jit(step, static_argnums=1, donate_argnums=0)(cache, "xla_gpu")
    assert calls == ["write_kv", "copy_blocks"]
    assert kv_buffer.is_deleted() and got.buffers[0].unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(np.asarray(got.buffers[0][1:]), np.asarray(want.buffers[0][1:]))
