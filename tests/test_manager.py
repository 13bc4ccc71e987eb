"""KVCacheManager scenarios: prefix hits, eviction order, hybrid groups, bad input."""

import dataclasses
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_configs import FULL, admit, make_config, make_manager, window

from jaxkv.core.manager import (
    DuplicateRequestError,
    InvalidCacheHitError,
    KVCacheBlocks,
    KVCacheManager,
    KVCacheManagerError,
    MaxModelLenExceededError,
    Request,
    StaleCacheHitError,
    UnknownRequestError,
)
from jaxkv.core.pool import BlockRemoved, BlockStored
from jaxkv.errors import JaxkvError, WrongThreadError
from jaxkv.planner import StatePool
from jaxkv.specs import MambaSpec


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


def test_a_hit_on_free_cached_blocks_uses_up_free_blocks(tokens):
    mgr = make_manager(11, FULL)  # 10 usable blocks
    shared = tokens(1000, 64)
    a = Request("a", shared + tokens(0, 1))
    admit(mgr, a)  # 5 blocks, 4 of them cached
    mgr.free(a)
    held = Request("held", shared[:32] + tokens(200, 1))
    admit(mgr, held)  # hits 2 of them and holds them again, plus one fresh block
    assert mgr.num_free_blocks == 7
    # 4 hit blocks (2 of them free) + 4 fresh: 6 free blocks used, 7 are free
    b = Request("b", shared + tokens(300, 64))
    hit, n = mgr.get_computed_blocks(b)
    assert n == 64 and mgr.allocate_slots(b, b.num_tokens - n, n, hit) is not None
    mgr.free(b)
    # the same, with one free block fewer than 4 fresh + 2 free hits need
    hog = Request("hog", tokens(5000, 32))
    admit(mgr, hog)  # 2 blocks
    c = Request("c", shared + tokens(600, 64))
    hit, n = mgr.get_computed_blocks(c)
    assert n == 64 and mgr.num_free_blocks == 5
    before = mgr.pool.free_block_ids()
    assert mgr.allocate_slots(c, c.num_tokens - n, n, hit) is None
    assert mgr.pool.free_block_ids() == before


def test_prompts_sharing_a_system_prompt_hash_as_if_each_were_alone(tokens):
    mgr = make_manager(11, FULL)
    system = tokens(1000, 40)
    prompts = [system + tokens(0, 9), system[:37] + tokens(100, 30), system + tokens(200, 3), system[:20]]
    for i, prompt in enumerate(prompts):
        for salt in (None, "tenant"):
            req = Request(f"r{i}{salt}", prompt, cache_salt=salt)
            mgr.hash_request(req)
            alone: list[bytes] = []
            mgr.hasher.extend(alone, prompt, req.extra_keys)
            assert req.block_hashes == alone


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
    assert mgr.allocate_slots(req, 1).num_blocks() == 0
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


def test_a_request_skipping_prefix_cache_reads_finds_no_hit_but_its_blocks_are_cached(tokens):
    mgr = make_manager(20, FULL)
    admit(mgr, Request("a", tokens(0, 40)))
    before = mgr.prefix_cache_stats().num_queried_tokens
    hit, n, new = admit(mgr, Request("b", tokens(0, 40), skip_reading_prefix_cache=True))  # prompt logprobs
    assert n == 0 and hit.get_block_ids() == ((),) and new is not None
    assert mgr.prefix_cache_stats().num_queried_tokens == before, "a skipped lookup is not counted (vLLM)"
    mgr.free("a")
    mgr.free("b")
    assert mgr.get_computed_blocks(Request("c", tokens(0, 40)))[1] == 32


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


def test_the_manager_keeps_a_request_from_its_first_allocation_to_its_free(tokens):
    mgr = make_manager(4, FULL)  # 3 usable blocks
    admit(mgr, Request("a", tokens(0, 32)))
    waiting = Request("w", tokens(0, 16) + tokens(500, 40))
    hit, n = mgr.get_computed_blocks(waiting)
    assert n == waiting.prefix_reach == 16  # the lookup's reach stays on the request
    assert mgr.allocate_slots(waiting, waiting.num_tokens - n, n, hit) is None
    assert not mgr.has_request("w") and mgr.num_requests == 1  # looked up and refused: nothing kept
    mgr.free("a")
    assert mgr.num_requests == 0
    again = Request("a", tokens(0, 20))  # the freed id, a new request: the old one left nothing behind
    admit(mgr, again)
    assert mgr.has_request("a") and mgr.allocate_decode_slots([again]) == 1
    assert mgr.get_block_ids("a") == ([1, 3],)  # the first a's block 1 hit, then a fresh one


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


def test_a_config_without_max_model_len_is_refused():
    with pytest.raises(KVCacheManagerError, match="max_model_len"):
        KVCacheManager(make_config(10, FULL))


def test_a_request_hashed_by_another_manager_is_refused(tokens):
    a = make_manager(20, FULL, block_size=16)
    b = make_manager(20, FULL, block_size=32)
    req = Request("r", tokens(0, 40))
    a.get_computed_blocks(req)
    with pytest.raises(KVCacheManagerError, match="hashed with"):
        b.get_computed_blocks(req)


def pool_state(mgr):
    """Everything a refused call must leave unchanged."""
    pool = mgr.pool
    return (pool.free_block_ids(), list(pool.ref_cnt), [dict(m) for m in pool.cached], list(pool.block_hash))


