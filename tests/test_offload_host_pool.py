"""The host buffer: memory kinds, generation counters, rows read back as copies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.offload.host_pool import (
    HostKVPool,
    HostPoolError,
    blocks_in_budget,
    pinned_host_supported,
)


def test_blocks_in_budget():
    assert blocks_in_budget(1000, 300) == 3
    with pytest.raises(HostPoolError, match="299"):
        blocks_in_budget(299, 300)


def test_cpu_jax_has_pinned_host():
    """CPU jax 0.10 exposes pinned_host memory and computes on it."""
    assert pinned_host_supported(jax.devices("cpu")[0])
    pool = HostKVPool(2, (1, 2), np.float32)
    assert pool.memory_kind == "pinned_host"
    assert pool.buffer.sharding.memory_kind == "pinned_host"


def test_unknown_memory_kind_raises():
    with pytest.raises(HostPoolError, match="'unpinned_host'"):
        HostKVPool(2, (1, 2), np.float32, memory_kind="unpinned_host")


def test_generations_bump_per_writer_and_release():
    pool = HostKVPool(3, (1,), np.float32, memory_kind="numpy")
    first = pool.bump([1, 2, 0])
    assert first.tolist() == [1, 1, 0]  # the scratch host block stays at 0
    assert pool.current([1, 2], first[:2]).all()
    pool.release([2])
    assert pool.current([1, 2], first[:2]).tolist() == [True, False]
    with pytest.raises(HostPoolError, match="4"):
        pool.release([4])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("memory_kind", ["pinned_host", "numpy"])
def test_rows_are_copies_so_a_later_store_still_writes(dtype, memory_kind):
    """Reading rows must hold no reference to the buffer a later write donates (on a GPU a
    zero-copy view of a bf16 pinned_host buffer made that write fail)."""
    pool = HostKVPool(3, (2, 4), dtype, memory_kind=memory_kind)
    ones = jnp.ones((1, 2, 4), dtype)
    if memory_kind == "pinned_host":
        pool.write(jnp.array([1], jnp.int32), ones)
    else:
        pool.commit(np.array([1]), np.asarray(ones))
    first = pool.rows([1, 2])
    first[0] = 7  # a copy: the pool is unchanged
    if memory_kind == "pinned_host":
        pool.write(jnp.array([2], jnp.int32), ones * 2)
    else:
        pool.commit(np.array([2]), np.asarray(ones * 2))
    again = pool.rows([1, 2])
    assert again.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(again.astype(np.float32), [np.ones((2, 4)), 2 * np.ones((2, 4))])
