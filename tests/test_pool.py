"""BlockPool: the null block, the free queue's order, ref counts, the hash map, events."""

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.core.pool import AllBlocksCleared, BlockPool, BlockPoolError, BlockRemoved, BlockStored


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_block_zero_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    assert pool.get_new_blocks(4) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0


def test_taking_more_blocks_than_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(BlockPoolError, match="cannot take 4 blocks: 3 free"):
        pool.get_new_blocks(4)
    assert pool.free_block_ids() == [1, 2, 3]


def test_freed_cached_blocks_join_the_tail_uncached_ones_the_head():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(4)  # [1, 2, 3, 4]; the queue is [5, 6, 7]
    pool.cache_blocks(0, blocks, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]


def test_uncached_blocks_freed_together_keep_their_order_at_the_head():
    pool = BlockPool(6)
    pool.get_new_blocks(3)
    pool.free_blocks([3, 1, 2])
    assert pool.free_block_ids() == [3, 1, 2, 4, 5]


def test_touching_a_free_cached_block_takes_it_out_of_the_queue():
    pool = BlockPool(5)
    [b] = pool.get_new_blocks(1)
    pool.cache_blocks(0, [b], [h(9)], 0, 1)
    pool.free_blocks([b])
    assert pool.is_free(b)
    pool.touch([b])
    assert not pool.is_free(b) and pool.ref_cnt[b] == 1
    pool.touch([b, 0])
    assert pool.ref_cnt[b] == 2 and pool.ref_cnt[0] == 0


def test_allocation_evicts_the_hash_of_a_reused_block(caplog):
    caplog.set_level(logging.DEBUG, logger="jaxkv")
    pool = BlockPool(3, enable_events=True)
    [b, c] = pool.get_new_blocks(2)
    pool.cache_blocks(0, [b], [h(1)], 0, 1, block_size=2, token_ids=[7, 8])
    pool.free_blocks([b])
    assert pool.cached[0] == {h(1): b}
    pool.free_blocks([c])  # uncached: head
    assert pool.get_new_blocks(2) == [c, b]
    assert pool.cached[0] == {} and pool.block_hash[b] is None
    assert [r.getMessage() for r in caplog.records] == ["evicted 1 cached block(s) to hand out 2"]
    events = pool.take_events()
    assert events == [
        BlockStored(
            group=0, block_hashes=(h(1),), parent_block_hash=None, block_size=2, token_ids=(7, 8), lora_name=None
        ),
        BlockRemoved(group=0, block_hashes=(h(1),)),
    ]
    assert pool.take_events() == []


def test_every_computed_copy_is_cached_and_evicting_one_leaves_the_other_findable():
    pool = BlockPool(6)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_blocks(0, a, [h(5)], 0, 1)
    pool.cache_blocks(0, b, [h(5)], 0, 1)
    assert pool.cached[0] == {h(5): a[0]} and pool.block_hash[b[0]] == h(5)
    assert pool.num_cached_blocks() == 2
    pool.free_blocks(a)
    pool.free_blocks(b)
    assert pool.free_block_ids()[-2:] == [a[0], b[0]]  # both cached: both at the tail
    pool.evict_blocks(a)
    assert pool.cached[0] == {h(5): b[0]}
    pool.evict_blocks(b)
    assert pool.cached[0] == {} and pool.num_cached_blocks() == 0


def test_evicting_a_later_copy_keeps_the_first_findable():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    for block in (a, b, c):
        pool.cache_blocks(0, [block], [h(5)], 0, 1)
    pool.evict_blocks([b])
    assert pool.cached[0] == {h(5): a}
    pool.evict_blocks([a])
    assert pool.cached[0] == {h(5): c}


