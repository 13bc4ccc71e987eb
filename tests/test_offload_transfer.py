"""Transfer engine: store->load round trips, bucketing, generations, failure injection."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxkv import ops
from jaxkv.device.cache import allocate_kv_cache
from jaxkv.device.state_cache import allocate_state_cache, gather_rows, row_nbytes, scatter_rows, write_states
from jaxkv.errors import WrongThreadError
from jaxkv.offload.host_buffers import ROWS_PER_CALL, HostKVBuffers, block_nbytes, block_shape
from jaxkv.offload.transfer import (
    TransferEngine,
    TransferError,
    bucket_size,
    copies_per_block,
)
from jaxkv.planner import KVCacheConfig, KVCacheGroup, StatePool
from jaxkv.specs import FullAttentionSpec, MambaSpec

NUM_BLOCKS = 12
HOST_BLOCKS = 10
LAYOUTS = ("cross_layer", "per_layer")
MEMORY = ("pinned_host", "numpy")


def random_cache(layout: str, seed: int = 0, num_blocks: int = NUM_BLOCKS):
    spec = FullAttentionSpec(num_kv_heads=1, head_size=4, dtype="float32")
    group = KVCacheGroup(layer_names=("l0", "l1", "l2"), spec=spec, block_size=2)
    cache = allocate_kv_cache(KVCacheConfig(num_blocks=num_blocks, groups=(group,)), layout=layout)
    data = jax.random.normal(jax.random.key(seed), (num_blocks, *block_shape(cache)), jnp.float32)
    return ops.scatter_blocks(cache, jnp.arange(num_blocks), data)


def blocks(cache) -> np.ndarray:
    return np.asarray(ops.gather_blocks(cache, jnp.arange(cache.num_blocks)))


_ENGINES: dict = {}


def engine_for(layout: str, memory: str) -> TransferEngine:
    """One engine (and its compiled functions) per layout and memory kind, reused by tests."""
    if (layout, memory) not in _ENGINES:
        cache = random_cache(layout)
        pool = HostKVBuffers(HOST_BLOCKS, block_shape(cache), cache.dtype, memory_kind=memory)
        _ENGINES[layout, memory] = TransferEngine(pool)
    engine = _ENGINES[layout, memory]
    engine.fail_store = engine.fail_load = None
    return engine


def test_bucket_size_is_next_power_of_two():
    assert [bucket_size(n) for n in (0, 1, 2, 3, 4, 5, 9)] == [1, 1, 2, 4, 4, 8, 16]


def test_copies_per_block_by_layout():
    assert copies_per_block(random_cache("cross_layer")) == 1
    assert copies_per_block(random_cache("per_layer")) == 3


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    layout=st.sampled_from(LAYOUTS),
    memory=st.sampled_from(MEMORY),
    data=st.data(),
)
def test_random_round_trip_is_bit_exact(layout, memory, data):
    engine = engine_for(layout, memory)
    cache = random_cache(layout, seed=data.draw(st.integers(0, 99)))
    n = data.draw(st.integers(1, 7))
    src = data.draw(st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=True))
    slots = data.draw(st.lists(st.integers(1, HOST_BLOCKS), min_size=n, max_size=n, unique=True))
    dst = data.draw(st.lists(st.integers(1, NUM_BLOCKS - 1), min_size=n, max_size=n, unique=True))
    before = blocks(cache)
    store = engine.store(cache, src, slots)
    assert engine.wait(store).ok == tuple(range(n))
    np.testing.assert_array_equal(blocks(cache), before)  # sources unchanged
    np.testing.assert_array_equal(engine.buffers.rows(slots), before[src])
    cache, load = engine.load(cache, dst, slots)
    assert engine.wait(load).ok == tuple(range(n))
    expected = before.copy()
    expected[dst] = before[src]
    after = blocks(cache)
    np.testing.assert_array_equal(after[1:], expected[1:])  # block 0 is the padding sink


@pytest.mark.parametrize("memory", MEMORY)
def test_warm_up_compiles_every_bucket_and_changes_no_block(memory):
    cache = random_cache("per_layer")
    before = blocks(cache)
    engine = TransferEngine(HostKVBuffers(HOST_BLOCKS, block_shape(cache), cache.dtype, memory_kind=memory))
    cache = engine.warm_up(cache, 5)  # buckets 1, 2, 4, 8
    np.testing.assert_array_equal(blocks(cache)[1:], before[1:])
    traces = engine.num_traces
    for n in (1, 2, 3, 5):
        engine.wait(engine.store(cache, list(range(1, n + 1)), list(range(1, n + 1))))
        cache, load = engine.load(cache, list(range(n + 1, 2 * n + 1)), list(range(1, n + 1)))
        engine.wait(load)
    assert engine.num_traces == traces
    with pytest.raises(TransferError, match="max_blocks"):
        engine.warm_up(cache, 0)


@pytest.mark.parametrize("memory", MEMORY)
def test_buckets_do_not_recompile(memory):
    engine = engine_for("cross_layer", memory)
    cache = random_cache("cross_layer")
    for n in (5, 6, 7, 8):  # all in bucket 8
        engine.wait(engine.store(cache, list(range(1, n + 1)), list(range(1, n + 1))))
        cache, load = engine.load(cache, list(range(1, n + 1)), list(range(1, n + 1)))
        engine.wait(load)
    traces = engine.num_traces
    for n in (5, 7):
        engine.wait(engine.store(cache, list(range(1, n + 1)), list(range(1, n + 1))))
        cache, load = engine.load(cache, list(range(1, n + 1)), list(range(1, n + 1)))
    assert engine.num_traces == traces


@pytest.mark.parametrize("memory", MEMORY)
def test_late_store_never_lands_in_reused_slot(memory):
    engine = engine_for("cross_layer", memory)
    cache = random_cache("cross_layer")
    old = engine.store(cache, [1], [4])
    engine.buffers.release([4])  # the manager freed slot 4 and handed it out again
    new = engine.store(cache, [2], [4])
    assert engine.wait(new).ok == (0,)
    assert engine.wait(old).failed == (0,)
    np.testing.assert_array_equal(engine.buffers.rows([4])[0], blocks(cache)[2])


@pytest.mark.parametrize("memory", MEMORY)
def test_injected_store_failure_leaves_slots_unwritten(memory):
    engine = engine_for("cross_layer", memory)
    cache = random_cache("cross_layer", seed=1)
    engine.wait(engine.store(random_cache("cross_layer", seed=2), [1, 2, 3], [1, 2, 3]))
    host_before = engine.buffers.rows([1, 2, 3])
    engine.fail_store = lambda ids, slots: ids == 2
    result = engine.wait(engine.store(cache, [1, 2, 3], [1, 2, 3]))
    assert result == type(result)(ok=(0, 2), failed=(1,))
    np.testing.assert_array_equal(engine.buffers.rows([2])[0], host_before[1])
    np.testing.assert_array_equal(engine.buffers.rows([1, 3]), blocks(cache)[[1, 3]])


@pytest.mark.parametrize("memory", MEMORY)
def test_injected_load_failure_leaves_device_blocks_untouched(memory):
    engine = engine_for("per_layer", memory)
    cache = random_cache("per_layer", seed=3)
    engine.wait(engine.store(random_cache("per_layer", seed=4), [1, 2], [5, 6]))
    before = blocks(cache)
    engine.fail_load = lambda ids, slots: slots == 6
    cache, load = engine.load(cache, [7, 8], [5, 6])
    assert engine.wait(load).failed == (1,)
    after = blocks(cache)
    np.testing.assert_array_equal(after[8], before[8])  # the caller recomputes block 8
    np.testing.assert_array_equal(after[7], engine.buffers.rows([5])[0])


@pytest.mark.parametrize("memory", MEMORY)
def test_a_load_is_settled_when_issued_and_reads_what_host_held_then(memory):
    """The connector dispatches the step without waiting for a load: its result must be
    known at issue, and a host block rewritten right after the load must not change what
    the load brings (the read is ordered before the later write)."""
    engine = engine_for("cross_layer", memory)
    cache = random_cache("cross_layer", seed=5)
    source = blocks(cache)
    engine.wait(engine.store(cache, [1, 2], [5, 6]))
    engine.fail_load = lambda ids, host: host == 6
    cache, load = engine.load(cache, [3, 4], [5, 6])
    assert engine.poll(load) == type(engine.poll(load))(ok=(0,), failed=(1,))
    engine.release([5])
    engine.wait(engine.store(cache, [9], [5]))  # host block 5 now holds another block
    after = blocks(cache)
    np.testing.assert_array_equal(after[3], source[1])
    np.testing.assert_array_equal(after[4], source[4])  # the failed row left block 4 as it was
    assert engine.wait(load) == engine.poll(load)


@pytest.mark.parametrize("memory", MEMORY)
def test_transfers_larger_than_one_call_round_trip(memory):
    """More rows than one jitted pinned_host write/read moves: several calls, same bytes."""
    n = ROWS_PER_CALL + 9  # bucket 2 * ROWS_PER_CALL
    cache = random_cache("cross_layer", seed=6, num_blocks=2 * n + 1)
    before = blocks(cache)
    engine = TransferEngine(HostKVBuffers(n, block_shape(cache), cache.dtype, memory_kind=memory))
    src, dst, host = list(range(1, n + 1)), list(range(n + 1, 2 * n + 1)), list(range(n, 0, -1))
    assert engine.wait(engine.store(cache, src, host)).failed == ()
    np.testing.assert_array_equal(engine.buffers.rows(host), before[src])
    cache, load = engine.load(cache, dst, host)
    assert engine.poll(load).failed == ()
    np.testing.assert_array_equal(blocks(cache)[dst], before[src])


def test_bad_requests_raise_and_issue_nothing():
    engine = engine_for("cross_layer", "numpy")
    cache = random_cache("cross_layer")
    generations = engine.buffers.generation.copy()
    for ids, slots in (
        ([0], [1]),
        ([NUM_BLOCKS], [1]),
        ([1], [0]),
        ([1], [HOST_BLOCKS + 1]),
        ([1, 2], [3, 3]),
        ([1], [1, 2]),
    ):
        with pytest.raises(TransferError):
            engine.store(cache, ids, slots)
    np.testing.assert_array_equal(engine.buffers.generation, generations)


def test_transfers_only_from_the_owning_thread():
    import threading

    engine = engine_for("cross_layer", "numpy")
    cache = random_cache("cross_layer")
    errors = []

    def issue():
        try:
            engine.store(cache, [1], [1])
        except WrongThreadError as err:
            errors.append(err)

    thread = threading.Thread(target=issue)
    thread.start()
    thread.join()
    assert len(errors) == 1


def test_pool_for_cache_sizes_from_byte_budget():
    cache = random_cache("cross_layer")
    pool = HostKVBuffers.for_cache(cache, 5 * block_nbytes(cache) + 7, memory_kind="numpy")
    assert pool.num_blocks == 5 and pool.block_bytes == block_nbytes(cache)


@pytest.mark.parametrize("memory", MEMORY)
def test_state_slots_round_trip_through_the_host_as_bytes(memory):
    """Recurrent state rows of mixed shapes and dtypes go to host and come back bit for bit;
    a failed load leaves the device row as it was."""
    state = MambaSpec(shapes=((3, 5), (2, 4, 4)), dtypes=("bfloat16", "float32"), mamba_type="gated_delta_net")
    groups = (
        KVCacheGroup(("a",), FullAttentionSpec(num_kv_heads=1, head_size=4), 16),
        KVCacheGroup(("m0", "m1"), state, 16),
    )
    states = allocate_state_cache(KVCacheConfig(num_blocks=4, groups=groups, states=StatePool(num_states=6)))
    rng = np.random.default_rng(0)
    for layer in states.layer_names:
        values = (
            jnp.asarray(rng.standard_normal((5, 3, 5)), jnp.bfloat16),
            jnp.asarray(rng.standard_normal((5, 2, 4, 4))),
        )
        states = write_states(states, layer, jnp.arange(1, 6), values)
    before = gather_rows(states, jnp.arange(6))
    pool = HostKVBuffers.for_cache(states, 3 * row_nbytes(states), memory_kind=memory)
    engine = TransferEngine(pool)
    assert pool.num_blocks == 3 and pool.block_shape == (row_nbytes(states),)
    assert engine.wait(engine.store(states, [2, 5], [1, 2])).failed == ()
    states = scatter_rows(states, jnp.array([2, 5]), jnp.zeros((2, row_nbytes(states)), jnp.uint8))
    engine.fail_load = lambda ids, host: ids == 5
    states, transfer = engine.load(states, [2, 5], [1, 2])
    assert engine.wait(transfer).failed == (1,)
    after = np.asarray(gather_rows(states, jnp.arange(6)))
    np.testing.assert_array_equal(after[2], np.asarray(before)[2])
    assert not after[5].any(), "the failed row kept what the device held"
