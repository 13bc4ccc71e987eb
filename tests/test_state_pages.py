"""States kept in the KV pages (shared_pages): a unit's bytes read and written through its
blocks give what state rows give, in both cache layouts, and leave every other page alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.device.cache import UnknownLayerError, allocate_kv_cache
from jaxkv.device.mesh import model_mesh
from jaxkv.device.state_cache import allocate_state_cache, read_states, write_states
from jaxkv.device.state_pages import (
    SharedPagesError,
    StateUnits,
    check_mesh,
    gather_units,
    read_unit_states,
    scatter_units,
    state_pages,
    write_unit_states,
)
from jaxkv.planner import KVCacheConfig, PlanOptions, SharedStates, StatePool, plan_kv_cache
from jaxkv.specs import FullAttentionSpec, MambaSpec

SPECS = {
    "attn0": FullAttentionSpec(num_kv_heads=1, head_size=8),
    "m0": MambaSpec(shapes=((6, 3), (2, 4, 4)), dtypes=("bfloat16", "float32"), mamba_type="gated_delta_net"),
    "m1": MambaSpec(shapes=((6, 3), (2, 4, 4)), dtypes=("bfloat16", "float32"), mamba_type="gated_delta_net"),
    "attn1": FullAttentionSpec(num_kv_heads=1, head_size=8),
}
"""Blocks of 2 pages of 16 x 2 x 8 bfloat16 (1 KiB), states of 2 x 164 B: one block per state."""


def plan(layout: str, state_bytes: int | None = None) -> KVCacheConfig:
    config = plan_kv_cache(
        SPECS, 40 << 10, max_model_len=64, options=PlanOptions(layout=layout, state_layout="shared_pages")
    )
    if state_bytes is None:
        return config
    assert config.pages is not None
    k = -(-state_bytes // config.pages.block_bytes)
    return dataclasses.replace(config, states=SharedStates(pages_per_state=k, state_bytes=state_bytes))


def test_a_state_takes_the_blocks_its_bytes_need_and_each_tensor_a_packed_range():
    config = plan("cross_layer")
    pages = state_pages(config, allocate_kv_cache(config))
    assert config.shared_states == SharedStates(pages_per_state=1, state_bytes=2 * 164)
    assert [p.offset for _, places in pages.layers for p in places] == [0, 36, 164, 200]
    with pytest.raises(UnknownLayerError, match="'attn0'"):
        pages.places("attn0")


def random_values(rng: np.random.Generator, n: int) -> tuple[jax.Array, jax.Array]:
    return (
        jnp.asarray(rng.normal(size=(n, 6, 3)), jnp.bfloat16),
        jnp.asarray(rng.normal(size=(n, 2, 4, 4)), jnp.float32),
    )


@settings(max_examples=12, deadline=None)
@given(
    layout=st.sampled_from(["cross_layer", "per_layer"]),
    pages_per_state=st.integers(1, 3),
    writes=st.lists(
        st.tuples(st.sampled_from(["m0", "m1"]), st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True)),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 2**16),
)
def test_writes_read_back_as_from_state_rows_and_touch_no_other_page(layout, pages_per_state, writes, seed):
    """Four units of ``pages_per_state`` blocks (state bytes padded up to make several
    blocks) over random KV; any writes of any units read back as the same writes to four
    state rows do (another layer's write to a unit keeps this one's bytes), and the blocks
    no unit holds keep their KV."""
    config = plan(layout, state_bytes=(pages_per_state - 1) * 1024 + 2 * 164)
    kv = allocate_kv_cache(config)
    rng = np.random.default_rng(seed)
    kv = kv.replace(tuple(jnp.asarray(rng.normal(size=b.shape), b.dtype) for b in kv.buffers))
    before = [np.asarray(b) for b in kv.buffers]
    pages = state_pages(config, kv)
    units = np.arange(1, 1 + 4 * pages_per_state).reshape(4, pages_per_state)[::-1].copy()
    rows = allocate_state_cache(dataclasses.replace(config, states=StatePool(num_states=5)))
    written: dict[str, set[int]] = {"m0": set(), "m1": set()}
    for layer, which in writes:
        values = random_values(rng, len(which))
        kv = write_unit_states(kv, pages, layer, jnp.asarray(units[which]), values)
        rows = write_states(rows, layer, jnp.asarray(which) + 1, values)
        written[layer].update(which)
    for layer, which in written.items():
        ids = sorted(which)
        if not ids:
            continue
        got = read_unit_states(kv, pages, layer, jnp.asarray(units[ids]))
        want = read_states(rows, layer, jnp.asarray(ids) + 1)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    untouched = units.size + 1
    for b, old in zip(kv.buffers, before, strict=True):
        np.testing.assert_array_equal(np.asarray(b)[untouched:], old[untouched:])


def test_a_units_bytes_go_to_a_host_row_and_come_back_into_another_unit():
    config = plan("per_layer")
    kv = allocate_kv_cache(config)
    pages = state_pages(config, kv)
    values = random_values(np.random.default_rng(0), 1)
    kv = write_unit_states(kv, pages, "m1", jnp.array([[3]]), values)
    units = StateUnits(kv, pages)
    rows = gather_units(units, jnp.array([[3], [0]]))
    assert rows.shape == (2, 2 * 164) and rows.dtype == jnp.uint8
    units = scatter_units(units, jnp.array([[5], [0]]), rows)
    got = read_unit_states(units.kv, pages, "m1", jnp.array([[5]]))
    for g, w in zip(got, values, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_bad_writes_and_plans_are_typed_errors_naming_the_value():
    config = plan("cross_layer")
    kv = allocate_kv_cache(config)
    pages = state_pages(config, kv)
    with pytest.raises(SharedPagesError, match="holds 2 state tensors"):
        write_unit_states(kv, pages, "m0", jnp.array([[1]]), random_values(np.random.default_rng(0), 1)[:1])
    with pytest.raises(SharedPagesError, match="float32"):
        write_unit_states(kv, pages, "m0", jnp.array([[1]]), (jnp.zeros((1, 6, 3)), jnp.zeros((1, 2, 4, 4))))
    with pytest.raises(SharedPagesError, match="not 'shared_pages'"):
        state_pages(plan_kv_cache(SPECS, 1 << 20, max_model_len=64, options=PlanOptions(state_layout="state_pool")), kv)
    wide = MambaSpec(shapes=((6, 3), (2, 4, 40)), dtypes=("bfloat16", "float32"), mamba_type="gated_delta_net")
    big = plan_kv_cache(
        {**SPECS, "m0": wide, "m1": wide}, 1 << 20, max_model_len=64, options=PlanOptions(state_layout="shared_pages")
    )
    assert big.shared_states is not None and big.shared_states.pages_per_state == 3
    short = dataclasses.replace(big, states=dataclasses.replace(big.shared_states, pages_per_state=2))
    with pytest.raises(SharedPagesError, match="more than pages_per_state=2 blocks of 1024 B"):
        state_pages(short, allocate_kv_cache(short))


def test_a_mesh_splitting_the_pages_over_heads_is_refused_by_name():
    config = plan("cross_layer")
    check_mesh(config, model_mesh(1), "model")
    with pytest.raises(SharedPagesError, match=r"state_layout='shared_pages'.*'model' of 2 devices"):
        check_mesh(config, model_mesh(2), "model")
