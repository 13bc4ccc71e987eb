"""State-aware KV events (jaxkv.serving.state_aware_events): a hybrid's attention blocks are
announced once a state checkpoint lets a prompt resume on their chain, withdrawn when none
does, and the output stream replayed from its start rebuilds exactly what is announced."""

from __future__ import annotations

import functools
import random

import pytest

from jaxkv.core.pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from jaxkv.offload.catalog import KeysRemoved, KeysStored
from jaxkv.planner import plan_kv_cache
from jaxkv.presets import get_preset
from jaxkv.serving.state_aware_events import HostTierEvents, StateAwareEvents

STATE, ATTN = 0, 1
BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(8, "big")


def tokens(ids: list[int]) -> tuple[int, ...]:
    return tuple(t for i in ids for t in range(i * BS, (i + 1) * BS))


def stored(group: int, ids: list[int], parent: int | None = None) -> BlockStored:
    return BlockStored(group, tuple(map(h, ids)), None if parent is None else h(parent), BS, tokens(ids), None)


def removed(group: int, i: int) -> BlockRemoved:
    return BlockRemoved(group, (h(i),))


def fold(announced: set[bytes], events: list[KVCacheEvent]) -> None:
    """Apply output events as a router's radix tree does: a store's parent must be known."""
    for e in events:
        if isinstance(e, BlockStored):
            parent = e.parent_block_hash
            for b in e.block_hashes:
                assert parent is None or parent in announced, "a block announced before its parent"
                assert b not in announced, "a block announced twice"
                announced.add(b)
                parent = b
        elif isinstance(e, BlockRemoved):
            for b in e.block_hashes:
                announced.remove(b)
        elif isinstance(e, AllBlocksCleared):
            announced.clear()


def test_a_chain_is_announced_up_to_its_checkpoint_and_withdrawn_with_it():
    t = StateAwareEvents([ATTN], [STATE])
    assert t.apply([stored(ATTN, [1, 2, 3, 4])]) == []  # KV alone: no prompt resumes on it
    out = t.apply([stored(STATE, [2], parent=1)])
    assert out == [BlockStored(ATTN, (h(1), h(2)), None, BS, tokens([1, 2]), None)]
    out = t.apply([stored(STATE, [4], parent=3)])
    assert out == [BlockStored(ATTN, (h(3), h(4)), h(2), BS, tokens([3, 4]), None)]
    assert t.apply([removed(STATE, 2)]) == []  # the later checkpoint still resumes the chain
    assert sorted(e.block_hashes for e in t.apply([removed(STATE, 4)])) == [(h(i),) for i in (1, 2, 3, 4)]
    assert t.published() == frozenset()


def test_an_evicted_attention_block_withdraws_the_chain_after_it_until_it_is_cached_again():
    t = StateAwareEvents([ATTN], [STATE])
    t.apply([stored(STATE, [2], parent=1), stored(STATE, [4], parent=3), stored(ATTN, [1, 2, 3, 4])])
    assert t.published() == {h(1), h(2), h(3), h(4)}
    out = t.apply([removed(ATTN, 3)])
    assert {e.block_hashes for e in out} == {(h(3),), (h(4),)}
    assert t.published() == {h(1), h(2)}
    out = t.apply([stored(ATTN, [3], parent=2)])
    assert out == [BlockStored(ATTN, (h(3), h(4)), h(2), BS, tokens([3, 4]), None)]


def test_a_hash_is_announced_once_and_withdrawn_with_its_last_copy():
    t = StateAwareEvents([ATTN], [STATE])
    t.apply([stored(ATTN, [1]), stored(ATTN, [1]), stored(STATE, [1])])
    assert t.published() == {h(1)}
    assert t.apply([removed(ATTN, 1)]) == []
    assert t.apply([removed(ATTN, 1)]) == [BlockRemoved(ATTN, (h(1),))]