def test_a_recomputed_copy_is_cached_so_evicting_the_first_keeps_the_prefix(tokens):
    """The issue's scenario: vLLM hits 32 tokens here; before, jaxkv hit 16."""
    mgr = make_manager(11, FULL)
    prompt = tokens(0, 32)
    first, second = Request("a", prompt), Request("b", prompt)
    admit(mgr, first)
    _, n, _ = admit(mgr, second)
    assert n == 16  # the hit stops below the last token: block 2 is computed twice
    mgr.free(first)
    mgr.evict_blocks([2])  # the first's copy of block 2 (b's own copy is block 3)
    hit, n = mgr.get_computed_blocks(Request("c", prompt + tokens(500, 16)))
    assert n == 32 and hit.get_block_ids()[0][1] == mgr.get_block_ids("b")[0][1]


def test_a_second_live_request_with_the_same_id_is_refused(tokens):
    mgr = make_manager(11, FULL)
    admit(mgr, Request("dup", tokens(0, 20)))
    before = pool_state(mgr)
    with pytest.raises(DuplicateRequestError, match="'dup'"):
        mgr.allocate_slots(Request("dup", tokens(100, 20)), 20)
    assert pool_state(mgr) == before and mgr.get_block_ids("dup") == ([1, 2],)


def test_a_hit_computed_for_another_request_or_tenant_is_refused(tokens):
    mgr = make_manager(11, FULL)
    admit(mgr, Request("a", tokens(0, 40)))
    hit, n = mgr.get_computed_blocks(Request("b", tokens(0, 40)))
    before = pool_state(mgr)
    other_tenant = Request("c", tokens(0, 40), cache_salt="tenant-2")
    with pytest.raises(InvalidCacheHitError, match="another request's or forged"):
        mgr.allocate_slots(other_tenant, 40 - n, n, hit)
    assert pool_state(mgr) == before


@pytest.mark.parametrize(
    "blocks, what",
    [(([5, 6],), "uncached"), (([1, 1],), "repeated"), (([1, 99],), "out of range"), (([1, -1],), "negative")],
)
def test_forged_hits_are_refused_and_change_nothing(tokens, blocks, what):
    mgr = make_manager(11, FULL)
    admit(mgr, Request("a", tokens(0, 40)))
    req = Request("b", tokens(0, 40))
    mgr.get_computed_blocks(req)
    before = pool_state(mgr)
    with pytest.raises(InvalidCacheHitError):
        mgr.allocate_slots(req, 8, 32, KVCacheBlocks(blocks))
    assert pool_state(mgr) == before, what


def test_a_bad_output_token_is_refused_before_anything_is_allocated(tokens):
    mgr = make_manager(11, FULL)
    req = Request("a", tokens(0, 16))
    admit(mgr, req)
    before = pool_state(mgr)
    for bad in (-1, 2**31, 1.5, True, None, "7"):
        with pytest.raises(KVCacheManagerError):
            req.append_output_token_ids(bad)
    assert req.num_tokens == 16 and pool_state(mgr) == before


def test_tokens_cannot_be_edited_in_place_after_the_lookup(tokens):
    mgr = make_manager(11, FULL)
    admit(mgr, Request("a", tokens(0, 40)))
    req = Request("b", tokens(0, 40))
    mgr.get_computed_blocks(req)
    with pytest.raises(TypeError):
        req.all_token_ids[3] = 999
    with pytest.raises(TypeError):
        req.prompt_token_ids[3] = 999
    assert req.all_token_ids == tokens(0, 40)


def test_allocating_after_free_with_stale_computed_tokens_is_refused(tokens):
    mgr = make_manager(11, FULL)
    req = Request("a", tokens(0, 40))
    admit(mgr, req)
    mgr.free(req)
    before = pool_state(mgr)
    with pytest.raises(KVCacheManagerError, match="num_computed_tokens=40"):
        mgr.allocate_slots(req, 1)
    assert pool_state(mgr) == before


def test_calls_from_another_thread_are_refused(tokens):
    mgr = make_manager(11, FULL)
    req = Request("a", tokens(0, 40))
    errors = []

    def call():
        try:
            mgr.get_computed_blocks(req)
        except WrongThreadError as err:
            errors.append(err)

    worker = threading.Thread(target=call)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "single-owner" in str(errors[0])


@pytest.mark.parametrize(
    "call",
    [
        lambda mgr: mgr.get_computed_blocks(None),
        lambda mgr: mgr.allocate_slots(None, 1),
        lambda mgr: mgr.allocate_slots(Request("x", [1, 2]), None),
        lambda mgr: mgr.allocate_slots(Request("x", [1, 2]), 2, 0, [[1]]),
        lambda mgr: mgr.free(None),
        lambda mgr: mgr.evict_blocks([None]),
    ],
)
def test_wrong_types_get_a_typed_error(call):
    mgr = make_manager(11, FULL)
    with pytest.raises(JaxkvError):
        call(mgr)
    assert mgr.num_free_blocks == 10


def test_the_window_search_finds_the_rightmost_full_window_after_the_newest_blocks_go(tokens):
    mgr = make_manager(64, FULL, window(64))
    admit(mgr, Request("a", tokens(0, 320)))  # 20 blocks per group
    window_blocks = mgr.get_block_ids("a")[1]
    mgr.free("a")
    mgr.evict_blocks(window_blocks[15:])  # the newest window blocks: the usual state under pressure
    hit, n = mgr.get_computed_blocks(Request("b", tokens(0, 321)))
    assert n == 240 and hit.get_block_ids()[1] == [0] * 11 + window_blocks[11:15]


