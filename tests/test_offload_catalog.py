"""Offloading manager: one test per state rule (both policies), and random sequences."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from jaxkv.offload.catalog import (
    KeysRemoved,
    KeysStored,
    NotPinnedError,
    NotReadyError,
    NotStoredError,
    PolicyOffloadingManager,
)
from jaxkv.offload.host_blocks import HostBlockBackend

POLICY_NAMES = ("lru", "arc")


def key(i: int, group: int = 0):
    return (f"h{i}".encode(), group)


def keys(*ids: int):
    return [key(i) for i in ids]


def stored(name: str, capacity: int, *ids: int) -> PolicyOffloadingManager:
    mgr = PolicyOffloadingManager(HostBlockBackend(capacity), name)
    if ids:
        mgr.prepare_store(keys(*ids))
        mgr.complete_store(keys(*ids))
    mgr.take_events()
    return mgr


def snapshot(mgr: PolicyOffloadingManager):
    return (
        {k: (e.place, e.ready, e.pins) for k, e in mgr._entries.items()},
        mgr.backend.num_free,
        mgr.policy.resident(),
    )


@pytest.fixture(params=POLICY_NAMES)
def name(request):
    return request.param


def test_lookup_counts_leading_ready_keys(name):
    mgr = stored(name, 4, 0, 1)
    mgr.prepare_store(keys(2))  # being stored: not loadable
    assert mgr.lookup(keys(0, 1, 2)) == 2
    assert mgr.lookup(keys(1, 9, 0)) == 1
    assert mgr.lookup([key(0, group=1)]) == 0  # groups are separate keys


def test_being_stored_is_neither_loadable_nor_evictable(name):
    mgr = stored(name, 2)
    mgr.prepare_store(keys(0, 1))
    with pytest.raises(NotReadyError, match="h0"):
        mgr.prepare_load(keys(0))
    assert mgr.prepare_store(keys(2)) is None


def test_prepare_load_pins_against_eviction(name):
    mgr = stored(name, 2, 0, 1)
    assert sorted(mgr.prepare_load(keys(0))) == [mgr._entries[key(0)].place]
    out = mgr.prepare_store(keys(2))
    assert out.evicted == (key(1),)
    assert mgr.state(key(0)) == "pinned"


def test_pinned_keys_are_ref_counted(name):
    mgr = stored(name, 1, 0)
    mgr.prepare_load(keys(0))
    mgr.prepare_load(keys(0))
    mgr.complete_load(keys(0))
    assert mgr.prepare_store(keys(1)) is None
    mgr.complete_load(keys(0))
    assert mgr.prepare_store(keys(1)).evicted == (key(0),)


def test_unpinning_unpinned_key_raises_and_changes_nothing(name):
    mgr = stored(name, 3, 0, 1)
    mgr.prepare_load(keys(0))
    before = snapshot(mgr)
    with pytest.raises(NotPinnedError, match="h1"):
        mgr.complete_load(keys(0, 1))
    with pytest.raises(NotPinnedError, match="h0"):
        mgr.complete_load(keys(0, 0))
    assert snapshot(mgr) == before


def test_touch_keeps_first_block_of_prefix_longest(name):
    mgr = stored(name, 3, 0, 1, 2)
    mgr.touch(keys(0, 1, 2))
    assert mgr.prepare_store(keys(3)).evicted == (key(2),)
    assert mgr.prepare_store(keys(4)).evicted == (key(1),)


def test_prepare_store_skips_stored_keys(name):
    mgr = stored(name, 4, 0)
    mgr.prepare_store(keys(1))
    out = mgr.prepare_store(keys(0, 1, 2, 2))
    assert out.keys_to_store == (key(2),) and len(out.where) == 1 and out.evicted == ()


def test_prepare_store_without_room_returns_none_and_changes_nothing(name):
    mgr = stored(name, 3, 0, 1)
    mgr.prepare_load(keys(0))
    before = snapshot(mgr)
    assert mgr.prepare_store(keys(2, 3, 4)) is None
    assert mgr.prepare_store(keys(*range(5, 10))) is None  # larger than the whole tier
    assert snapshot(mgr) == before and mgr.take_events() == []


def test_prepare_store_never_evicts_keys_it_stores(name):
    mgr = stored(name, 2, 0, 1)
    assert mgr.prepare_store(keys(0, 2, 3)) is None  # only 1 evictable (0 is protected)
    assert mgr.prepare_store(keys(0, 2)).evicted == (key(1),)


def test_prepare_store_evicts_preferred_keys_first_then_by_policy(name):
    mgr = stored(name, 5, 0, 1, 2, 3, 4)
    mgr.prepare_load(keys(3))  # pinned: never a victim, preferred or not
    out = mgr.prepare_store(keys(5, 6, 7), prefer=iter(keys(4, 3, 1, 9)))  # 9: not resident
    assert out.evicted == (key(4), key(1), key(0))  # in the order given, then the policy's oldest
    assert mgr.lookup(keys(2)) == 1 and mgr.state(key(3)) == "pinned"
    before = snapshot(mgr)
    assert mgr.prepare_store(keys(*range(8, 12)), prefer=keys(*range(12))) is None  # 2 evictable, not 4
    assert snapshot(mgr) == before


def test_complete_store_failure_drops_only_pending_keys(name):
    mgr = stored(name, 3, 0)
    mgr.prepare_store(keys(0, 1, 2))
    free = mgr.backend.num_free
    mgr.complete_store(keys(0, 1, 2), success=False)
    assert mgr.state(key(0)) == "ready"
    assert mgr.state(key(1)) == mgr.state(key(2)) == "absent"
    assert mgr.backend.num_free == free + 2
    assert mgr.take_events() == []


def test_complete_store_of_unknown_key_raises_and_changes_nothing(name):
    mgr = stored(name, 3)
    mgr.prepare_store(keys(0))
    before = snapshot(mgr)
    with pytest.raises(NotStoredError, match="h7"):
        mgr.complete_store(keys(0, 7))
    assert snapshot(mgr) == before


def test_events_stored_and_removed_each_once(name):
    mgr = stored(name, 2)
    mgr.prepare_store(keys(0, 1))
    assert mgr.take_events() == []
    mgr.complete_store(keys(0, 1))
    mgr.complete_store(keys(0, 1))
    mgr.prepare_store(keys(2))
    events = mgr.take_events()
    assert events[0] == KeysStored(tuple(keys(0, 1)))
    assert len(events) == 2 and isinstance(events[1], KeysRemoved) and len(events[1].keys) == 1
    assert mgr.take_events() == []


# ---------------------------------------------------------------- random sequences
CAPACITY = 4
KEY_IDS = st.lists(st.integers(0, 9), min_size=1, max_size=5)


class OffloadMachine(RuleBasedStateMachine):
    """Random calls against both policies; invariants after every step."""

    def __init__(self):
        super().__init__()
        self.mgrs = [PolicyOffloadingManager(HostBlockBackend(CAPACITY), n) for n in POLICY_NAMES]
        self.announced = [set() for _ in self.mgrs]

    def _each(self, fn):
        for i, mgr in enumerate(self.mgrs):
            before = snapshot(mgr)
            try:
                fn(mgr)
            except (NotPinnedError, NotReadyError, NotStoredError):
                assert snapshot(mgr) == before
            self._events(i, mgr)

    def _events(self, i, mgr):
        for event in mgr.take_events():
            if isinstance(event, KeysStored):
                assert not self.announced[i] & set(event.keys)
                self.announced[i] |= set(event.keys)
            else:
                assert set(event.keys) <= self.announced[i]
                self.announced[i] -= set(event.keys)

    @rule(ids=KEY_IDS)
    def store(self, ids):
        def go(mgr):
            protected = {k: mgr.state(k) for k in mgr._entries if mgr.state(k) in ("pinned", "storing")}
            before = snapshot(mgr)
            out = mgr.prepare_store(keys(*ids))
            if out is None:
                assert snapshot(mgr) == before
                return
            assert not set(out.evicted) & (set(protected) | set(keys(*ids)))

        self._each(go)

    @rule(ids=KEY_IDS, success=st.booleans())
    def complete_store(self, ids, success):
        self._each(lambda mgr: mgr.complete_store(keys(*ids), success))

    @rule(ids=KEY_IDS)
    def load(self, ids):
        self._each(lambda mgr: mgr.prepare_load(keys(*ids)))

    @rule(ids=KEY_IDS)
    def unload(self, ids):
        self._each(lambda mgr: mgr.complete_load(keys(*ids)))

    @rule(ids=KEY_IDS)
    def touch(self, ids):
        self._each(lambda mgr: mgr.touch(keys(*ids)))

    @invariant()
    def consistent(self):
        for i, mgr in enumerate(self.mgrs):
            places = [e.place for e in mgr._entries.values()]
            assert len(places) == len(set(places)) <= CAPACITY
            assert mgr.backend.num_free == CAPACITY - len(places)
            assert sorted(map(str, mgr.policy.resident())) == sorted(map(str, mgr._entries))
            ready = {k for k, e in mgr._entries.items() if e.ready}
            assert ready == self.announced[i]


OffloadMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_random_sequences_keep_invariants = OffloadMachine.TestCase


def test_touching_keys_still_being_stored_does_not_promote_them_in_arc():
    """A one-shot scan touched while its store is in flight stays in ARC's recent list,
    so the next stores evict the scan, not the frequently used set (vLLM's ARC rule)."""
    mgr = stored("arc", 4, 0, 1)
    mgr.touch(keys(0, 1))  # hot: used twice, now in the frequent list
    mgr.prepare_store(keys(2, 3))
    mgr.touch(keys(2, 3))  # the scan is looked up while storing
    assert key(2) not in mgr.policy.t2 and key(3) not in mgr.policy.t2
    mgr.complete_store(keys(2, 3))
    assert set(mgr.prepare_store(keys(4, 5)).evicted) == set(keys(2, 3))


def test_touching_a_key_still_being_stored_makes_it_recent_in_lru():
    """vLLM's LRU moves any key it holds to the recent end, ready or not: after the
    touch, the older ready key is the one a later store evicts."""
    mgr = stored("lru", 2)
    mgr.prepare_store(keys(0))  # still being stored
    mgr.prepare_store(keys(1))
    mgr.complete_store(keys(1))
    mgr.touch(keys(0))
    mgr.complete_store(keys(0))
    assert mgr.prepare_store(keys(2)).evicted == (key(1),)


def test_touching_a_key_still_being_stored_moves_it_to_the_recent_end_of_arc_t1():
    mgr = stored("arc", 3, 0)
    mgr.prepare_store(keys(1))  # still being stored
    mgr.prepare_store(keys(2))
    mgr.complete_store(keys(2))
    mgr.touch(keys(1))
    assert list(mgr.policy.t1) == keys(0, 2, 1) and not mgr.policy.t2


def test_audit_counts_keys_by_state_and_allocated_places(name):
    mgr = stored(name, 4, 0, 1)
    mgr.prepare_store(keys(2))
    mgr.prepare_load(keys(0))
    assert mgr.num_keys_by_state() == {"storing": 1, "ready": 1, "pinned": 1}
    assert mgr.num_allocated_places() == len(mgr) == 3