def test_every_recurrent_and_attention_group_must_hold_it():
    t = StateAwareEvents([ATTN, 2], [STATE, 3])
    assert t.apply([stored(ATTN, [1]), stored(STATE, [1]), stored(3, [1])]) == []
    assert t.apply([stored(2, [1])]) == [BlockStored(ATTN, (h(1),), None, BS, tokens([1]), None)]
    assert t.apply([removed(3, 1)]) == [BlockRemoved(ATTN, (h(1),))]


def test_a_removal_never_heard_of_and_other_groups_change_nothing():
    t = StateAwareEvents([ATTN], [STATE])
    assert t.apply([removed(ATTN, 7), removed(STATE, 7), stored(5, [7])]) == []
    t.apply([stored(ATTN, [1]), stored(STATE, [1])])
    assert t.apply([AllBlocksCleared()]) == [AllBlocksCleared()]
    assert t.published() == frozenset()


def test_only_models_with_recurrent_groups_get_a_transform():
    assert StateAwareEvents.for_config(plan_kv_cache(get_preset("llama-3.1-8b"), 1 << 30, max_model_len=4096)) is None
    t = StateAwareEvents.for_config(plan_kv_cache(get_preset("qwen3-next-80b"), 8 << 30, max_model_len=4096))
    assert t is not None and t.state_groups and t.attention_groups and t.dead_branches and t.branch_points
    with pytest.raises(ValueError, match="attention and state groups"):
        StateAwareEvents([ATTN], [])


def test_the_host_tier_adds_chains_to_host_checkpoints_and_keeps_the_links_of_blocks_the_device_freed():
    device = StateAwareEvents([ATTN], [STATE])
    host = HostTierEvents(device)

    def step(events: list[KVCacheEvent], keys: list[KeysStored | KeysRemoved] = ()) -> list[KVCacheEvent]:
        return host.apply(events, device.apply(events), keys)

    assert step([stored(ATTN, [1, 2, 3]), stored(STATE, [1])]) == [
        BlockStored(ATTN, (h(1),), None, BS, tokens([1]), None)
    ], "the device's chains"
    # a checkpoint at 3 on host: the whole chain is usable with the host tier
    assert step([], [KeysStored(((h(3), STATE),))]) == [BlockStored(ATTN, (h(2), h(3)), h(1), BS, tokens([2, 3]), None)]
    assert step([], [KeysRemoved(((h(3), STATE),))]) == [BlockRemoved(ATTN, (h(2),)), BlockRemoved(ATTN, (h(3),))]
    # a checkpoint at 3 on the device only, its blocks on host only: no hit ends there
    assert step([removed(ATTN, 3), removed(ATTN, 2)], [KeysStored(((h(2), ATTN), (h(3), ATTN)))]) == []
    assert step([stored(STATE, [3], parent=2)]) == []
    # the device frees 3's state; host stores it after: the links came back with the host's stores
    assert step([removed(STATE, 3)], [KeysStored(((h(3), STATE),))]) == [
        BlockStored(ATTN, (h(2), h(3)), h(1), BS, tokens([2, 3]), None)
    ]
    assert step([], [KeysRemoved(((h(2), ATTN),))]) == [BlockRemoved(ATTN, (h(2),)), BlockRemoved(ATTN, (h(3),))]
    assert host.published() == device.published() == {h(1)}


def test_a_branch_point_is_announced_only_with_its_own_checkpoint():
    """Under the branch-point rule two cached branches below a block without a checkpoint
    withdraw it and its chain (a prompt leaving there would resume before it), until it
    or a block above it holds one."""
    t = StateAwareEvents([ATTN], [STATE], branch_points=True)
    t.apply([stored(ATTN, [1, 2, 3]), stored(STATE, [3], parent=2)])
    assert t.published() == {h(1), h(2), h(3)}
    out = t.apply([stored(ATTN, [4], parent=2)])
    assert out == [], "a branch that reaches no checkpoint does not count"
    out = t.apply([stored(STATE, [4], parent=2)])
    assert sorted(e.block_hashes for e in out) == [(h(1),), (h(2),), (h(3),)]
    assert all(isinstance(e, BlockRemoved) for e in out)
    assert t.apply([stored(STATE, [1])]) == [BlockStored(ATTN, (h(1),), None, BS, tokens([1]), None)]
    t.apply([stored(STATE, [2], parent=1)])
    assert t.published() == {h(i) for i in (1, 2, 3, 4)}
    out = t.apply([removed(STATE, 2)])
    assert sorted(e.block_hashes for e in out) == [(h(2),), (h(3),), (h(4),)]
    assert t.published() == {h(1)}
    assert t.apply([removed(ATTN, 4)]) == [BlockStored(ATTN, (h(2), h(3)), h(1), BS, tokens([2, 3]), None)]