def test_decoding_past_max_model_len_raises_even_with_room_in_the_last_block(tokens):
    mgr = make_manager(11, FULL, max_model_len=40)  # 3 blocks hold 48 slots
    req = Request("a", tokens(0, 39))
    admit(mgr, req)
    req.append_output_token_ids(1)
    assert mgr.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1
    req.append_output_token_ids(2)
    with pytest.raises(MaxModelLenExceededError):
        mgr.allocate_slots(req, 1)


def test_reuse_listeners_hear_reused_cached_blocks_until_removed(tokens):
    mgr = make_manager(4, FULL)
    heard = []
    listener = lambda block, block_hash, group: heard.append((block, group))  # noqa: E731
    mgr.add_reuse_listener(listener)
    admit(mgr, Request("a", tokens(0, 33)))  # blocks 1, 2 cached, 3 not
    mgr.free("a")
    admit(mgr, Request("b", tokens(100, 17)))  # takes 3 (uncached), then 2 (cached)
    assert heard == [(2, 0)]
    mgr.remove_reuse_listener(listener)
    mgr.free("b")
    admit(mgr, Request("c", tokens(200, 40)))
    assert heard == [(2, 0)]


def _run_in_chunks(mgr, req: Request, chunk: int = 4) -> int:
    """Look the request up, then compute it ``chunk`` tokens a step, as chunked prefill does."""
    hit, n = mgr.get_computed_blocks(req)
    assert mgr.allocate_slots(req, min(chunk, req.num_tokens - n), n, hit) is not None
    req.num_computed_tokens = min(n + chunk, req.num_tokens)
    while req.num_computed_tokens < req.num_tokens:
        step = min(chunk, req.num_tokens - req.num_computed_tokens)
        assert mgr.allocate_slots(req, step) is not None
        req.num_computed_tokens += step
    return n


@pytest.mark.parametrize("retention, later_hit", [("vllm", 0), ("group_aware", 16)])
def test_group_aware_retention_keeps_the_window_blocks_a_shared_prefix_needs(retention, later_hit):
    """Two chats share a 16-token system prompt; unrelated traffic then fills the pool.
    vLLM's rule queued the prompt's window blocks for eviction as soon as they slid out
    of the window, so they go first and the third chat misses; group-aware retention
    kept them beside the prompt's full-attention blocks."""
    system = list(range(100, 116))
    mgr = make_manager(40, FULL, window(8), block_size=4, retention=retention)
    first = Request("first", system + list(range(200, 212)))
    assert _run_in_chunks(mgr, first) == 0
    mgr.free(first)
    second = Request("second", system + list(range(300, 312)))
    assert _run_in_chunks(mgr, second) == 16
    mgr.free(second)
    traffic = Request("traffic", list(range(400, 460)))
    _run_in_chunks(mgr, traffic)
    mgr.free(traffic)
    third = Request("third", system + list(range(500, 512)))
    assert mgr.get_computed_blocks(third)[1] == later_hit


# ------------------------------------------------------- recurrent state pool
STATE = MambaSpec(shapes=((2, 2),), dtypes=("float32",))


def state_pool_manager(num_blocks: int, num_states: int, **kw) -> KVCacheManager:
    """Full attention + one recurrent group whose states come from their own pool."""
    config = dataclasses.replace(make_config(num_blocks, FULL, STATE), states=StatePool(num_states=num_states))
    return KVCacheManager(config, max_model_len=8192, **kw)


def serve_prompt(mgr: KVCacheManager, req: Request) -> int:
    """Admit and prefill ``req`` in chunks cut at its checkpoints, as the scheduler does;
    return its prefix hit."""
    hit, n = mgr.get_computed_blocks(req)
    num = mgr.chunk_limit(req, n, req.num_tokens - n)
    assert mgr.allocate_slots(req, num, n, hit) is not None
    req.num_computed_tokens = n + num
    while req.num_computed_tokens < req.num_tokens:
        num = mgr.chunk_limit(req, req.num_computed_tokens, req.num_tokens - req.num_computed_tokens)
        assert mgr.allocate_slots(req, num) is not None
        req.num_computed_tokens += num
    return n


def decode(mgr: KVCacheManager, req: Request, num_tokens: int) -> None:
    for i in range(num_tokens):
        req.append_output_token_ids(7 + i)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1


def held_states(mgr: KVCacheManager, req: Request) -> list[int]:
    return [b for b in mgr.get_block_ids(req.request_id)[1] if b]


def test_state_pool_checkpoints_the_prompt_end_at_attention_block_granularity(tokens):
    mgr = state_pool_manager(64, 8)
    first = Request("first", tokens(0, 100))
    assert mgr.chunk_limit(first, 0, 100) == 96, "the prefill stops at the prompt's last block boundary"
    assert serve_prompt(mgr, first) == 0
    mgr.free(first)
    assert serve_prompt(mgr, Request("same-96", tokens(0, 96) + tokens(500, 9))) == 96
    assert serve_prompt(mgr, Request("same-50", tokens(0, 50) + tokens(700, 9))) == 0, "no state at 48 yet"


