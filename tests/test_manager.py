"""KVCacheManager scenarios: prefix hits, eviction order, hybrid groups, bad input."""

import pytest
from conftest import FULL, admit, make_manager, window

from jaxkv.manager import (
    KVCacheManagerError,
    MaxModelLenExceededError,
    Request,
    StaleCacheHitError,
    UnknownRequestError,
)
from jaxkv.pool import BlockRemoved, BlockStored


def test_shared_prefix_hits_full_blocks_and_frees_in_lru_order(tokens):
    mgr = make_manager(11, FULL)
    shared = tokens(1000, 48)
    req0 = Request("req0", shared + tokens(0, 7))
    hit, n, new = admit(mgr, req0)
    assert n == 0 and new.get_block_ids() == ([1, 2, 3, 4],)

    req1 = Request("req1", shared + tokens(100, 5))
    hit, n, new = admit(mgr, req1)
    assert n == 48 and hit.get_block_ids() == ([1, 2, 3],)
    assert new.get_block_ids() == ([5],)
    assert mgr.get_block_ids("req1") == ([1, 2, 3, 5],)

    mgr.free(req0)
    mgr.free(req1)
    assert mgr.pool.free_block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    miss = Request("req2", tokens(5000, 160))
    hit, n, new = admit(mgr, miss)
    assert n == 0 and new.get_block_ids() == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)


def test_hit_is_capped_below_the_last_token(tokens):
    mgr = make_manager(11, FULL)
    admit(mgr, Request("a", tokens(0, 32)))
    hit, n = mgr.get_computed_blocks(Request("b", tokens(0, 32)))
    assert n == 16 and hit.get_block_ids() == ([1],)
    hit, n = mgr.get_computed_blocks(Request("c", tokens(0, 33)))
    assert n == 32


def test_hybrid_full_and_two_windows_hit_with_leading_nulls(tokens):
    mgr = make_manager(21, FULL, window(32), window(32))
    prefix = tokens(0, 48)
    req0 = Request("req0", prefix + tokens(900, 7))
    _, _, new = admit(mgr, req0)
    assert new.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])

    req1 = Request("req1", prefix + tokens(500, 5))
    hit, n = mgr.get_computed_blocks(req1)
    assert n == 48 and hit.get_block_ids() == ([1, 2, 3], [0, 6, 7], [0, 10, 11])

    mgr.evict_blocks([5, 9])  # first block of both window groups: outside the window
    hit, n = mgr.get_computed_blocks(req1)
    assert n == 48 and hit.get_block_ids() == ([1, 2, 3], [0, 6, 7], [0, 10, 11])

    mgr.evict_blocks([1])  # the full group's first block: no prefix left
    hit, n = mgr.get_computed_blocks(req1)
    assert n == 0 and hit.get_block_ids() == ((), (), ())


def test_window_blocks_that_fall_out_are_freed_before_allocating(tokens):
    mgr = make_manager(30, window(32), block_size=16)
    req = Request("r", tokens(0, 64))
    admit(mgr, req)
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4],)
    req.append_output_token_ids(7)
    assert mgr.allocate_slots(req, 1).get_block_ids() == ([5],)
    # 64 computed: tokens before 64 - 32 + 1 = 33 are out of the window -> blocks 0, 1 go.
    assert mgr.get_block_ids("r") == ([0, 0, 3, 4, 5],)
    assert mgr.pool.free_block_ids()[-2:] == [2, 1]


def test_lookahead_tokens_get_slots_but_are_not_cached(tokens):
    mgr = make_manager(20, FULL)
    req = Request("r", tokens(0, 30))
    _, _, new = admit(mgr, req, num_lookahead_tokens=4)
    assert new.get_block_ids() == ([1, 2, 3],)
    assert len(mgr.pool.cached[0]) == 1


def test_out_of_blocks_returns_none_and_changes_nothing(tokens):
    mgr = make_manager(4, FULL)
    admit(mgr, Request("a", tokens(0, 32)))
    before = (mgr.pool.free_block_ids(), list(mgr.pool.ref_cnt), dict(mgr.pool.cached[0]))
    big = Request("b", tokens(0, 16) + tokens(500, 40))
    hit, n = mgr.get_computed_blocks(big)
    assert n == 16
    assert mgr.allocate_slots(big, big.num_tokens - n, n, hit) is None
    assert (mgr.pool.free_block_ids(), list(mgr.pool.ref_cnt), dict(mgr.pool.cached[0])) == before
    with pytest.raises(UnknownRequestError):
        mgr.get_block_ids("b")


def test_decode_allocates_a_block_only_at_block_boundaries(tokens):
    mgr = make_manager(10, FULL)
    req = Request("r", tokens(0, 15))
    admit(mgr, req)
    req.append_output_token_ids(1)
    assert mgr.allocate_slots(req, 1).get_block_ids() == ([],)
    req.num_computed_tokens += 1
    req.append_output_token_ids(2)
    assert mgr.allocate_slots(req, 1).get_block_ids() == ([2],)
    # The first block is now full of prompt + output tokens and cached.
    assert list(mgr.pool.cached[0].values()) == [1]