def test_a_rolled_back_journal_uncaches_only_the_blocks_cached_inside_it():
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks(0, [a], [h(1)], 0, 1)
    pool.begin_journal()
    pool.cache_blocks(0, [b], [h(2)], 0, 1)
    assert pool.cached[0] == {h(1): a, h(2): b}
    assert pool.rollback_journal() == 1
    assert pool.cached[0] == {h(1): a} and pool.block_hash[b] is None
    pool.begin_journal()
    pool.cache_blocks(0, [b], [h(2)], 0, 1)
    pool.commit_journal()
    assert pool.rollback_journal() == 0 and pool.cached[0] == {h(1): a, h(2): b}


def test_a_block_cached_late_counts_as_written_yet_a_rollback_drops_it():
    """Cached inside caching_late (its data written by a step dispatched before the open one):
    not journaled (a hit, a host copy, an overwrite in place may use it), dropped on rollback."""
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(3)
    with pool.caching_late():  # no journal open: a plain cache
        pool.cache_blocks(0, [a], [h(1)], 0, 1)
    for close, cached in ((pool.rollback_journal, {h(1): a}), (pool.commit_journal, {h(1): a, h(2): b, h(3): c})):
        pool.begin_journal()
        with pool.caching_late():
            pool.cache_blocks(0, [b], [h(2)], 0, 1)
        pool.cache_blocks(0, [c], [h(3)], 0, 1)
        assert not pool.is_journaled(b) and pool.written_block(0, h(2)) == b
        assert pool.is_journaled(c) and pool.written_block(0, h(3)) is None
        close()
        assert pool.cached[0] == cached


def test_the_same_hash_in_two_groups_maps_to_two_blocks():
    pool = BlockPool(4, num_groups=2)
    x, y = pool.get_new_blocks(2)
    pool.cache_blocks(0, [x], [h(1)], 0, 1)
    pool.cache_blocks(1, [y], [h(1)], 0, 1)
    assert pool.cached == [{h(1): x}, {h(1): y}]


def test_null_blocks_are_never_cached_or_freed():
    pool = BlockPool(4)
    [b] = pool.get_new_blocks(1)
    pool.cache_blocks(0, [0, b], [h(1), h(2)], 0, 2)
    assert pool.cached[0] == {h(2): b}
    pool.free_blocks([b, 0])
    assert 0 not in pool.free_block_ids()


def test_evict_blocks_drops_hashes_and_rejects_bad_ids_untouched():
    pool = BlockPool(4)
    [b] = pool.get_new_blocks(1)
    pool.cache_blocks(0, [b], [h(1)], 0, 1)
    with pytest.raises(BlockPoolError, match=r"\[4\]"):
        pool.evict_blocks([b, 4])
    assert pool.cached[0] == {h(1): b}
    assert pool.evict_blocks([b, 2]) == 1
    assert pool.cached[0] == {}


def test_reset_is_refused_while_blocks_are_in_use():
    pool = BlockPool(4, enable_events=True)
    [b] = pool.get_new_blocks(1)
    pool.cache_blocks(0, [b], [h(1)], 0, 1)
    assert not pool.reset_prefix_cache()
    assert pool.cached[0] == {h(1): b}
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.cached[0] == {} and pool.num_cached_blocks() == 0
    assert isinstance(pool.take_events()[-1], AllBlocksCleared)


def test_reuse_listener_sees_cached_blocks_handed_out_again_but_not_explicit_evictions():
    pool = BlockPool(6, num_groups=2)
    seen = []

    def listener(block: int, block_hash: bytes, group: int) -> None:
        assert pool.cached[group][block_hash] == block  # still cached, data intact
        seen.append((block, block_hash, group))

    pool.add_reuse_listener(listener)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_blocks(0, [a], [h(1)], 0, 1)
    pool.cache_blocks(1, [b], [h(2)], 0, 1)
    pool.cache_blocks(0, [c], [h(3)], 0, 1)
    pool.free_blocks([c, b, a])
    pool.evict_blocks([c])  # dropped on purpose: not a reuse
    assert seen == []
    taken = pool.get_new_blocks(5)
    assert seen == [(b, h(2), 1), (a, h(1), 0)] and set(taken) >= {a, b}
    assert pool.num_cached_blocks() == 0


