"""The hybrid cache-hit fixed point across groups of different types and block sizes."""

import pytest
from kv_configs import FULL, admit, make_config, window

from jaxkv.core.coordinator import CoordinatorError, KVCacheCoordinator
from jaxkv.core.manager import KVCacheManager, Request
from jaxkv.core.pool import AllBlocksCleared, BlockStored
from jaxkv.planner import KVCacheConfig, KVCacheGroup, PlanError, PlanOptions, SharedStates, plan_kv_cache
from jaxkv.presets import get_preset
from jaxkv.specs import MambaSpec

MAMBA = MambaSpec(shapes=((8, 3), (8, 16)), dtypes=("float32", "float32"))


def hybrid_manager() -> KVCacheManager:
    """Full and window(32) attention at block size 16, Mamba checkpoints every 32 tokens."""
    groups = (
        KVCacheGroup(("attn",), FULL, 16),
        KVCacheGroup(("swa",), window(32), 16),
        KVCacheGroup(("mamba",), MAMBA, 32),
    )
    return KVCacheManager(KVCacheConfig(num_blocks=64, groups=groups), max_model_len=1024)


def test_hits_agree_across_types_on_a_multiple_of_the_lcm(tokens):
    mgr = hybrid_manager()
    prompt = tokens(0, 128)
    admit(mgr, Request("c", prompt[:96]))  # Mamba checkpoint after 96 tokens
    _, n, _ = admit(mgr, Request("a", prompt))
    assert n == 96
    a_blocks = mgr.get_block_ids("a")

    hit, n = mgr.get_computed_blocks(Request("b", prompt + tokens(900, 5)))
    assert n == 128
    full, swa, mamba = hit.get_block_ids()
    assert full == a_blocks[0][:8]
    assert swa == [0] * 6 + a_blocks[1][6:8]
    assert mamba == [0, 0, 0, a_blocks[2][3]]

    # The window loses block 6: its run ends at 96 tokens; Mamba must then agree on 96.
    mgr.evict_blocks([a_blocks[1][6]])
    hit, n = mgr.get_computed_blocks(Request("b2", prompt + tokens(900, 5)))
    assert n == 96
    full, swa, mamba = hit.get_block_ids()
    assert len(full) == 6 and swa[:4] == [0] * 4 and all(swa[4:])
    assert mamba[:2] == [0, 0] and mamba[2] == mgr.get_block_ids("c")[2][2]


def test_hashes_per_group_follow_each_group_block_size(tokens):
    mgr = hybrid_manager()
    req = Request("r", tokens(0, 100))
    mgr.hash_request(req)
    full, swa, mamba = mgr.coordinator.hashes_per_group(req.block_hashes)
    assert list(full) == list(swa) == list(req.block_hashes) and len(full) == 6
    assert list(mamba) == list(req.block_hashes[1::2])  # a 32-token block ends every other 16


def test_a_hit_shorter_than_the_largest_block_is_no_hit(tokens):
    mgr = hybrid_manager()
    admit(mgr, Request("a", tokens(0, 20)))
    assert mgr.get_computed_blocks(Request("b", tokens(0, 30)))[1] == 0


def test_block_sizes_must_be_multiples_of_the_smallest():
    groups = (KVCacheGroup(("a",), FULL, 16), KVCacheGroup(("b",), MAMBA, 24))
    with pytest.raises(PlanError, match=r"multiples of the smallest .16., got 24"):
        KVCacheConfig(num_blocks=8, groups=groups)


def test_groups_of_one_type_are_searched_together():
    groups = (*tuple(KVCacheGroup((f"l{i}",), window(64), 16) for i in range(5)), KVCacheGroup(("f",), FULL, 16))
    coord = KVCacheCoordinator(KVCacheConfig(num_blocks=8, groups=groups))
    assert [t.group_ids for t in coord.types] == [(5,), (0, 1, 2, 3, 4)]


def test_an_unknown_retention_rule_is_refused_by_name():
    with pytest.raises(CoordinatorError, match="'lru'"):
        KVCacheCoordinator(make_config(8, FULL), retention="lru")


def test_a_reset_is_one_all_blocks_cleared_between_every_pools_events(tokens):
    config = plan_kv_cache(
        get_preset("tiny-mamba-hybrid"), 1 << 22, max_model_len=64, options=PlanOptions(state_layout="state_pool")
    )
    mgr = KVCacheManager(config, enable_events=True)
    admit(mgr, Request("a", tokens(0, 48)))
    mgr.free("a")
    assert mgr.reset_prefix_cache()
    admit(mgr, Request("b", tokens(100, 48)))
    events = mgr.take_events()
    cut = [i for i, e in enumerate(events) if isinstance(e, AllBlocksCleared)]
    assert len(cut) == 1, "the reset cleared both pools at once"
    before, after = events[: cut[0]], events[cut[0] + 1 :]
    state_group = config.state_group_ids[0]
    for side in (before, after):
        assert {e.group for e in side} == {0, 1} and all(isinstance(e, BlockStored) for e in side)
        assert any(e.group == state_group for e in side), "the state pool's checkpoints on both sides"


def mixed_block_manager(num_blocks: int) -> KVCacheManager:
    """Full attention with 32-token blocks beside a window of 8 with 8-token blocks (lcm 32)."""
    groups = (KVCacheGroup(("full",), FULL, 32), KVCacheGroup(("swa",), window(8), 8))
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, groups=groups), max_model_len=1024)


