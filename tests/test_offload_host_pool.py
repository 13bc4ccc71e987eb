"""Host slot backend, host buffer memory kinds, generation counters."""

import jax
import numpy as np
import pytest

from jaxkv.offload.host_pool import (
    HostKVPool,
    HostPoolError,
    HostSlotBackend,
    blocks_in_budget,
    pinned_host_supported,
)


def test_backend_hands_out_slots_from_one_and_never_scratch():
    backend = HostSlotBackend(3)
    assert backend.allocate(3) == [1, 2, 3] and backend.num_free == 0
    with pytest.raises(HostPoolError, match="cannot allocate 1"):
        backend.allocate(1)


def test_backend_free_of_unallocated_slot_raises_and_changes_nothing():
    backend = HostSlotBackend(3)
    backend.allocate(2)
    with pytest.raises(HostPoolError, match="3"):
        backend.free([1, 3])
    with pytest.raises(HostPoolError):
        backend.free([1, 1])
    assert backend.num_free == 1
    backend.free([2, 1])
    assert backend.num_free == 3


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
    assert first.tolist() == [1, 1, 0]  # the scratch slot stays at 0
    assert pool.current([1, 2], first[:2]).all()
    pool.release([2])
    assert pool.current([1, 2], first[:2]).tolist() == [True, False]
    with pytest.raises(HostPoolError, match="4"):
        pool.release([4])