def test_a_cached_branch_that_reaches_no_checkpoint_withdraws_the_block_it_leaves_until_that_holds_one():
    """Under the dead-branch rule (:meth:`StateAwareEvents.for_config` builds it) a
    cached block 4 below block 2 with no checkpoint after it withdraws 2's chain: a prompt
    following 4 would be credited 1 and 2 and resume at the start. A checkpoint after 4,
    or at 2, or 4's eviction makes the chain published again."""
    t = StateAwareEvents([ATTN], [STATE], dead_branches=True)
    t.apply([stored(ATTN, [1, 2, 3]), stored(STATE, [3], parent=2)])
    assert t.published() == {h(1), h(2), h(3)}
    out = t.apply([stored(ATTN, [4], parent=2)])
    assert sorted(e.block_hashes for e in out) == [(h(1),), (h(2),), (h(3),)]
    assert all(isinstance(e, BlockRemoved) for e in out)
    t.apply([stored(STATE, [4], parent=2)])
    assert t.published() == {h(i) for i in (1, 2, 3, 4)}, "two branches with checkpoints are fine"
    t.apply([removed(STATE, 4)])
    assert t.published() == frozenset()
    t.apply([stored(STATE, [2], parent=1)])
    assert t.published() == {h(1), h(2), h(3)}, "a prompt following 4 resumes at 2's own checkpoint"
    t.apply([removed(STATE, 2)])
    assert t.apply([removed(ATTN, 4)]) == [BlockStored(ATTN, (h(1), h(2), h(3)), None, BS, tokens([1, 2, 3]), None)]


def test_the_host_tier_counts_where_the_device_resumes_as_a_branch_points_checkpoint():
    """Two branches with checkpoints on host below block 2: the device's checkpoint at 2
    (its chain on device) is where a prompt leaving at 2 resumes, so both branches are
    announced; without it, 2 is a branch point with no checkpoint and all is withdrawn;
    with one branch left, its chain is announced again."""
    device = StateAwareEvents([ATTN], [STATE])
    host = HostTierEvents(device)

    def step(events: list[KVCacheEvent], keys: list[KeysStored | KeysRemoved] = ()) -> list[KVCacheEvent]:
        return host.apply(events, device.apply(events), keys)

    step([stored(ATTN, [1, 2, 3]), stored(ATTN, [4, 5], parent=2), stored(STATE, [2], parent=1)])
    assert host.published() == device.published() == {h(1), h(2)}
    step([], [KeysStored(((h(3), STATE), (h(5), STATE)))])
    assert host.published() == {h(i) for i in (1, 2, 3, 4, 5)}
    out = step([removed(STATE, 2)])
    assert host.published() == device.published() == frozenset()
    assert sorted(e.block_hashes for e in out) == [(h(i),) for i in (1, 2, 3, 4, 5)]
    step([], [KeysRemoved(((h(5), STATE),))])
    assert host.published() == {h(1), h(2), h(3)}