@pytest.mark.parametrize("num_blocks", [1, 0, -3, 2.5])
def test_bad_pool_sizes_are_named(num_blocks):
    with pytest.raises(BlockPoolError, match=str(num_blocks)):
        BlockPool(num_blocks)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "free", "cache", "touch"]), st.integers(0, 5)), max_size=60))
def test_random_operations_keep_every_block_free_xor_referenced(ops):
    pool = BlockPool(12)
    held: list[int] = []
    for op, k in ops:
        if op == "take" and k <= pool.num_free_blocks:
            held += pool.get_new_blocks(k)
        elif op == "free" and held:
            pool.free_blocks([held.pop(k % len(held))])
        elif op == "cache" and held:
            b = held[k % len(held)]
            pool.cache_blocks(0, [b], [h(b * 100 + k)], 0, 1)
        elif op == "touch" and pool.cached[0]:
            b = sorted(pool.cached[0].values())[k % len(pool.cached[0])]
            pool.touch([b])
            held.append(b)
        for b in range(1, 12):
            assert pool.is_free(b) == (pool.ref_cnt[b] == 0)
            assert pool.ref_cnt[b] == held.count(b)
        assert pool.num_free_blocks + len(set(held)) == 11
        for hh, b in pool.cached[0].items():
            assert pool.block_hash[b] == hh


def test_retained_blocks_are_taken_only_once_the_free_queue_is_empty():
    pool = BlockPool(7)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_blocks(0, [a, b, c, d], [b"a", b"b", b"c", b"d"], 0, 4)
    pool.retain_blocks([a, b])
    pool.free_blocks([c])
    assert pool.num_free_blocks == 5 and pool.is_retained(a) and pool.is_free(a)
    assert pool.free_block_ids() == [5, 6, c, a, b]
    assert pool.get_new_blocks(4) == [5, 6, c, a]
    assert pool.cached[0] == {b"b": b, b"d": d}


def test_free_in_order_queues_retained_and_held_blocks_position_by_position():
    pool = BlockPool(7)
    a, b, c, d, e, f = pool.get_new_blocks(6)
    pool.cache_blocks(0, [a, b, c, d], [b"a", b"b", b"c", b"d"], 0, 4)
    pool.retain_blocks([a, b])
    pool.touch([b])  # another request hits b: no longer retained, and no longer ours to queue
    pool.free_blocks([f])
    pool.free_in_order([(d, False), (a, True), (c, False), (b, True), (e, False)])
    assert pool.ref_cnt[b] == 1 and not pool.is_free(b)
    assert pool.free_block_ids() == [e, f, d, a, c]


def test_a_hit_on_a_retained_block_takes_it_back_and_a_reset_requeues_them():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks(0, [a, b], [b"a", b"b"], 0, 2)
    pool.retain_blocks([a, b])
    pool.touch([a])
    assert not pool.is_free(a) and pool.is_retained(b) and pool.num_free_blocks == 2
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert not pool.is_retained(b) and pool.num_free_blocks == 3