def test_state_pool_checkpoints_where_attention_ran_ahead_of_the_state(tokens):
    mgr = state_pool_manager(64, 8)
    serve_prompt(mgr, Request("a", tokens(0, 100)))
    b = Request("b", tokens(0, 50) + tokens(700, 30))
    _hit, n = mgr.get_computed_blocks(b)
    assert n == 0 and mgr.checkpoint_positions(b, 0) == (48, 64, 80)  # the junction, the resend point, the end
    assert serve_prompt(mgr, b) == 0
    assert serve_prompt(mgr, Request("c", tokens(0, 50) + tokens(900, 30))) == 48


def test_state_pool_checkpoints_no_junction_where_a_request_extends_a_cached_chain_at_its_end(tokens):
    """A chat turn whose previous turn's state was evicted finds that turn's KV to its end:
    nothing branches there, so no later request is expected to resume there but its own
    next turn, which resumes from this turn's newer checkpoint."""
    mgr = state_pool_manager(64, 8)
    turn = Request("turn-0", tokens(0, 100))
    serve_prompt(mgr, turn)
    mgr.free(turn)
    assert mgr.evict_group_blocks(1, list(mgr.state_pool.cached[1].values())) == 1
    follow = Request("turn-1", tokens(0, 100) + tokens(700, 30))
    _hit, n = mgr.get_computed_blocks(follow)
    assert n == 0 and mgr.checkpoint_positions(follow, 0) == (128,)


def test_a_hit_through_a_shared_checkpoint_requeues_it_as_recently_used(tokens):
    """A chat turn resuming from its previous turn's state passes through the system
    prompt's checkpoint: it stays as warm as the system prompt's KV."""
    mgr = state_pool_manager(64, 8)
    system = tokens(0, 48)
    first = Request("first", system + tokens(100, 52))
    serve_prompt(mgr, first)
    mgr.free(first)
    second = Request("second", system + tokens(700, 30))
    assert serve_prompt(mgr, second) == 0  # checkpoints 48 (the junction) and 64 (its prompt's end)
    mgr.free(second)
    other = Request("other", tokens(2000, 40))
    serve_prompt(mgr, other)
    mgr.free(other)
    shared = mgr.state_pool.cached[1][second.block_hashes[2]]
    assert mgr.state_pool.free_block_ids()[-1] != shared
    follow = Request("second-turn-1", second.all_token_ids + tokens(900, 20))
    hit, n = mgr.get_computed_blocks(follow)
    assert n == 64 and mgr.allocate_slots(follow, 34, n, hit) is not None
    assert mgr.state_pool.free_block_ids()[-1] == shared


def test_state_pool_updates_the_running_state_in_place_and_copies_on_write(tokens):
    mgr = state_pool_manager(64, 8)
    states = mgr.state_pool
    req = Request("r", tokens(0, 100))
    serve_prompt(mgr, req)
    resend_96, running = held_states(mgr, req)
    assert states.is_cached(resend_96) and not states.is_cached(running)
    decode(mgr, req, 11)  # to 111 tokens: the slot moved along, no new one
    assert held_states(mgr, req) == [running]
    decode(mgr, req, 1)  # 112: a block boundary while decoding is a checkpoint; 96's (the resend point) stays
    assert states.is_cached(running) and states.is_cached(resend_96) and states.free_block_ids()[0] != resend_96
    decode(mgr, req, 1)  # the next state goes to a fresh slot; 112's stays intact
    (fresh,) = [b for b in held_states(mgr, req) if b != running]
    assert fresh != resend_96
    decode(mgr, req, 16)  # 129: the checkpoint at 128 supersedes 112's, kept while empty states are left
    checkpoint_128, slot = held_states(mgr, req)
    assert checkpoint_128 == fresh and slot not in (running, resend_96)
    history = req.all_token_ids
    assert mgr.get_computed_blocks(Request("to-113", history[:113]))[1] == 112
    assert mgr.get_computed_blocks(Request("to-129", history[:129]))[1] == 128
    assert mgr.get_computed_blocks(Request("resent", history[:100]))[1] == 96
    assert states.num_free_blocks == 7 - len(held_states(mgr, req))
    mgr.free(req)
    assert states.num_free_blocks == 7


@pytest.mark.parametrize(("num_states", "resend_hits"), [(3, 0), (4, 32)])
def test_a_prompt_checkpoint_is_written_over_rather_than_evict_a_cached_state(tokens, num_states, resend_hits):
    """The state at a prompt's resend position is kept while an empty state is left for the
    last chunk; with none left, that chunk writes over it, and another prompt's cached
    checkpoint survives."""
    mgr = state_pool_manager(64, num_states)
    old = Request("old", tokens(0, 33))
    serve_prompt(mgr, old)
    mgr.free(old)
    req = Request("r", tokens(500, 40))
    serve_prompt(mgr, req)
    assert len(held_states(mgr, req)) == (1 if resend_hits == 0 else 2)
    mgr.free(req)
    assert mgr.get_computed_blocks(Request("old-again", tokens(0, 33)))[1] == 32
    assert mgr.get_computed_blocks(Request("r-again", tokens(500, 40)))[1] == resend_hits


def test_state_pool_out_of_states_refuses_and_changes_nothing(tokens):
    mgr = state_pool_manager(64, 2)
    serve_prompt(mgr, Request("a", tokens(0, 40)))  # its running state, written over its checkpoint at 32
    before = (mgr.state_pool.free_block_ids(), list(mgr.state_pool.ref_cnt), mgr.pool.free_block_ids())
    late = Request("late", tokens(1000, 40))
    hit, n = mgr.get_computed_blocks(late)
    assert mgr.allocate_slots(late, 32, n, hit) is None
    assert before == (mgr.state_pool.free_block_ids(), list(mgr.state_pool.ref_cnt), mgr.pool.free_block_ids())


