"""CheckpointRetention: data that can no longer complete a hybrid hit is evicted first."""

from jaxkv.core.pool import BlockPool
from jaxkv.core.state_retention import CheckpointRetention

ATTENTION, STATE = 0, 1


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def chain_with_checkpoints(checkpoint_blocks: list[int]):
    """Attention blocks 1..4 cached as one chain (h1..h4) and freed, plus free blocks 5..8
    queued ahead of them; a state checkpoint at the end of each block index given, in a
    state pool they fill (no empty state left: a demoted checkpoint goes first at once)."""
    pool, states = BlockPool(9, 2), BlockPool(len(checkpoint_blocks) + 1, 2)
    retention = CheckpointRetention(pool, states, [ATTENTION], [STATE])
    pool.add_reuse_listener(retention.on_evict)
    chain = pool.get_new_blocks(4)
    hashes = [h(i) for i in range(1, 5)]
    pool.cache_blocks(ATTENTION, chain, hashes, 0, 4)
    retention.record(ATTENTION, chain, hashes, 0, 4)
    for i in checkpoint_blocks:
        (slot,) = states.get_new_blocks(1)
        states.cache_blocks(STATE, [slot], [hashes[i]], 0, 1)
        states.free_blocks([slot])
    pool.free_blocks([4, 1, 2, 3])  # after blocks 5..8: the chain's end, then its start (touched later)
    return pool, states


def test_evicting_a_chain_block_demotes_what_is_left_back_to_the_last_checkpoint():
    pool, states = chain_with_checkpoints([0, 3])  # checkpoints at 16 and 64 tokens
    assert pool.free_block_ids() == [5, 6, 7, 8, 4, 1, 2, 3]
    pool.get_new_blocks(4)
    (taken,) = pool.get_new_blocks(1)
    assert taken == 4
    assert pool.free_block_ids() == [3, 2, 1], "blocks 2..3 end no checkpoint any more; 1 ends the one at 16"
    assert states.free_block_ids()[0] == 2, "the checkpoint at 64 lost its attention prefix"


def test_a_block_with_another_cached_copy_demotes_nothing():
    pool, states = chain_with_checkpoints([3])
    (copy,) = pool.get_new_blocks(1)  # block 5
    pool.cache_blocks(ATTENTION, [copy], [h(4)], 0, 1)  # a second copy of the chain's last block
    pool.free_blocks([copy])
    order = pool.free_block_ids()
    states_order = states.free_block_ids()
    pool.get_new_blocks(3)  # 6, 7, 8
    assert pool.get_new_blocks(1) == [4]
    assert pool.free_block_ids() == order[4:] and states.free_block_ids() == states_order


def test_a_chain_branches_after_a_hash_only_while_a_cached_block_follows_it():
    pool, states = BlockPool(9, 2), BlockPool(6, 2)
    retention = CheckpointRetention(pool, states, [ATTENTION], [STATE])
    pool.add_reuse_listener(retention.on_evict)
    chain = pool.get_new_blocks(3)
    hashes = [h(1), h(2), h(3)]
    pool.cache_blocks(ATTENTION, chain, hashes, 0, 3)
    retention.record(ATTENTION, chain, hashes, 0, 3)
    assert retention.branches_after(h(1)) and retention.branches_after(h(2))
    assert not retention.branches_after(h(3)), "the chain ends there: a request going on extends it"
    pool.evict_blocks([chain[2]])
    assert not retention.branches_after(h(2)), "the block after h2 is no longer cached"
    pool.free_blocks(chain)
    pool.get_new_blocks(8)  # every block reused: block 2's eviction is heard
    assert not retention.branches_after(h(1))
