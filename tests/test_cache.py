"""jaxkv.device.cache: allocation in both layouts, the pytree, in-place donation, sharding."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import ops
from jaxkv.device.cache import (
    KVCache,
    KVCacheShardingError,
    UnknownLayerError,
    UnsupportedLayoutError,
    allocate_kv_cache,
)
from jaxkv.device.metadata import attention_metadata
from jaxkv.planner import KVCacheConfig, KVCacheGroup, PlanOptions, plan_kv_cache
from jaxkv.presets import get_preset
from jaxkv.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, MLASpec, SlidingWindowSpec


def spec(cls=FullAttentionSpec, **kw):
    return cls(num_kv_heads=2, head_size=16, dtype=kw.pop("dtype", "float32"), **kw)


def hand_config(num_blocks: int = 10) -> KVCacheConfig:
    """Three groups of uneven size: layer index 1 is used by groups 0 and 2 only."""
    return KVCacheConfig(
        num_blocks=num_blocks,
        groups=(
            KVCacheGroup(("a0", "a1"), spec(), 8),
            KVCacheGroup(("b0",), spec(SlidingWindowSpec, sliding_window=4), 8),
            KVCacheGroup(("c0", "c1"), spec(ChunkedLocalAttentionSpec, attention_chunk_size=8), 8),
        ),
    )


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_allocate_hand_built_config(layout):
    cache = allocate_kv_cache(hand_config(), layout=layout)
    assert cache.layout == layout
    assert dict(cache.layer_indices) == {"a0": 0, "b0": 0, "c0": 0, "a1": 1, "c1": 1}
    assert (cache.num_blocks, cache.num_layers_per_block, cache.block_size) == (10, 2, 8)
    assert (cache.num_kv_heads, cache.head_dim, cache.dtype) == (2, 16, jnp.float32)
    if layout == "cross_layer":
        assert [b.shape for b in cache.buffers] == [(10, 2, 8, 4, 16)]
    else:
        assert [b.shape for b in cache.buffers] == [(10, 8, 4, 16)] * 2
    assert cache.nbytes == 10 * 2 * 8 * 4 * 16 * 4
    assert not any(np.asarray(b).any() for b in cache.buffers)
    assert cache.layer_buffer("c1")[1] == (1 if layout == "cross_layer" else None)


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_allocate_planned_tiny_hybrid(layout):
    config = plan_kv_cache(get_preset("tiny-hybrid"), 1 << 20, max_model_len=64, options=PlanOptions(layout=layout))
    cache = allocate_kv_cache(config)
    assert cache.layout == layout
    layers = config.pages.num_layers_per_block
    assert cache.num_layers_per_block == layers
    page = (config.groups[0].block_size, 4, 64)
    if layout == "cross_layer":
        assert [b.shape for b in cache.buffers] == [(config.num_blocks, layers, *page)]
    else:
        assert [b.shape for b in cache.buffers] == [(config.num_blocks, *page)] * layers
    assert cache.nbytes == config.num_blocks * config.pages.block_bytes
    for name in get_preset("tiny-hybrid"):
        assert cache.layer_index(name) == config.pages.layer_index(name)
    assert allocate_kv_cache(config, dtype="bfloat16").dtype == jnp.bfloat16


def test_layout_override_and_default():
    config = plan_kv_cache(get_preset("tiny-hybrid"), 1 << 20, max_model_len=64)
    assert allocate_kv_cache(config, layout="per_layer").layout == "per_layer"
    assert allocate_kv_cache(hand_config()).layout == "cross_layer"
    with pytest.raises(UnsupportedLayoutError, match="'diagonal'"):
        allocate_kv_cache(config, layout="diagonal")


def test_pytree_round_trip_keeps_static_fields():
    cache = allocate_kv_cache(hand_config(), layout="per_layer")
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    assert len(leaves) == 2 and all(isinstance(x, jax.Array) for x in leaves)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, KVCache)
    assert (again.layout, again.layer_indices, again.block_size) == (cache.layout, cache.layer_indices, 8)
    doubled = jax.tree_util.tree_map(lambda x: x + 1, cache)
    assert doubled.layer_indices == cache.layer_indices and float(doubled.buffers[1][0, 0, 0, 0]) == 1


def test_unknown_layer_is_a_typed_error():
    cache = allocate_kv_cache(hand_config())
    with pytest.raises(UnknownLayerError, match="'zz'"):
        cache.layer_index("zz")


@pytest.mark.parametrize(
    "odd,match",
    [
        (MLASpec(kv_lora_rank=8, qk_rope_head_dim=8), "MLASpec"),
        (FullAttentionSpec(num_kv_heads=4, head_size=16, dtype="float32"), "num_kv_heads=4"),
        (FullAttentionSpec(num_kv_heads=2, head_size=16, dtype="bfloat16"), "bfloat16"),
    ],
)
def test_unsupported_specs_raise_naming_the_spec(odd, match):
    config = KVCacheConfig(num_blocks=4, groups=(KVCacheGroup(("a",), spec(), 8), KVCacheGroup(("b",), odd, 8)))
    with pytest.raises(UnsupportedLayoutError, match=match) as err:
        allocate_kv_cache(config)
    assert "'b'" in str(err.value)


def test_under_vllms_rule_recurrent_pages_keep_their_place_but_hold_no_state():
    config = plan_kv_cache(
        get_preset("tiny-mamba-hybrid"), 1 << 22, max_model_len=64, options=PlanOptions(state_layout="attention_pages")
    )
    cache = allocate_kv_cache(config)
    assert cache.block_size == 32 and cache.nbytes == config.num_blocks * config.pages.block_bytes
    assert cache.num_kv_heads == 2, "the attention groups' heads: states live in a StateCache"


def test_mixed_block_sizes_are_unsupported():
    config = KVCacheConfig(num_blocks=4, groups=(KVCacheGroup(("a",), spec(), 8), KVCacheGroup(("b",), spec(), 16)))
    with pytest.raises(UnsupportedLayoutError, match="block_size 16"):
        allocate_kv_cache(config)


def test_a_state_pool_plan_allocates_pages_for_its_attention_groups_only():
    config = plan_kv_cache(
        get_preset("tiny-mamba-hybrid"), 1 << 22, max_model_len=64, options=PlanOptions(state_layout="state_pool")
    )
    cache = allocate_kv_cache(config)
    attention = {n for g in config.attention_groups for n in g.layer_names}
    assert {name for name, _ in cache.layer_indices} == attention and len(attention) == 2
    assert cache.block_size == 16 and cache.nbytes == config.num_blocks * config.pages.block_bytes
    state = MambaSpec(shapes=((4, 8),), dtypes=("float32",))
    states_only = plan_kv_cache(
        {"m0": state, "m1": state}, 1 << 16, max_model_len=64, options=PlanOptions(state_layout="state_pool")
    )
    with pytest.raises(UnsupportedLayoutError, match="all 1 group\\(s\\) are recurrent \\(first layer 'm0'\\)"):
        allocate_kv_cache(states_only)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="asserts the CPU backend's memory_analysis figures")
@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_donated_write_is_in_place(layout):
    config = KVCacheConfig(num_blocks=256, groups=(KVCacheGroup(("a", "b"), spec(), 16),))
    cache = allocate_kv_cache(config, layout=layout)
    k = jnp.ones((8, 2, 16), jnp.float32)
    slots = attention_metadata(("a", "b"), [[1]], [8], [0, 8], [1], np.arange(16, 24))

    def step(cache, k, slots):
        cache = ops.write_kv(cache, "b", k, -k, slots)
        return ops.copy_blocks(cache, jnp.array([1], jnp.int32), jnp.array([2], jnp.int32))

    donated = jax.jit(step, donate_argnums=0).lower(cache, k, slots).compile().memory_analysis()
    copied = jax.jit(step).lower(cache, k, slots).compile().memory_analysis()
    # On CPU (jax 0.10) memory_analysis reports the aliased output bytes: donated, every
    # cache buffer aliases its output and no temporary is anywhere near a buffer's size;
    # without donation nothing is aliased (the output is a second cache).
    buffer_bytes = cache.buffers[0].nbytes
    assert donated.alias_size_in_bytes == cache.nbytes
    assert donated.output_size_in_bytes - donated.alias_size_in_bytes < 1024
    assert donated.temp_size_in_bytes < buffer_bytes // 8
    assert copied.alias_size_in_bytes == 0
    assert copied.output_size_in_bytes >= cache.nbytes

    pointers = [b.unsafe_buffer_pointer() for b in cache.buffers]
    out = jax.jit(step, donate_argnums=0)(cache, k, slots)
    assert all(b.is_deleted() for b in cache.buffers)
    assert [b.unsafe_buffer_pointer() for b in out.buffers] == pointers
    blocks = np.asarray(ops.gather_blocks(out, jnp.array([1], jnp.int32)))
    assert (blocks[0, 1, :8, 0::2] == 1).all() and (blocks[0, 1, :8, 1::2] == -1).all()
    assert not blocks[0, 1, 8:].any() and not blocks[0, 0].any()


@pytest.mark.parametrize("layout", ["cross_layer", "per_layer"])
def test_one_device_mesh_shards_the_kv_head_axis(layout):
    mesh = jax.make_mesh((1,), ("model",))
    cache = allocate_kv_cache(hand_config(), layout=layout, mesh=mesh)
    for buffer in cache.buffers:
        assert buffer.sharding.spec[-2] == "model" and buffer.sharding.mesh == mesh
    out = jax.jit(ops.write_kv, static_argnums=1, donate_argnums=0)(
        cache,
        "a1",
        jnp.ones((1, 2, 16)),
        jnp.ones((1, 2, 16)),
        attention_metadata(("a1",), [[2]], [2], [0, 1], [1], [9]),
    )
    assert out.buffers[0].sharding.spec[-2] == "model"


def test_sharding_errors_name_the_problem():
    mesh = jax.make_mesh((1,), ("data",))
    with pytest.raises(KVCacheShardingError, match="'model'"):
        allocate_kv_cache(hand_config(), mesh=mesh)


@pytest.mark.subprocess
def test_heads_are_split_whole_across_devices():
    # The multi-device rule, on 4 forced CPU devices in a child process: 2 KV heads
    # shard over 2 devices (one K/V pair each) but not over 4 (K and V would split);
    # a jitted write and attention on the sharded cache give the unsharded result.
    code = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np
        from jaxkv import ops
        from jaxkv.device.cache import allocate_kv_cache, KVCacheShardingError
        from jaxkv.device.metadata import attention_metadata
        from jaxkv.planner import KVCacheConfig, KVCacheGroup
        from jaxkv.specs import FullAttentionSpec
        spec = FullAttentionSpec(num_kv_heads=2, head_size=8, dtype="float32")
        config = KVCacheConfig(num_blocks=4, groups=(KVCacheGroup(("a",), spec, 4),))
        mesh = jax.make_mesh((2, 2), ("data", "model"))
        cache = allocate_kv_cache(config, mesh=mesh)
        shards = cache.buffers[0].addressable_shards
        assert {s.data.shape for s in shards} == {(4, 1, 4, 2, 8)}, shards
        try:
            allocate_kv_cache(config, mesh=jax.make_mesh((4,), ("model",)))
        except KVCacheShardingError as err:
            assert "num_kv_heads=2" in str(err), err
        else:
            raise AssertionError("4-way split of 2 heads accepted")
        rng = np.random.default_rng(0)
        k, v = (jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32) for _ in "kv")
        q = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
        meta = attention_metadata(("a",), [[1, 2], [0, 0]], [6, 0], [0, 3, 3], [1], [7, 8, 9])

        def step(cache, impl):
            cache = ops.write_kv(cache, "a", k, v, meta)
            return ops.paged_attention(q, cache, "a", meta, sm_scale=0.3, impl=impl)

        want = jax.jit(step, static_argnums=1)(allocate_kv_cache(config), "reference")
        for impl in ("reference", "xla_gpu"):
            got = jax.jit(step, static_argnums=1)(cache, impl)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)
        print("ok")
        """
    )
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