def test_demoted_free_blocks_go_first_and_stay_cached():
    pool = BlockPool(4)  # three usable blocks, all cached: no empty block is left
    ids = pool.get_new_blocks(3)
    pool.cache_blocks(0, ids, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(ids)
    pool.demote([3])
    assert pool.free_block_ids()[0] == 3 and pool.is_cached(3)
    assert pool.get_new_blocks(1) == [3] and not pool.is_cached(3)


def test_a_demotion_waits_while_empty_blocks_are_left_then_goes_first():
    pool = BlockPool(6)
    ids = pool.get_new_blocks(3)
    pool.cache_blocks(0, ids, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(ids)
    pool.demote([3])  # blocks 4 and 5 are empty: taking them first evicts nothing
    assert pool.free_block_ids() == [4, 5, 1, 2, 3]
    assert pool.get_new_blocks(2) == [4, 5]
    pool.demote([2])  # no empty block is left: the deferred demotion goes first too
    assert pool.free_block_ids() == [3, 2, 1] and pool.is_cached(3) and pool.is_cached(2)


def test_a_block_demoted_twice_while_empty_blocks_are_left_moves_once():
    """Two policies may demote one state (a request's last continuation when it ends, and
    its attention prefix evicted): the queue counts it once."""
    pool = BlockPool(6)
    ids = pool.get_new_blocks(3)
    pool.cache_blocks(0, ids, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(ids)
    pool.demote([3])
    pool.demote([3])
    assert pool.get_new_blocks(2) == [4, 5]
    pool.demote([2])
    assert pool.free_block_ids() == [3, 2, 1] and pool.num_free_blocks == 3
    assert sorted(pool.get_new_blocks(3)) == [1, 2, 3] and pool.num_free_blocks == 0


def test_promoted_free_blocks_go_last_and_held_ones_stay_held():
    pool = BlockPool(6)
    ids = pool.get_new_blocks(3)
    pool.cache_blocks(0, ids, [h(1), h(2), h(3)], 0, 3)
    pool.free_blocks(ids[:2])
    pool.promote([1, 3])  # block 1 is free; block 3 is held and is left alone
    assert pool.free_block_ids() == [4, 5, 2, 1] and pool.ref_cnt[3] == 1
    head = pool.get_new_unit(2)
    pool.cache_blocks(0, [head], [h(9)], 0, 1)
    pool.free_blocks([head])
    pool.promote([2])
    assert pool.free_block_ids() == [1, head, 2] and pool.num_free_blocks == 4, "a unit keeps its blocks counted"


def test_a_freed_cached_unit_queues_by_its_head_and_leaves_whole():
    pool = BlockPool(10)
    head = pool.get_new_unit(3)
    assert pool.unit_blocks(head) == [1, 2, 3] and pool.num_free_blocks == 6
    pool.cache_blocks(0, [head], [h(7)], 0, 1)
    pool.free_blocks([head])
    assert pool.num_free_blocks == 9, "the unit's three blocks count free"
    assert pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 1], "its head alone waits in the queue"
    assert pool.get_new_blocks(6) == [4, 5, 6, 7, 8, 9] and pool.cached[0] == {h(7): 1}
    assert pool.get_new_blocks(2) == [1, 2], "taking the head evicts the state and dissolves the unit"
    assert pool.cached[0] == {} and pool.free_block_ids() == [3] and pool.num_free_blocks == 1


def test_taking_blocks_dissolves_only_the_units_it_needs():
    pool = BlockPool(8)
    first, second = pool.get_new_unit(3), pool.get_new_unit(3)
    pool.cache_blocks(0, [first, second], [h(1), h(2)], 0, 2)
    pool.free_blocks([first, second])
    pool.demote([first, second])  # both states at the head, the first in front
    assert pool.get_new_blocks(2) == [first, first + 1]
    assert pool.cached[0] == {h(2): second}, "the second state is not evicted for blocks the first covers"
    assert pool.free_block_ids()[:2] == [first + 2, second] and pool.num_free_blocks == 5


def test_a_freed_uncached_unit_dissolves_to_the_head_and_a_hit_on_a_free_unit_takes_all_its_blocks():
    pool = BlockPool(8)
    live = pool.get_new_unit(3)
    pool.free_blocks([live])
    assert pool.free_block_ids()[:3] == [1, 2, 3] and pool.num_free_blocks == 7
    checkpoint = pool.get_new_unit(3)
    pool.cache_blocks(0, [checkpoint], [h(1)], 0, 1)
    pool.free_blocks([checkpoint])
    pool.touch([checkpoint])
    assert pool.num_free_blocks == 4 and checkpoint not in pool.free_block_ids()


def test_a_reset_dissolves_free_units_and_keeps_every_block():
    pool = BlockPool(6)
    head = pool.get_new_unit(3)
    pool.cache_blocks(0, [head], [h(1)], 0, 1)
    pool.free_blocks([head])
    assert pool.reset_prefix_cache()
    assert pool.num_free_blocks == 5 and sorted(pool.free_block_ids()) == [1, 2, 3, 4, 5]
    assert pool.get_new_blocks(5) and pool.num_free_blocks == 0


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["take", "unit", "free", "cache", "touch", "evict", "demote", "promote"]),
            st.integers(0, 5),
        ),
        max_size=60,
    )
)
def test_random_operations_with_units_account_for_every_block(ops):
    pool = BlockPool(16)
    held: list[int] = []  # one entry per reference: plain blocks and unit heads
    for op, k in ops:
        if op == "take" and k <= pool.num_free_blocks:
            held += pool.get_new_blocks(k)
        elif op == "unit" and pool.num_free_blocks >= 3:
            held.append(pool.get_new_unit(3))
        elif op == "free" and held:
            pool.free_blocks([held.pop(k % len(held))])
        elif op == "cache" and held:
            b = held[k % len(held)]
            pool.cache_blocks(0, [b], [h(b * 100 + k)], 0, 1)
        elif op == "touch" and pool.cached[0]:
            b = sorted(pool.cached[0].values())[k % len(pool.cached[0])]
            pool.touch([b])
            held.append(b)
        elif op == "evict" and pool.cached[0]:
            pool.evict_blocks([sorted(pool.cached[0].values())[k % len(pool.cached[0])]])
        elif op in ("demote", "promote"):
            getattr(pool, op)([k + 1, k + 2])
        in_use = {m for b in set(held) for m in pool.unit_blocks(b)}
        assert pool.num_free_blocks + len(in_use) == 15
        free = pool.free_block_ids()
        attached = [m for b in free for m in pool.unit_blocks(b)[1:]]
        assert sorted(free + attached + sorted(in_use)) == list(range(1, 16))
        for hh, b in pool.cached[0].items():
            assert pool.block_hash[b] == hh


