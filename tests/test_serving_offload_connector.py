"""Host-side rules of the offload connector: external tokens in the manager, host hits."""

import pytest
from kv_configs import FULL, make_manager, window

from jaxkv.core.manager import KVCacheManagerError, Request
from jaxkv.offload.catalog import PolicyOffloadingManager
from jaxkv.offload.host_blocks import HostBlockBackend
from jaxkv.serving.offload_connector import ConnectorError, OffloadConfig, OffloadConnector
from jaxkv.specs import MambaSpec


def test_external_tokens_get_fresh_blocks_except_out_of_window_nulls(tokens):
    mgr = make_manager(30, FULL, window(32))
    req = Request("r", tokens(0, 100))
    new = mgr.allocate_slots(req, 4, num_external_computed_tokens=96)
    # 96 computed: the window needs tokens from 65 on, i.e. blocks 4 and 5 (and 6 for new tokens).
    assert new.get_block_ids() == ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10])
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 8, 9, 10])
    assert len(mgr.pool.cached[0]) == 6 and len(mgr.pool.cached[1]) == 2


def test_external_tokens_follow_a_device_hit(tokens):
    mgr = make_manager(30, FULL, window(32))
    first = Request("a", tokens(0, 40))
    mgr.allocate_slots(first, 40)
    mgr.free(first)
    req = Request("b", tokens(0, 100))
    hit, n = mgr.get_computed_blocks(req)
    assert n == 32
    mgr.allocate_slots(req, 4, n, hit, num_external_computed_tokens=64)
    full, win = mgr.get_block_ids("b")
    assert full[:2] == hit.get_block_ids()[0] and len(full) == 7 and all(full)
    # At 96 tokens the window no longer reaches the device hit's window blocks nor the
    # first external ones: they are null, and the hit's window blocks are not taken.
    assert win[:4] == [0, 0, 0, 0] and all(win[4:]) and len(win) == 7
    assert not set(hit.get_block_ids()[1]) & set(win)
    req.num_computed_tokens = 100
    req.append_output_token_ids(1)
    mgr.allocate_slots(req, 1)
    assert mgr.get_block_ids("b")[1][:4] == [0, 0, 0, 0]


def test_a_request_freed_right_after_external_admission_returns_everything(tokens):
    mgr = make_manager(30, FULL, window(32))
    first = Request("a", tokens(0, 40))
    mgr.allocate_slots(first, 40)
    mgr.free(first)
    req = Request("b", tokens(0, 100))
    hit, n = mgr.get_computed_blocks(req)
    mgr.allocate_slots(req, 4, n, hit, num_external_computed_tokens=64)
    mgr.free(req)
    assert mgr.pool.ref_cnt[0] == 0 and not any(mgr.pool.ref_cnt)
    assert mgr.num_free_blocks == 29


@pytest.mark.parametrize(
    "kwargs, match",
    [({"num_external_computed_tokens": 8}, "multiple"), ({"num_external_computed_tokens": -16}, "external")],
)
def test_bad_external_tokens_raise_and_change_nothing(tokens, kwargs, match):
    mgr = make_manager(30, FULL, window(32))
    req = Request("r", tokens(0, 100))
    free = mgr.num_free_blocks
    with pytest.raises(KVCacheManagerError, match=match):
        mgr.allocate_slots(req, 4, **kwargs)
    assert mgr.num_free_blocks == free and not mgr.coordinator.has_request("r")


def test_external_tokens_for_a_running_request_are_refused(tokens):
    mgr = make_manager(30, FULL)
    req = Request("r", tokens(0, 100))
    mgr.allocate_slots(req, 16)
    with pytest.raises(KVCacheManagerError, match="new request"):
        mgr.allocate_slots(req, 4, num_external_computed_tokens=16)


def test_external_tokens_out_of_blocks_return_none(tokens):
    mgr = make_manager(6, FULL)
    req = Request("r", tokens(0, 100))
    assert mgr.allocate_slots(req, 4, num_external_computed_tokens=96) is None
    assert mgr.num_free_blocks == 5 and not mgr.pool.num_cached_blocks()


def host_hit(stored: dict[int, list[int]], num_tokens: int = 100) -> int:
    """The host hit of a new request when host holds blocks ``stored[group]``."""
    mgr = make_manager(30, FULL, window(32))
    req = Request("r", list(range(num_tokens)))
    mgr.hash_request(req)
    offload = PolicyOffloadingManager(HostBlockBackend(64))
    keys = [(req.block_hashes[i], g) for g, idx in stored.items() for i in idx]
    offload.prepare_store(keys)
    offload.complete_store(keys)
    connector = OffloadConnector(mgr, runner=None, offload=offload, transfers=None)  # host rules only
    hit = connector._host_hit(req, mgr.hashes_per_group(req), 0)
    return hit.end - hit.start if hit else 0


