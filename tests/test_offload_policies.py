"""LRU and ARC eviction policies: victim order, pinned skipping, ARC adaptation."""

import pytest

from jaxkv.offload.policies import ARCPolicy, LRUPolicy, UnknownPolicyError, make_policy


def always(_key) -> bool:
    return True


def run_cache(policy, trace) -> int:
    """Hits of a plain cache of ``policy.capacity`` keys driven by ``policy`` over ``trace``."""
    hits = 0
    resident: set = set()
    for key in trace:
        if key in resident:
            hits += 1
            policy.touch([key], always)
            continue
        need = len(resident) + 1 - policy.capacity
        victims = policy.choose_victims(max(need, 0), always, [key])
        policy.admit([key], victims)
        resident.difference_update(victims)
        resident.add(key)
    return hits


def scan_trace() -> list:
    """Each pass reads a working set of 6 keys twice, then a one-shot scan of 10 keys."""
    trace, fresh = [], 1000
    for _ in range(30):
        trace += [f"w{i}" for i in range(6)] * 2
        trace += [fresh + i for i in range(10)]
        fresh += 10
    return trace


def test_make_policy_by_name():
    assert isinstance(make_policy("lru", 4), LRUPolicy)
    assert isinstance(make_policy("arc", 4), ARCPolicy)
    with pytest.raises(UnknownPolicyError, match="'fifo'"):
        make_policy("fifo", 4)


@pytest.mark.parametrize("name", ["lru", "arc"])
def test_choose_victims_is_pure_and_skips_unevictable(name):
    policy = make_policy(name, 3)
    policy.admit(["a", "b", "c"], [])
    before = policy.resident()
    assert policy.choose_victims(1, lambda k: k != "a", ["d"]) == ["b"]
    assert policy.choose_victims(3, lambda k: k != "a", ["d"]) is None
    assert policy.resident() == before


def test_lru_evicts_least_recent():
    policy = make_policy("lru", 3)
    policy.admit(["a", "b", "c"], [])
    policy.touch(["a"], always)
    assert policy.choose_victims(2, always, ["d", "e"]) == ["b", "c"]


def test_arc_hit_promotes_to_t2_and_t1_is_evicted_first():
    policy = ARCPolicy(3)
    policy.admit(["a", "b", "c"], [])
    policy.touch(["a"], always)
    assert list(policy.t2) == ["a"] and list(policy.t1) == ["b", "c"]
    assert policy.choose_victims(2, always, ["d", "e"]) == ["b", "c"]


def test_arc_ghost_hit_in_b1_grows_p_and_reenters_in_t2():
    policy = ARCPolicy(2)
    policy.admit(["a", "b"], [])
    policy.touch(["b"], always)
    policy.admit(["c"], policy.choose_victims(1, always, ["c"]))  # a -> B1
    assert list(policy.b1) == ["a"] and policy.p == 0
    policy.admit(["a"], policy.choose_victims(1, always, ["a"]))
    assert policy.p == 1 and "a" in policy.t2 and list(policy.b2) == ["b"]


def test_arc_ghost_hit_in_b2_shrinks_p():
    policy = ARCPolicy(2)
    policy.p = 2.0
    policy.admit(["a", "b"], [])
    policy.touch(["a", "b"], always)  # both in T2
    policy.admit(["c"], policy.choose_victims(1, always, ["c"]))  # T1 empty: a -> B2
    assert list(policy.b2) == ["a"]
    policy.admit(["a"], policy.choose_victims(1, always, ["a"]))
    assert policy.p == 1 and "a" in policy.t2


def test_arc_ghost_lists_stay_bounded():
    policy = ARCPolicy(4)
    run_cache(policy, scan_trace())
    assert len(policy.t1) + len(policy.b1) <= 4
    assert len(policy.t1) + len(policy.t2) + len(policy.b1) + len(policy.b2) <= 8


def test_arc_beats_lru_with_one_shot_scans():
    lru, arc = run_cache(LRUPolicy(8), scan_trace()), run_cache(ARCPolicy(8), scan_trace())
    assert lru == 6 * 30  # every scan flushes the working set: only the re-reads hit
    assert arc >= lru + 0.9 * 6 * 29  # ARC keeps the working set in T2 across scans