def expected(
    parents: dict[int, int | None],
    attn: dict[int, int],
    state: dict[int, int],
    *,
    branch_points: bool = False,
    dead_branches: bool = False,
) -> set[bytes]:
    """The definition, by brute force: the chain to the block cached (under either rule:
    good, block by block), and a checkpoint on or after it reachable through cached
    blocks. A block is good when it is cached and holds a checkpoint, or (branch points)
    exactly one child reaches a checkpoint and that child is good and (dead branches)
    every cached child reaches a checkpoint and is good."""
    children: dict[int, list[int]] = {}
    for c, p in parents.items():
        if p is not None:
            children.setdefault(p, []).append(c)

    @functools.cache
    def reaches_checkpoint(i: int) -> bool:
        if not attn.get(i):
            return False
        return bool(state.get(i)) or any(reaches_checkpoint(c) for c in children.get(i, ()))

    @functools.cache
    def good(i: int) -> bool:
        if not attn.get(i):
            return False
        if state.get(i):
            return True
        kids = children.get(i, ())
        live = [c for c in kids if reaches_checkpoint(c)]
        return (not branch_points or (len(live) == 1 and good(live[0]))) and (
            not dead_branches or all(reaches_checkpoint(c) and good(c) for c in kids if attn.get(c))
        )

    usable = good if branch_points or dead_branches else (lambda i: bool(attn.get(i)))

    ok: dict[int | None, bool] = {None: True}

    def chain_ok(i: int | None) -> bool:
        path = []
        while i not in ok:
            path.append(i)
            i = parents[i]
        for j in reversed(path):
            ok[j] = ok[parents[j]] and usable(j)
        return ok[path[0]] if path else ok[i]

    return {h(i) for i in parents if chain_ok(i) and reaches_checkpoint(i)}


@pytest.mark.parametrize(
    ("branch_points", "dead_branches"), [(False, False), (True, False), (False, True), (True, True)]
)
@pytest.mark.parametrize("seed", range(4))
def test_random_streams_announce_exactly_the_resumable_blocks_and_replay_to_the_same_set(
    seed, branch_points, dead_branches
):
    """A pool's worth of random stores and evictions over branching chains: after every
    step the announced set is the brute-force definition (under each rule), and folding
    the whole output stream (a late subscriber replaying from 0) gives that set, parents first."""
    rng = random.Random(seed)
    rules = {"branch_points": branch_points, "dead_branches": dead_branches}
    t = StateAwareEvents([ATTN], [STATE], **rules)
    parents: dict[int, int | None] = {}
    attn: dict[int, int] = {}
    state: dict[int, int] = {}
    stream: list[KVCacheEvent] = []
    announcing = pruned = 0  # steps announcing something; steps where the rules withdrew some
    for _ in range(300):
        step: list[KVCacheEvent] = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.45:  # a request caches a chain: from a cached block (or the root) on
                start = rng.choice([None, *[i for i in attn if attn[i]]])
                ids = list(range(len(parents) + 1, len(parents) + 1 + rng.randint(1, 4)))
                parent = start
                for i in ids:
                    parents[i], parent = parent, i
                    attn[i] = attn.get(i, 0) + 1
                step.append(stored(ATTN, ids, start))
                if rng.random() < 0.7:  # a checkpoint on the new blocks, or at the branch point
                    c = rng.choice(ids if start is None or rng.random() < 0.7 else [start])
                    state[c] = state.get(c, 0) + 1
                    step.append(stored(STATE, [c], parents[c]))
            elif kind < 0.55 and attn:  # another copy of a known block, or a recomputed one
                i = rng.choice(list(parents))
                attn[i] = attn.get(i, 0) + 1
                step.append(stored(ATTN, [i], parents[i]))
            elif kind < 0.8 and any(attn.values()):  # mostly a leaf, as a pool evicts
                cached = [i for i in attn if attn[i]]
                inner = {parents[i] for i in cached}
                i = rng.choice([i for i in cached if i not in inner] if rng.random() < 0.7 else cached)
                attn[i] -= 1
                step.append(removed(ATTN, i))
            elif any(state.values()):
                i = rng.choice([i for i in state if state[i]])
                state[i] -= 1
                step.append(removed(STATE, i))
        stream += t.apply(step)
        assert t.published() == expected(parents, attn, state, **rules)
        announcing += bool(t.published())
        pruned += t.published() < expected(parents, attn, state)
    announced: set[bytes] = set()
    fold(announced, stream)
    assert announced == t.published()
    assert announcing > 0 and (pruned > 0) == (branch_points or dead_branches)  # the rules mattered where they apply


