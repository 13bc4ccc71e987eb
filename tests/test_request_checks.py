"""The checks of a manager call's request and cache hit: each refusal is typed and names
the offending value."""

import pytest
from kv_configs import FULL, make_manager, window

from jaxkv.core.kv_cache_blocks import KVCacheBlocks
from jaxkv.core.manager_errors import (
    DuplicateRequestError,
    InvalidCacheHitError,
    KVCacheManagerError,
    StaleCacheHitError,
)
from jaxkv.core.request import Request
from jaxkv.core.request_checks import check_counts, check_external, check_hit, check_new_request, check_request


def test_only_a_request_passes():
    check_request(Request("a", [5, 6]))
    with pytest.raises(KVCacheManagerError, match=r"expected a jaxkv.core.manager.Request, got \('a', \[5, 6\]\)"):
        check_request(("a", [5, 6]))


def test_a_new_request_needs_a_free_id_and_nothing_computed():
    req = Request("a", [5, 6])
    check_new_request(req, id_in_use=False)
    with pytest.raises(DuplicateRequestError, match="'a' is already used"):
        check_new_request(req, id_in_use=True)
    req.num_computed_tokens = 2
    with pytest.raises(KVCacheManagerError, match="num_computed_tokens=2"):
        check_new_request(req, id_in_use=False)


@pytest.mark.parametrize(
    "counts, match",
    [((1, 0, 0, -4), "num_external_computed_tokens must be an int >= 0, got -4"), ((1, 2.0, 0, 0), "got 2.0")],
)
def test_the_first_bad_count_is_named(counts, match):
    with pytest.raises(KVCacheManagerError, match=match):
        check_counts("a", *counts)


def looked_up(tokens, *specs, **kw):
    """A manager holding request "a" (40 tokens), and a new request "b" sharing them, with its hit."""
    mgr = make_manager(20, *specs, **kw)
    a = Request("a", tokens(0, 40))
    hit, n = mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 40, n, hit)
    b = Request("b", tokens(0, 40) + tokens(900, 8))
    hit, n = mgr.get_computed_blocks(b)
    return mgr, b, hit, n


def check(mgr, req, n, hit, held=False, enable_caching=True):
    return check_hit(
        req,
        n,
        hit,
        held=held,
        enable_caching=enable_caching,
        block_sizes=mgr.block_sizes,
        coordinator=mgr.coordinator,
    )


def test_the_request_s_own_hit_passes_and_no_hit_is_none(tokens):
    mgr, b, hit, n = looked_up(tokens, FULL)
    assert n == 32 and check(mgr, b, n, hit) == hit.blocks
    assert check(mgr, b, 0, None) is None and check(mgr, b, 0, mgr.get_computed_blocks(Request("c", [5]))[0]) is None


def test_a_hit_is_refused_for_a_held_request_or_without_caching(tokens):
    mgr, b, hit, n = looked_up(tokens, FULL)
    with pytest.raises(KVCacheManagerError, match="'b' already holds blocks"):
        check(mgr, b, n, hit, held=True)
    with pytest.raises(InvalidCacheHitError, match="without prefix caching"):
        check(mgr, b, n, hit, enable_caching=False)


def test_a_hit_of_the_wrong_shape_is_refused(tokens):
    mgr, b, hit, n = looked_up(tokens, FULL, window(32))
    with pytest.raises(KVCacheManagerError, match="must be KVCacheBlocks, got \\[\\[1\\]\\]"):
        check(mgr, b, n, [[1]])
    with pytest.raises(KVCacheManagerError, match="num_new_computed_tokens=16 without new_computed_blocks"):
        check(mgr, b, 16, None)
    with pytest.raises(KVCacheManagerError, match="has 1 groups, config has 2"):
        check(mgr, b, n, KVCacheBlocks(hit.blocks[:1]))
    with pytest.raises(KVCacheManagerError, match="2 hit blocks of 16 tokens do not cover num_new_computed_tokens=16"):
        check(mgr, b, 16, hit)


def test_a_hit_longer_than_the_prompt_allows_is_refused(tokens):
    mgr, _b, hit, n = looked_up(tokens, FULL)
    with pytest.raises(InvalidCacheHitError, match="a hit of 32 tokens does not fit its 32-token prompt"):
        check(mgr, Request("short", tokens(0, 32)), n, hit)


def test_another_request_s_hit_is_invalid_and_an_evicted_one_stale(tokens):
    mgr, b, hit, n = looked_up(tokens, FULL)
    forged = KVCacheBlocks(([block + 1 for block in hit.blocks[0]],))
    with pytest.raises(InvalidCacheHitError, match="another request's or forged hit") as refused:
        check(mgr, b, n, forged)
    assert not isinstance(refused.value, StaleCacheHitError)
    mgr.free("a")
    assert mgr.evict_blocks(hit.blocks[0]) == 2
    with pytest.raises(StaleCacheHitError, match="evicted since get_computed_blocks"):
        check(mgr, b, n, hit)


def test_external_tokens_are_whole_blocks_for_a_new_request_with_caching():
    check_external("a", 64, held=False, lcm_block_size=32, enable_caching=True)
    with pytest.raises(KVCacheManagerError, match="'a' already holds blocks"):
        check_external("a", 64, held=True, lcm_block_size=32, enable_caching=True)
    with pytest.raises(KVCacheManagerError, match="=48 is not a multiple of the block sizes' lcm 32"):
        check_external("a", 48, held=False, lcm_block_size=32, enable_caching=True)
    with pytest.raises(KVCacheManagerError, match="caching is off"):
        check_external("a", 64, held=False, lcm_block_size=32, enable_caching=False)