def test_state_pool_checkpoint_of_a_failed_step_is_never_found(tokens):
    mgr = state_pool_manager(64, 8)
    req = Request("r", tokens(0, 40))
    with pytest.raises(RuntimeError), mgr.step_transaction():
        serve_prompt(mgr, req)
        raise RuntimeError("the device step failed")
    mgr.free(req)
    assert mgr.get_computed_blocks(Request("again", tokens(0, 40)))[1] == 0


def test_state_pool_reset_clears_both_pools_or_neither(tokens):
    mgr = state_pool_manager(64, 8)
    req = Request("r", tokens(0, 40))
    serve_prompt(mgr, req)
    assert not mgr.reset_prefix_cache()
    mgr.free(req)
    assert mgr.state_pool.num_cached_blocks() and mgr.reset_prefix_cache()
    assert mgr.state_pool.num_cached_blocks() == 0 and mgr.pool.num_cached_blocks() == 0


def test_state_pool_request_whose_hit_holds_no_state_takes_a_fresh_slot(tokens):
    mgr = state_pool_manager(64, 8)
    req = Request("r", tokens(0, 100))
    # 64 external tokens (an offload tier's): the state group needs only the state at 64,
    # which the tier loads into the request's running slot.
    assert mgr.allocate_slots(req, 16, num_external_computed_tokens=64) is not None
    assert len(held_states(mgr, req)) == 1 and mgr.get_block_ids("r")[1][-1]


def test_a_state_checkpoint_of_the_open_step_is_not_a_hit_until_the_step_ends(tokens):
    mgr = state_pool_manager(64, 8)
    with mgr.step_transaction():
        serve_prompt(mgr, Request("writer", tokens(0, 40)))  # caches its state at 32 in this step
        assert mgr.get_computed_blocks(Request("same-step", tokens(0, 40)))[1] == 0
    assert mgr.get_computed_blocks(Request("next-step", tokens(0, 40)))[1] == 32


# ------------------------------------------------------------- decode batches
class ValidatedPathRequest(Request):
    """A Request whose every ``allocate_slots`` call takes the whole validated path (the
    threshold shortcuts are for ``Request`` itself): the reference they are checked against."""


def _decode_step_one_by_one(mgr: KVCacheManager, running: list[Request], token: int) -> list[Request]:
    """A decode step through the per-request calls; returns the requests preempted."""
    for req in running:
        req.append_output_token_ids(token)
    preempted = []
    pos = 0
    while pos < len(running):
        if mgr.allocate_slots(running[pos], 1) is None:
            victim = running.pop()
            mgr.free(victim)
            victim.num_computed_tokens = 0
            preempted.append(victim)
            continue
        running[pos].num_computed_tokens += 1
        pos += 1
    return preempted


def _decode_step_batched(mgr: KVCacheManager, running: list[Request], token: int) -> list[Request]:
    """The same step through append_token_ids and allocate_decode_slots."""
    mgr.append_token_ids(running, [token] * len(running))
    preempted = []
    pos = 0
    while pos < len(running):
        served = mgr.allocate_decode_slots(running[pos:])
        for req in running[pos : pos + served]:
            req.num_computed_tokens += 1
        pos += served
        if pos < len(running):
            victim = running.pop()
            mgr.free(victim)
            victim.num_computed_tokens = 0
            preempted.append(victim)
    return preempted


@settings(max_examples=25, deadline=None)
@given(
    model=st.sampled_from(["full", "full+window", "windows+full", "full+state pool"]),
    num_blocks=st.integers(12, 60),
    prompt_lens=st.lists(st.integers(1, 70), min_size=1, max_size=8),
    steps=st.integers(1, 40),
)
def test_a_decode_batch_decides_exactly_like_one_call_per_request(model, num_blocks, prompt_lens, steps):
    """Same blocks, same cache, same preemptions, step by step, under memory pressure too,
    as per-request calls that each run every check and every step of an allocation."""
    models = {
        "full": lambda: make_manager(num_blocks, FULL),
        "full+window": lambda: make_manager(num_blocks, FULL, window(32)),
        "windows+full": lambda: make_manager(num_blocks, window(48), window(48), FULL),
        "full+state pool": lambda: state_pool_manager(num_blocks, 6),
    }
    sides = []
    for step_fn, request_type in ((_decode_step_one_by_one, ValidatedPathRequest), (_decode_step_batched, Request)):
        mgr = models[model]()
        reqs = [request_type(f"r{i}", [1000 + i % 2] * 20 + list(range(n))) for i, n in enumerate(prompt_lens)]
        sides.append((mgr, reqs, [r for r in reqs if admit(mgr, r)[2] is not None], step_fn))
    for step in range(steps):
        seen = []
        for mgr, reqs, running, step_fn in sides:
            preempted = [r.request_id for r in step_fn(mgr, running, 7 + step)]
            blocks = {r.request_id: mgr.get_block_ids(r.request_id) for r in running}
            seen.append((preempted, blocks, [r.all_token_ids[:] for r in reqs], pool_state(mgr)))
        assert seen[0] == seen[1]


