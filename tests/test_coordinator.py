"""The hybrid cache-hit fixed point across groups of different types and block sizes."""

import pytest
from kv_configs import FULL, admit, make_config, window

from jaxkv.coordinator import CoordinatorError, KVCacheCoordinator
from jaxkv.manager import KVCacheManager, Request
from jaxkv.planner import KVCacheConfig, KVCacheGroup, PlanError, plan_kv_cache
from jaxkv.pool import AllBlocksCleared, BlockStored
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
    config = plan_kv_cache(get_preset("tiny-mamba-hybrid"), 1 << 22, max_model_len=64, state_layout="state_pool")
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