def test_host_hit_needs_every_group_but_only_the_window_blocks():
    assert host_hit({0: list(range(6)), 1: [4, 5]}) == 96
    assert host_hit({0: list(range(6)), 1: [3, 4]}) == 80  # window at 80: blocks 3, 4
    assert host_hit({0: list(range(4)), 1: list(range(6))}) == 64
    assert host_hit({0: list(range(6)), 1: []}) == 0
    assert host_hit({0: [0], 1: [0]}, num_tokens=17) == 16  # capped below the last token


def test_an_admission_served_from_the_device_refreshes_the_prefix_on_host(tokens):
    """vLLM refreshes host recency on every lookup: a prefix used constantly from the
    device must not age out of the host tier."""
    mgr = make_manager(30, FULL)
    prompt = tokens(0, 64)
    mgr.allocate_slots(Request("warm", prompt), 64)
    mgr.free("warm")
    hot = Request("probe", prompt)
    mgr.hash_request(hot)
    offload = PolicyOffloadingManager(HostBlockBackend(4), "lru")
    hot_keys = [(h, 0) for h in hot.block_hashes[:2]]
    cold_keys = [(bytes([i]) * 32, 0) for i in range(2)]
    for keys in (hot_keys, cold_keys):  # the hot prefix is the least recent on host
        offload.prepare_store(keys)
        offload.complete_store(keys)
    connector = OffloadConnector(mgr, runner=None, offload=offload, transfers=None)
    req = Request("r", prompt)
    hit, n = mgr.get_computed_blocks(req)
    assert connector.allocate_admitted(req, hit, n, budget=64) == 48
    plan = offload.prepare_store([(b"new" * 11, 0), (b"new2" * 8, 0)])
    assert set(plan.evicted) == set(cold_keys)


def test_a_recurrent_model_needs_a_state_tier_and_its_hit_needs_a_checkpoint_on_host():
    state = MambaSpec(shapes=((2, 2),), dtypes=("float32",))
    mgr = make_manager(30, FULL, state)
    offload = PolicyOffloadingManager(HostBlockBackend(64))
    with pytest.raises(ConnectorError, match=r"groups \[1\] hold recurrent state: the host tier needs a state tier"):
        OffloadConnector(mgr, runner=None, offload=offload, transfers=None)
    req = Request("r", list(range(100)))
    mgr.hash_request(req)
    states = PolicyOffloadingManager(HostBlockBackend(8))
    connector = OffloadConnector(mgr, runner=None, offload=offload, transfers=None, states=(states, None))
    for catalog, keys in ((offload, [(h, 0) for h in req.block_hashes[:6]]), (states, [(req.block_hashes[3], 1)])):
        catalog.prepare_store(keys)
        catalog.complete_store(keys)
    hit = connector._host_hit(req, mgr.hashes_per_group(req), 0)
    assert (hit.start, hit.end) == (0, 64), "attention reaches 96, the only checkpoint on host sits at 64"


def test_no_chunk_ending_on_a_block_in_the_budget_admits_nothing_and_unpins_the_host_hit():
    state = MambaSpec(shapes=((2, 2),), dtypes=("float32",))
    mgr = make_manager(30, FULL, state)  # vLLM's layout: chunks end on blocks of 16, as vLLM cuts them
    req = Request("r", list(range(100)))
    mgr.hash_request(req)
    offload, states = PolicyOffloadingManager(HostBlockBackend(64)), PolicyOffloadingManager(HostBlockBackend(8))
    connector = OffloadConnector(mgr, runner=None, offload=offload, transfers=None, states=(states, None))
    for catalog, keys in ((offload, [(h, 0) for h in req.block_hashes[:4]]), (states, [(req.block_hashes[3], 1)])):
        catalog.prepare_store(keys)
        catalog.complete_store(keys)
    free = mgr.num_free_blocks
    hit, n = mgr.get_computed_blocks(req)
    assert connector.allocate_admitted(req, hit, n, budget=8) is None  # 64 + 8 and 0 + 8 end on no block
    assert not mgr.has_request("r") and mgr.num_free_blocks == free
    assert offload.num_keys_by_state()["pinned"] == 0 == states.num_keys_by_state()["pinned"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"host_bytes": 10**20}, "host_bytes=100,000,000,000,000,000,000 exceeds this host's"),
        ({"host_bytes": 0}, "host_bytes must be a positive int, got 0"),
        ({"host_bytes": 1 << 20, "fail_load": 3}, "fail_load must be None or a callable, got 3"),
        ({"host_bytes": 1 << 20, "state_host_bytes": 2 << 20}, r"state_host_bytes must be an int in \[0, host_bytes"),
    ],
)
def test_offload_configs_that_cannot_work_are_refused_by_name(kwargs, match):
    with pytest.raises(ConnectorError, match=match):
        OffloadConfig(**kwargs)
