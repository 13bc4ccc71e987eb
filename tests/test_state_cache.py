"""StateCache: recurrent state rows on device, per layout; reads, writes and row copies."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import ops
from jaxkv.device.cache import UnknownLayerError
from jaxkv.device.state_cache import StateCacheError, allocate_state_cache, num_state_rows, read_states, write_states
from jaxkv.planner import KVCacheConfig, KVCacheGroup, PlanOptions, StatePool, plan_kv_cache
from jaxkv.specs import FullAttentionSpec, MambaSpec

ATTENTION = KVCacheGroup(("attn",), FullAttentionSpec(num_kv_heads=1, head_size=8), 16)
GDN = MambaSpec(shapes=((6, 3), (2, 4, 4)), dtypes=("bfloat16", "float32"), mamba_type="gated_delta_net")
POOLED = KVCacheConfig(
    num_blocks=12, groups=(ATTENTION, KVCacheGroup(("m0", "m1"), GDN, 16)), states=StatePool(num_states=5)
)


def test_rows_are_state_slots_with_a_pool_and_block_ids_without():
    cache = allocate_state_cache(POOLED)
    assert cache.layer_names == ("m0", "m1") and cache.num_rows == num_state_rows(POOLED) == 5
    assert [(b.shape, b.dtype) for b in cache.layer_states("m1")] == [
        ((5, 6, 3), jnp.bfloat16),
        ((5, 2, 4, 4), jnp.float32),
    ]
    assert allocate_state_cache(dataclasses.replace(POOLED, states=None)).num_rows == 12
    assert cache.nbytes == 2 * 5 * (6 * 3 * 2 + 2 * 4 * 4 * 4)


def test_written_rows_read_back_and_other_rows_stay_zero():
    cache = allocate_state_cache(POOLED)
    conv = jnp.arange(2 * 6 * 3, dtype=jnp.bfloat16).reshape(2, 6, 3)
    state = jnp.ones((2, 2, 4, 4), jnp.float32)
    cache = jax.jit(write_states, static_argnums=1, donate_argnums=0)(cache, "m0", jnp.array([3, 1]), (conv, state))
    got = read_states(cache, "m0", jnp.array([1, 3, 2]))
    np.testing.assert_array_equal(np.asarray(got[0][:2], np.float32), np.asarray(conv[::-1], np.float32))
    assert (
        float(jnp.abs(got[1][2]).sum()) == 0 and float(jnp.abs(read_states(cache, "m1", jnp.arange(5))[1]).sum()) == 0
    )


def test_bad_writes_and_layers_are_typed_errors_naming_the_value():
    cache = allocate_state_cache(POOLED)
    rows = jnp.array([1])
    with pytest.raises(StateCacheError, match="holds 2 state tensors"):
        write_states(cache, "m0", rows, (jnp.zeros((1, 6, 3), jnp.bfloat16),))
    with pytest.raises(StateCacheError, match="float16"):
        write_states(cache, "m0", rows, (jnp.zeros((1, 6, 3), jnp.float16), jnp.zeros((1, 2, 4, 4))))
    with pytest.raises(UnknownLayerError, match="'attn'"):
        read_states(cache, "attn", rows)
    with pytest.raises(StateCacheError, match="no recurrent"):
        allocate_state_cache(KVCacheConfig(num_blocks=4, groups=(ATTENTION,)))


@pytest.mark.parametrize("impl", ["reference", "xla_gpu", "pallas_tpu"])
def test_copy_states_copies_a_checkpoint_row_in_every_layer(impl):
    cache = allocate_state_cache(POOLED)
    for layer, fill in (("m0", 1.0), ("m1", 2.0)):
        values = (jnp.full((1, 6, 3), fill, jnp.bfloat16), jnp.full((1, 2, 4, 4), fill, jnp.float32))
        cache = write_states(cache, layer, jnp.array([2]), values)
    src, dst = jnp.array([2, 0], jnp.int32), jnp.array([4, 0], jnp.int32)
    copied = jax.jit(ops.copy_states, static_argnames="impl", donate_argnums=0)(cache, src, dst, impl=impl)
    for layer, fill in (("m0", 1.0), ("m1", 2.0)):
        conv, state = read_states(copied, layer, jnp.array([4, 3]))
        assert float(conv[0].astype(jnp.float32).min()) == fill and float(state[0].max()) == fill
        assert float(jnp.abs(state[1]).sum()) == 0


def test_a_shared_pages_plan_has_no_state_rows_to_allocate():
    specs = {
        "attn": FullAttentionSpec(num_kv_heads=1, head_size=8),
        "m0": MambaSpec(shapes=((4,),), dtypes=("float32",)),
    }
    config = plan_kv_cache(specs, 1 << 20, max_model_len=64, options=PlanOptions(state_layout="shared_pages"))
    with pytest.raises(StateCacheError, match="shared_pages"):
        allocate_state_cache(config)