def test_a_decode_batch_stops_at_the_first_request_the_pool_cannot_serve(tokens):
    mgr = make_manager(4, FULL)
    a, b = Request("a", tokens(0, 16)), Request("b", tokens(100, 16))
    admit(mgr, a)
    admit(mgr, b)
    mgr.append_token_ids([a, b], [5, 6])
    assert a.all_token_ids[-1] == 5 and b.all_token_ids[-1] == 6
    assert mgr.allocate_decode_slots([a, b]) == 1  # a takes the last free block
    before = pool_state(mgr)
    assert mgr.allocate_decode_slots([b]) == 0
    assert pool_state(mgr) == before and mgr.get_block_ids("b") == ([2],)


def test_a_bad_token_in_a_batch_appends_nothing_to_any_request(tokens):
    mgr = make_manager(11, FULL)
    a, b = Request("a", tokens(0, 15)), Request("b", tokens(100, 15))
    admit(mgr, a)
    admit(mgr, b)
    for bad, match in ((-1, "token id -1"), (2**31, "outside"), (1.5, "1.5"), (True, "True")):
        with pytest.raises(KVCacheManagerError, match=match):
            mgr.append_token_ids([a, b], [3, bad])
    with pytest.raises(KVCacheManagerError, match="1 token ids for 2 requests"):
        mgr.append_token_ids([a, b], [3])
    with pytest.raises(KVCacheManagerError, match=r"expected a jaxkv\.core\.manager\.Request"):
        mgr.append_token_ids([a, "b"], [3, 4])
    assert a.num_tokens == b.num_tokens == 15 and a.block_hashes == b.block_hashes == []
    mgr.append_token_ids([a, b], np.array([3, 4]))
    assert a.all_token_ids[-1] == 3 and b.all_token_ids[-1] == 4
    assert mgr.allocate_decode_slots([a, b]) == 2  # the filled blocks are hashed and cached here
    assert len(a.block_hashes) == len(b.block_hashes) == 1 and len(mgr.pool.cached[0]) == 2


def test_a_decode_batch_refuses_a_bad_lookahead(tokens):
    mgr = make_manager(11, FULL)
    a = Request("a", tokens(0, 15))
    admit(mgr, a)
    with pytest.raises(KVCacheManagerError, match="num_lookahead_tokens must be an int >= 0, got -1"):
        mgr.allocate_decode_slots([a], -1)


def test_misses_are_counted_by_cause(tokens):
    mgr = state_pool_manager(64, 8)
    first = Request("first", tokens(0, 100))
    serve_prompt(mgr, first)
    mgr.free(first)
    stats = mgr.prefix_cache_stats()
    assert (stats.num_missed_not_cached, stats.num_missed_below_block, stats.num_missed_no_checkpoint) == (96, 4, 0)
    assert serve_prompt(mgr, Request("branch", tokens(0, 64) + tokens(900, 30))) == 0, "no state at 64"
    stats = mgr.prefix_cache_stats()
    assert stats.num_missed_no_checkpoint == 64, "attention matched 64 tokens, no checkpoint there"
    assert (stats.num_missed_not_cached, stats.num_missed_below_block) == (96 + 16, 4 + 14)
    missed = stats.num_missed_not_cached + stats.num_missed_below_block + stats.num_missed_no_checkpoint
    assert missed == stats.num_queried_tokens - stats.num_hit_tokens


def test_a_salt_mismatch_is_counted_apart_from_a_prompt_never_cached(tokens):
    mgr = make_manager(64, FULL)

    def miss(request_id, prompt, salt):
        before = mgr.prefix_cache_stats()
        request = Request(request_id, prompt, cache_salt=salt)
        hit = serve_prompt(mgr, request)
        mgr.free(request)
        after = mgr.prefix_cache_stats()
        return (
            hit,
            after.num_missed_salt - before.num_missed_salt,
            after.num_missed_not_cached - before.num_missed_not_cached,
        )

    assert miss("plain", tokens(0, 100), None) == (0, 0, 96)
    assert miss("x-a", tokens(0, 100), "a") == (0, 96, 0), "the unsalted prompt's 6 whole blocks are cached"
    assert miss("y-a", tokens(2000, 100), "a") == (0, 0, 96), "never cached, under any salt"
    assert miss("y-b", tokens(2000, 40) + tokens(700, 60), "b") == (0, 32, 64), "2 blocks shared with salt a's prompt"
    assert miss("x-a-again", tokens(0, 100), "a") == (96, 0, 0), "its own salt hits"
    stats = mgr.prefix_cache_stats()
    missed = stats.num_missed_not_cached + stats.num_missed_salt + stats.num_missed_below_block
    assert missed == stats.num_queried_tokens - stats.num_hit_tokens


def test_a_prefix_evicted_by_pressure_is_counted_apart_from_one_never_cached(tokens):
    mgr = make_manager(9, FULL)  # 8 usable blocks of 16 tokens
    first = Request("first", tokens(0, 100))
    serve_prompt(mgr, first)
    mgr.free(first)
    pusher = Request("pusher", tokens(500, 128))
    serve_prompt(mgr, pusher)  # takes all 8 blocks: first's 6 cached blocks are evicted
    mgr.free(pusher)
    before = mgr.prefix_cache_stats()
    assert before.num_missed_evicted == 0, "nothing was evicted before pusher's lookup"
    again = Request("again", tokens(0, 100))
    assert serve_prompt(mgr, again) == 0
    stats = mgr.prefix_cache_stats()
    assert stats.num_missed_evicted - before.num_missed_evicted == 96, "first's 6 whole blocks: cached, then evicted"
    assert stats.num_missed_not_cached == before.num_missed_not_cached
    mgr.free(again)
    assert serve_prompt(mgr, Request("other", tokens(900, 100))) == 0
    after = mgr.prefix_cache_stats()
    assert after.num_missed_not_cached - stats.num_missed_not_cached == 96, "never cached"
    assert after.num_missed_evicted == stats.num_missed_evicted
    missed = (
        after.num_missed_not_cached
        + after.num_missed_evicted
        + after.num_missed_below_block
        + after.num_missed_no_checkpoint
    )
    assert missed == after.num_queried_tokens - after.num_hit_tokens