def test_a_window_group_caches_only_the_blocks_a_hit_can_end_on(tokens):
    mgr = mixed_block_manager(16)
    req = Request("a", tokens(0, 64))
    admit(mgr, req)
    _, swa = mgr.get_block_ids("a")
    swa_hashes = mgr.coordinator.hashes_per_group(req.block_hashes)[1]
    cached = [i for i, (b, h) in enumerate(zip(swa, swa_hashes, strict=False)) if mgr.coordinator.is_cached_as(1, b, h)]
    assert cached == [3, 7]  # the one block before each 32-token boundary


def test_blocks_past_the_last_lcm_boundary_wait_for_the_next_one(tokens):
    groups = (KVCacheGroup(("full",), FULL, 32), KVCacheGroup(("swa",), window(12), 8))
    mgr = KVCacheManager(KVCacheConfig(num_blocks=32, groups=groups), max_model_len=1024)
    req = Request("a", tokens(0, 48))
    admit(mgr, req)

    def cached() -> list[int]:
        swa_hashes = mgr.coordinator.hashes_per_group(req.block_hashes)[1]
        swa = mgr.get_block_ids("a")[1]
        return [
            i
            for i, (b, h) in enumerate(zip(swa, swa_hashes, strict=False))  # a partial last block has no hash
            if b and mgr.coordinator.is_cached_as(1, b, h)
        ]

    assert cached() == [2, 3]  # blocks 4, 5 lead the second segment: no hit ends after them
    full = mgr.coordinator.managers[0]
    for t in range(16):
        req.append_output_token_ids(1000 + t)
        mgr.hash_request(req)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        if req.num_computed_tokens == 60:
            assert cached() == [] and full.num_cached["a"] == 1  # 56 tokens: block 6 is full, 64 is not reached
    assert cached() == [6, 7] and full.num_cached["a"] == 2


@pytest.mark.parametrize(("spare", "kept"), [(2, 64), (1, 32)])
def test_an_unrelated_request_takes_the_unusable_window_blocks_first(tokens, spare, kept):
    # The prompt holds 2 full + 8 window blocks; the unrelated 48-token one 2 + 6.
    mgr = mixed_block_manager(1 + 10 + spare)
    prompt = tokens(0, 64)
    a = Request("a", prompt)
    admit(mgr, a)
    mgr.free(a)
    other = Request("b", tokens(5000, 48))
    assert admit(mgr, other)[2] is not None
    assert mgr.get_computed_blocks(Request("c", [*prompt, 7]))[1] == kept


def shared_pages_manager(num_blocks: int) -> KVCacheManager:
    """Full attention at 16-token blocks; a Mamba state weighs 3 of its blocks (shared pages)."""
    groups = (KVCacheGroup(("mamba",), MAMBA, 16), KVCacheGroup(("attn",), FULL, 16))
    shared = SharedStates(pages_per_state=3, state_bytes=MAMBA.state_bytes)
    return KVCacheManager(KVCacheConfig(num_blocks=num_blocks, groups=groups, states=shared), max_model_len=512)


def test_shared_pages_admit_as_many_requests_as_the_pages_hold(tokens):
    mgr = shared_pages_manager(1 + 4 * (3 + 3))  # 40 tokens: 3 attention blocks + a 3-block state each
    admitted = [admit(mgr, Request(f"r{i}", tokens(1000 * i, 40)))[2] is not None for i in range(5)]
    assert admitted == [True] * 4 + [False]
    assert mgr.num_free_blocks == 0


def test_a_checkpoint_is_cached_not_held_and_hits_through_the_shared_pool(tokens):
    mgr = shared_pages_manager(1 + 2 * 6)
    a = Request("a", tokens(0, 32))
    admit(mgr, a)
    state = mgr.get_block_ids("a")[0][-1]
    assert len(mgr.coordinator.pool.unit_blocks(state)) == 3
    mgr.free(a)
    assert mgr.num_free_blocks == 12
    hit, n = mgr.get_computed_blocks(Request("b", tokens(0, 40)))
    assert n == 32 and hit.get_block_ids()[0] == [0, state]


def test_pages_for_a_new_request_evict_a_cached_state_as_a_unit(tokens):
    mgr = shared_pages_manager(1 + 2 * 6)
    a = Request("a", tokens(0, 32))
    admit(mgr, a)
    mgr.free(a)
    assert admit(mgr, Request("b", tokens(500, 40)))[2] is not None
    assert admit(mgr, Request("c", tokens(900, 40)))[2] is not None, "the cached checkpoint's 3 blocks were free"
    assert mgr.get_computed_blocks(Request("d", tokens(0, 40)))[1] == 0


def test_the_next_turn_s_own_checkpoint_supersedes_the_one_it_resumed_from(tokens):
    mgr = shared_pages_manager(1 + 4 * 8)
    a = Request("a", tokens(0, 32))
    admit(mgr, a)
    resumed = mgr.get_block_ids("a")[0][-1]
    mgr.free(a)
    b = Request("b", tokens(0, 48))
    assert admit(mgr, b)[1] == 32
    for t in range(16):
        b.append_output_token_ids(2000 + t)
        mgr.hash_request(b)
        assert mgr.allocate_slots(b, 1) is not None
        b.num_computed_tokens += 1
    pool = mgr.coordinator.pool
    # superseded, but the pool has empty blocks left: it waits in queue order, still findable
    assert pool.is_cached(resumed) and pool.free_block_ids()[0] != resumed