def test_cache_salt_and_lora_separate_tenants(tokens):
    mgr = make_manager(20, FULL)
    admit(mgr, Request("a", tokens(0, 40), cache_salt="tenant-a"))
    assert mgr.get_computed_blocks(Request("b", tokens(0, 40), cache_salt="tenant-b"))[1] == 0
    assert mgr.get_computed_blocks(Request("c", tokens(0, 40)))[1] == 0
    assert mgr.get_computed_blocks(Request("d", tokens(0, 40), cache_salt="tenant-a"))[1] == 32
    assert mgr.get_computed_blocks(Request("e", tokens(0, 40), cache_salt="tenant-a", lora_name="x"))[1] == 0


def test_caching_disabled_never_hits(tokens):
    mgr = make_manager(20, FULL, enable_caching=False)
    admit(mgr, Request("a", tokens(0, 40)))
    mgr.free("a")
    assert mgr.get_computed_blocks(Request("b", tokens(0, 40)))[1] == 0
    assert mgr.pool.num_cached_blocks() == 0


def test_stats_and_events(tokens):
    mgr = make_manager(20, FULL, enable_events=True)
    admit(mgr, Request("a", tokens(0, 40)))
    admit(mgr, Request("b", tokens(0, 40)))
    stats = mgr.prefix_cache_stats()
    assert (stats.num_requests, stats.num_queried_tokens, stats.num_hit_tokens) == (2, 80, 32)
    assert stats.hit_rate == pytest.approx(0.4)
    [stored] = mgr.take_events()
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 2
    assert stored.token_ids == tuple(tokens(0, 32))
    mgr.free("a")
    mgr.free("b")
    assert mgr.reset_prefix_cache()
    assert mgr.prefix_cache_stats().num_resets == 1
    assert mgr.get_computed_blocks(Request("c", tokens(0, 40)))[1] == 0


def test_eviction_emits_removed_events(tokens):
    mgr = make_manager(4, FULL, enable_events=True)
    admit(mgr, Request("a", tokens(0, 33)))
    mgr.free("a")
    mgr.take_events()
    admit(mgr, Request("b", tokens(100, 40)))
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 2


def test_reset_refused_while_requests_run(tokens):
    mgr = make_manager(20, FULL)
    admit(mgr, Request("a", tokens(0, 40)))
    assert not mgr.reset_prefix_cache()
    assert mgr.get_computed_blocks(Request("b", tokens(0, 40)))[1] == 32


def test_a_hit_evicted_before_allocation_is_refused(tokens):
    mgr = make_manager(20, FULL)
    admit(mgr, Request("a", tokens(0, 40)))
    mgr.free("a")
    req = Request("b", tokens(0, 40))
    hit, n = mgr.get_computed_blocks(req)
    admit(mgr, Request("other", tokens(900, 16 * 18)))  # evicts the cached blocks
    with pytest.raises(StaleCacheHitError, match="evicted"):
        mgr.allocate_slots(req, req.num_tokens - n, n, hit)


# ------------------------------------------------------------------ bad input
def test_unknown_and_double_free_raise(tokens):
    mgr = make_manager(20, FULL)
    with pytest.raises(UnknownRequestError, match="'nope'"):
        mgr.free("nope")
    admit(mgr, Request("a", tokens(0, 20)))
    mgr.free("a")
    with pytest.raises(UnknownRequestError, match="already freed"):
        mgr.free("a")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_new_tokens=-1), "num_new_tokens must be an int >= 0, got -1"),
        (dict(num_new_tokens=4, num_lookahead_tokens=-2), "num_lookahead_tokens.*-2"),
        (dict(num_new_tokens=0), "nothing to allocate"),
        (dict(num_new_tokens=2, num_new_computed_tokens=16), "without new_computed_blocks"),
    ],
)
def test_bad_counts_raise_and_change_nothing(tokens, kwargs, match):
    mgr = make_manager(20, FULL)
    req = Request("a", tokens(0, 20))
    free_before = mgr.pool.free_block_ids()
    with pytest.raises(KVCacheManagerError, match=match):
        mgr.allocate_slots(req, **kwargs)
    assert mgr.pool.free_block_ids() == free_before


def test_tokens_past_max_model_len_raise(tokens):
    mgr = make_manager(20, FULL, max_model_len=64)
    req = Request("a", tokens(0, 65))
    with pytest.raises(MaxModelLenExceededError, match="max_model_len=64"):
        mgr.allocate_slots(req, 65)
    assert mgr.num_free_blocks == 19


def test_hit_blocks_for_a_running_request_are_refused(tokens):
    mgr = make_manager(20, FULL)
    admit(mgr, Request("a", tokens(0, 40)))
    req = Request("b", tokens(0, 40))
    hit, n = admit(mgr, req)[:2]
    req.append_output_token_ids(3)
    with pytest.raises(KVCacheManagerError, match="already holds blocks"):
        mgr.allocate_slots(req, 1, n, hit)


def test_bad_requests_and_configs_are_named():
    with pytest.raises(KVCacheManagerError, match="empty prompt"):
        Request("x", [])
    with pytest.raises(KVCacheManagerError, match="request_id"):
        Request(7, [1])
    from conftest import make_config

    from jaxkv.manager import KVCacheManager

    with pytest.raises(KVCacheManagerError, match="max_model_len"):
        KVCacheManager(make_config(10, FULL))


def test_a_request_hashed_by_another_manager_is_refused(tokens):
    a = make_manager(20, FULL, block_size=16)
    b = make_manager(20, FULL, block_size=32)
    req = Request("r", tokens(0, 40))
    a.get_computed_blocks(req)
    with pytest.raises(KVCacheManagerError, match="hashed with"):
        b.get_computed_blocks(req)