def test_a_checkpoint_lru_lost_once_that_served_hits_is_retained_past_churn(tokens):
    system = tokens(0, 64)

    def churned(evicted_once: bool, hits: int) -> tuple[int, int]:
        """(retained states, the late request's hit) after ``hits`` hits on the system prompt's
        checkpoint at 64 and prompts sharing nothing whose checkpoints cycle through every state."""
        mgr = state_pool_manager(400, 17, checkpoint_interval=16)  # 16 states: 2 may be retained
        others = iter(range(1000))

        def churn() -> None:
            for _ in range(20):
                req = Request(f"other{next(others)}", tokens(5000 + 200 * next(others), 40))
                serve_prompt(mgr, req)
                mgr.free(req)

        for i in range(hits + 1 + evicted_once):
            req = Request(f"user{i}", system + tokens(1000 + 100 * i, 40))
            assert serve_prompt(mgr, req) == (0 if i <= evicted_once else 64)
            mgr.free(req)
            if evicted_once and i == 0:
                churn()  # the checkpoint is lost in LRU order, and the next prompt writes it again
        retained = mgr.state_pool.num_retained
        churn()
        return retained, serve_prompt(mgr, Request("late", system + tokens(9000, 40)))

    assert churned(True, 2) == (1, 64), "lost once, then two hits: its last holder retained it, it outlived the churn"
    assert churned(False, 2) == (0, 0), "never lost: plain LRU order, evicted by the churn"
    assert churned(True, 1) == (0, 0), "one hit: plain LRU order"


def test_branch_ahead_lets_the_second_request_of_a_shared_prefix_hit(tokens):
    shared = tokens(0, 1536)
    hits = []
    for branch_ahead in (False, True):
        mgr = state_pool_manager(256, 8, branch_ahead=branch_ahead)
        first = Request("first", shared + tokens(5000, 100))
        serve_prompt(mgr, first)
        mgr.free(first)
        hits.append(serve_prompt(mgr, Request("second", shared + tokens(9000, 60))))
    assert hits == [0, 1376], "off: no state inside the shared prefix; on (default): 1,636 - 256, a block boundary"
    with pytest.raises(KVCacheManagerError, match="branch_ahead"):
        state_pool_manager(16, 4, branch_ahead=1)


def test_a_branch_point_lets_the_next_chat_under_the_same_system_prompt_hit_it(tokens):
    """The server names a chat's system-prompt end: a state waits there before any other
    chat has branched off it (branch-ahead's one guess in so short a prompt, 128 back from
    its end, finds less)."""
    system = tokens(0, 200)
    hits = []
    for points in ((), (200,)):
        mgr = state_pool_manager(64, 8)
        first = Request("first", system + tokens(5000, 50), branch_points=points)
        serve_prompt(mgr, first)
        mgr.free(first)
        hits.append(serve_prompt(mgr, Request("second", system + tokens(9000, 40))))
    assert hits == [112, 192], "the guess 250 - 128 on a block boundary; the named one at or below 200"


def test_a_short_prompts_guess_is_hit_once_then_not_kept_warm_behind_the_junction(tokens):
    """A short prompt that starts a chain guesses a state 128 back from its end: the second
    prompt on the same system prompt resumes there and reveals the junction; a later hit
    through the junction leaves the guess where it was in the free queue (it serves no one
    now), while a shared checkpoint passed through is requeued (see the test above)."""
    mgr = state_pool_manager(64, 8)
    system = tokens(0, 200)
    first = Request("first", system + tokens(5000, 50))
    serve_prompt(mgr, first)
    mgr.free(first)
    second = Request("second", system + tokens(9000, 40))
    assert serve_prompt(mgr, second) == 112, "250 - 128 on a block boundary"
    mgr.free(second)
    guess = mgr.state_pool.cached[1][first.block_hashes[6]]
    junction = mgr.state_pool.cached[1][second.block_hashes[11]]
    other = Request("other", tokens(2000, 40))
    serve_prompt(mgr, other)
    mgr.free(other)
    before = mgr.state_pool.free_block_ids()
    third = Request("third", system + tokens(7000, 30))
    hit, n = mgr.get_computed_blocks(third)
    assert n == 192 and hit.blocks[1][-1] == junction
    assert mgr.allocate_slots(third, third.num_tokens - n, n, hit) is not None
    after = mgr.state_pool.free_block_ids()
    assert after.index(guess) <= before.index(guess), "not requeued as recently used"
    assert after.index(guess) < len(after) - 1


def test_named_branch_points_replace_the_branch_ahead_guesses(tokens):
    """A caller that names where its prompts branch (a chat's message boundaries) gets states
    there and no guess beside them: a guess holds a state's bytes the named ones need."""
    prompt = tokens(0, 1536) + tokens(5000, 100)
    guessed = Request("guessed", prompt)
    named = Request("named", prompt, branch_points=[1536])
    mgr = state_pool_manager(256, 8)
    mgr.get_computed_blocks(guessed)
    mgr.get_computed_blocks(named)
    assert guessed.checkpoint_ahead == (608, 1376), "1,636 - 1,024 and - 256, block boundaries"
    assert named.checkpoint_ahead == (1536,), "the named position alone"