@pytest.mark.parametrize("dead_branches", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_device_and_host_streams_announce_what_the_two_tiers_together_resume(seed, dead_branches):
    """Random device stores and evictions and host stores and evictions (keys announced
    once, as the host catalog does, often after the device freed the block): after every
    step the host tier's announced set is the device's chains and the chains cached on
    either tier up to a checkpoint on host or where the device resumes, under the device's
    rules, and folding its output stream gives it back."""
    rng = random.Random(seed)
    device = StateAwareEvents([ATTN], [STATE], dead_branches=dead_branches)
    with_host = HostTierEvents(device)
    parents: dict[int, int | None] = {}
    dev: dict[tuple[int, int], int] = {}  # (group, block) -> device copies
    host: set[tuple[int, int]] = set()
    in_flight: list[tuple[int, int]] = []  # freed by the device, its host store not complete yet
    stream: list[KVCacheEvent] = []
    host_added = 0  # steps where the host tier made more resumable than the device alone

    def held(group: int) -> list[int]:
        return [i for (g, i), n in dev.items() if g == group and n]

    def on_chain(i: int | None) -> bool:
        """Whether the chain from the first block to ``i`` is on device."""
        while i is not None:
            if not dev.get((ATTN, i)):
                return False
            i = parents[i]
        return True

    for _ in range(300):
        step: list[KVCacheEvent] = []
        host_step: list[KeysStored | KeysRemoved] = []
        for _ in range(rng.randint(1, 4)):
            kind = rng.random()
            if kind < 0.35:  # a request caches a chain on device, from a cached block (or the root) on
                start = rng.choice([None, *held(ATTN)])
                ids = list(range(len(parents) + 1, len(parents) + 1 + rng.randint(1, 4)))
                parent = start
                for i in ids:
                    parents[i], parent = parent, i
                    dev[ATTN, i] = dev.get((ATTN, i), 0) + 1
                step.append(stored(ATTN, ids, start))
                if rng.random() < 0.7:
                    c = rng.choice(ids)
                    dev[STATE, c] = dev.get((STATE, c), 0) + 1
                    step.append(stored(STATE, [c], parents[c]))
            elif kind < 0.55 and parents:  # evicted from device
                group = rng.choice([ATTN, STATE])
                if held(group):
                    i = rng.choice(held(group))
                    dev[group, i] -= 1
                    step.append(removed(group, i))
                    if rng.random() < 0.6:
                        in_flight.append((group, i))
            elif kind < 0.8 and parents:  # a store to host completes, mostly of what the device freed
                key = (
                    in_flight.pop(0)
                    if in_flight and rng.random() < 0.8
                    else (rng.choice([ATTN, STATE]), rng.choice(list(parents)))
                )
                if key not in host:
                    host.add(key)
                    host_step.append(KeysStored(((h(key[1]), key[0]),)))
            elif host:  # evicted from host
                key = rng.choice(sorted(host))
                host.remove(key)
                host_step.append(KeysRemoved(((h(key[1]), key[0]),)))
        stream += with_host.apply(step, device.apply(step), host_step)
        on_device = {g: {i: dev.get((g, i), 0) for i in parents} for g in (ATTN, STATE)}
        device_chains = expected(parents, on_device[ATTN], on_device[STATE], dead_branches=dead_branches)
        either = {i: on_device[ATTN][i] + ((ATTN, i) in host) for i in parents}
        # a hit ends at a checkpoint on host, or where the device resumes (a checkpoint, its chain on device)
        ends = {i: int((STATE, i) in host or (on_device[STATE][i] > 0 and on_chain(i))) for i in parents}
        host_chains = expected(parents, either, ends, branch_points=True, dead_branches=dead_branches)
        assert with_host.published() == device_chains | host_chains
        assert device.published() <= with_host.published()
        host_added += device.published() < with_host.published()
    announced: set[bytes] = set()
    fold(announced, stream)
    assert announced == with_host.published()
    assert host_added > 0
