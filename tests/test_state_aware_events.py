"""State-aware KV events (jaxkv.serving.state_aware_events): a hybrid's attention blocks are
announced once a state checkpoint lets a prompt resume on their chain, withdrawn when none
does, and the output stream replayed from its start rebuilds exactly what is announced."""

from __future__ import annotations

import random

import pytest

from jaxkv.core.pool import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from jaxkv.planner import plan_kv_cache
from jaxkv.presets import get_preset
from jaxkv.serving.state_aware_events import StateAwareEvents

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
    assert t is not None and t.state_groups and t.attention_groups
    with pytest.raises(ValueError, match="attention and state groups"):
        StateAwareEvents([ATTN], [])


def expected(parents: dict[int, int | None], attn: dict[int, int], state: dict[int, int]) -> set[bytes]:
    """The definition, by brute force: the chain to the block cached, and a checkpoint on
    or after it reachable through cached blocks."""

    def chain_ok(i: int) -> bool:
        while True:
            if not attn.get(i):
                return False
            p = parents[i]
            if p is None:
                return True
            i = p

    children: dict[int, list[int]] = {}
    for c, p in parents.items():
        if p is not None:
            children.setdefault(p, []).append(c)

    def reaches_checkpoint(i: int) -> bool:
        if not attn.get(i):
            return False
        return bool(state.get(i)) or any(reaches_checkpoint(c) for c in children.get(i, ()))

    return {h(i) for i in parents if chain_ok(i) and reaches_checkpoint(i)}


@pytest.mark.parametrize("seed", range(4))
def test_random_streams_announce_exactly_the_resumable_blocks_and_replay_to_the_same_set(seed):
    """A pool's worth of random stores and evictions over branching chains: after every
    step the announced set is the brute-force definition, and folding the whole output
    stream (a late subscriber replaying from 0) gives that set, parents first."""
    rng = random.Random(seed)
    t = StateAwareEvents([ATTN], [STATE])
    parents: dict[int, int | None] = {}
    attn: dict[int, int] = {}
    state: dict[int, int] = {}
    stream: list[KVCacheEvent] = []
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
                if rng.random() < 0.7:
                    c = rng.choice(ids)
                    state[c] = state.get(c, 0) + 1
                    step.append(stored(STATE, [c], parents[c]))
            elif kind < 0.55 and attn:  # another copy of a known block, or a recomputed one
                i = rng.choice(list(parents))
                attn[i] = attn.get(i, 0) + 1
                step.append(stored(ATTN, [i], parents[i]))
            elif kind < 0.8 and any(attn.values()):
                i = rng.choice([i for i in attn if attn[i]])
                attn[i] -= 1
                step.append(removed(ATTN, i))
            elif any(state.values()):
                i = rng.choice([i for i in state if state[i]])
                state[i] -= 1
                step.append(removed(STATE, i))
        stream += t.apply(step)
        assert t.published() == expected(parents, attn, state)
    announced: set[bytes] = set()
    fold(announced, stream)
    assert announced == t.published()
    assert announced  # the stream was not empty all along