@pytest.mark.parametrize(
    ("points", "match"),
    [
        ([10], r"branch point 10 is not a position in \(0, 10\)"),
        ([0], "branch point 0"),
        ("ab", "branch_points must be a sequence"),
        (list(range(1, 18)), "17 branch_points, at most 16"),
    ],
)
def test_bad_branch_points_are_refused_naming_them(points, match):
    with pytest.raises(KVCacheManagerError, match=match):
        Request("r", list(range(10)), branch_points=points)


def branch_past_a_junction(tokens) -> tuple[KVCacheManager, Request]:
    """A state-pool manager where a running request branched off a cached 100-token chain
    at 64 tokens (a shared junction checkpoint there) and prefilled its prompt."""
    mgr = state_pool_manager(64, 8)
    first = Request("first", tokens(0, 100))
    serve_prompt(mgr, first)
    mgr.free(first)
    branch = Request("branch", tokens(0, 64) + tokens(900, 30))
    serve_prompt(mgr, branch)
    return mgr, branch


def test_a_shared_checkpoint_is_requeued_when_its_request_ends(tokens):
    """It joined the free queue mid-prefill, before the request's own checkpoints: it must
    not be evicted before them, nor before the prefix it completes."""
    mgr, branch = branch_past_a_junction(tokens)
    decode(mgr, branch, 20)  # past two more block boundaries: its own checkpoints queue after the junction
    junction = mgr.written_block(1, branch.block_hashes[3])
    assert junction is not None and junction in mgr.state_pool.free_block_ids()
    assert mgr.state_pool.free_block_ids()[-1] != junction, "queued when the prefill moved past it"
    mgr.free(branch)
    assert mgr.state_pool.free_block_ids()[-1] == junction


@pytest.mark.parametrize("branching", [False, True])
def test_a_running_requests_newest_continuation_is_demoted_only_while_prompts_branch_and_none_resumes(
    tokens, branching
):
    """Kept at the queue's tail while a request runs, each running request's newest
    continuation holds a state's bytes; once 8 admissions left cached chains and none
    extended one at its end (no turn resumes where a request ended), a request admitted then
    demotes it as it decodes past it, and leaves it demoted when it ends."""
    mgr = state_pool_manager(256, 6)
    base = Request("base", tokens(0, 64))
    serve_prompt(mgr, base)
    mgr.free(base)
    for i in range(8 if branching else 0):
        branch = Request(f"branch{i}", tokens(0, 32) + tokens(1000 + 100 * i, 20))
        serve_prompt(mgr, branch)
        mgr.free(branch)
    request = Request("request", tokens(5000, 40))
    serve_prompt(mgr, request)
    decode(mgr, request, 10)  # past its continuation at 48
    newest = mgr.written_block(1, request.block_hashes[2])
    queue = mgr.state_pool.free_block_ids()
    assert newest is not None and newest in queue
    if branching:
        assert newest in queue[:2], "demoted: first to go, behind the one it superseded"
    else:
        assert queue[-1] == newest, "warm: a later turn resumes from it"
    mgr.free(request)
    queue = mgr.state_pool.free_block_ids()
    if branching:
        cached = [b for b in queue if mgr.state_pool.is_cached(b)]
        assert newest in cached[:2], "no turn is expected to resume it: behind the one it superseded, still first"
    else:
        assert queue[-1] == newest


def test_a_cold_requests_last_continuation_is_demoted_when_it_ends_on_it(tokens):
    """A request admitted while prompts branch and none resumes, ending on the continuation
    it cached last (before decoding past it), demotes it when it ends: kept at the queue's
    tail, one such state per finished request holds the bytes that shared prefixes need."""
    mgr = state_pool_manager(256, 6)
    base = Request("base", tokens(0, 64))
    serve_prompt(mgr, base)
    mgr.free(base)
    for i in range(8):
        branch = Request(f"branch{i}", tokens(0, 32) + tokens(1000 + 100 * i, 20))
        serve_prompt(mgr, branch)
        mgr.free(branch)
    request = Request("request", tokens(5000, 48))
    serve_prompt(mgr, request)
    end = mgr.written_block(1, request.block_hashes[2])
    assert end is not None and end not in mgr.state_pool.free_block_ids(), "its prompt's end, still its state"
    mgr.free(request)
    assert mgr.written_block(1, request.block_hashes[2]) == end, "still cached"
    assert mgr.state_pool.free_block_ids()[-1] != end, "not at the tail"


def test_a_running_requests_shared_checkpoint_stays_warm_while_others_churn_the_pool(tokens):
    """Each block the request caches requeues the shared checkpoints it cached, so a
    junction it passed mid-prefill is not evicted by other requests' states while it runs
    (the second request of a shared prefix can arrive before the first ends)."""
    mgr, branch = branch_past_a_junction(tokens)
    junction = mgr.written_block(1, branch.block_hashes[3])
    assert junction is not None
    for i in range(8):
        other = Request(f"other{i}", tokens(2000 + 100 * i, 40))
        serve_prompt(mgr, other)
        mgr.free(other)
        decode(mgr, branch, 16)
    assert mgr.written_block(1, branch.block_hashes[3]) == junction
    second = Request("second", tokens(0, 64) + tokens(500, 20))
    assert serve_prompt(mgr, second) == 64