def test_empty_free_blocks_count_what_taking_evicts_nothing_of_with_units():
    pool = BlockPool(12)
    head = pool.get_new_unit(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_blocks(0, [head, block], [h(1), h(2)], 0, 2)
    assert pool.num_empty_free_blocks == pool.num_free_blocks == 7
    pool.free_blocks([head, block])
    assert pool.num_free_blocks == 11 and pool.num_empty_free_blocks == 7  # the unit's 3 blocks and the block
    pool.touch([head])
    assert pool.num_empty_free_blocks == 7 and pool.num_free_blocks == 8
    pool.free_blocks([head])
    pool.evict_blocks([block])
    assert pool.num_empty_free_blocks == 8
    assert pool.reset_prefix_cache() and pool.num_empty_free_blocks == 11


def test_a_retained_unit_counts_its_blocks_free_and_a_demotion_queues_it_first():
    pool = BlockPool(8)
    head = pool.get_new_unit(3)
    pool.cache_blocks(0, [head], [h(1)], 0, 1)
    pool.retain_blocks([head])
    assert pool.is_retained(head) and pool.num_retained == 1
    assert pool.num_free_blocks == 7, "the retained unit's three blocks count free"
    pool.touch([head])
    assert pool.num_free_blocks == 4 and pool.num_retained == 0
    pool.retain_blocks([head])
    rest = pool.get_new_blocks(4)
    pool.cache_blocks(0, rest, [h(2), h(3), h(4), h(5)], 0, 4)
    pool.free_blocks(rest)
    pool.demote([head])  # its prefix is gone: held back no longer, and taken first (no empty block is left)
    assert not pool.is_retained(head) and pool.free_block_ids()[0] == head
    taken = pool.get_new_blocks(3)
    assert head in taken and not pool.is_cached(head), "the head's state is evicted before any plain block"
