"""Retention for hybrid models whose recurrent state lives in a state pool.

A hybrid prefix hit needs, at one position, every attention block up to it *and* a
state checkpoint exactly there. So under memory pressure some cached data can no
longer complete any hit, and it should be evicted before data that can:

- once the attention pool evicts block ``j`` of a chain, the attention blocks between
  the last checkpoint at or before block ``j`` and block ``j`` end no reachable
  checkpoint: they are demoted (queued to be evicted first), back to the checkpoint;
- the checkpoint that ends at block ``j`` lost its attention prefix: demoted too.

The attention pool's LRU evicts a chain's last blocks first, so a partly evicted chain
is cut back to a checkpoint at once instead of lingering as blocks no hit can use.
Chains are followed through each cached block's predecessor (recorded when the block
is cached, checked against the pool before use, since blocks are reused). The same
records answer whether a cached chain goes on after a prefix (:meth:`branches_after`):
only there does a request whose attention matched further than its hit checkpoint
that junction for later requests (a request extending a chain at its end does not).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxkv.core.pool import BlockPool


class CheckpointRetention:
    """Demotes cached data that cannot complete a hybrid hit once part of its chain is gone.

    ``attention_groups`` are the attention groups at the hash block size (their block
    ``j`` ends where state checkpoint ``j`` sits); ``state_groups`` the recurrent groups
    whose checkpoints live in ``state_pool``. Register :meth:`on_evict` as a reuse
    listener of ``pool``.
    """

    def __init__(
        self, pool: BlockPool, state_pool: BlockPool, attention_groups: Sequence[int], state_groups: Sequence[int]
    ) -> None:
        self.pool = pool
        self.state_pool = state_pool
        self.attention_groups = frozenset(attention_groups)
        self._state_maps = state_pool.hash_maps(state_groups)
        # Per attention block: its predecessor in the chain it was cached for, and that
        # predecessor's hash (0 / None for a chain's first block).
        self._pred_block = [0] * pool.num_blocks
        self._pred_hash: list[bytes | None] = [None] * pool.num_blocks
        # Blocks already demoted since they were cached: a walk stops there.
        self._demoted = bytearray(pool.num_blocks)
        # Per hash: the attention blocks recorded right after it (checked against the pool before use).
        self._children: dict[bytes, set[int]] = {}

    def record(self, group: int, blocks: Sequence[int], hashes: Sequence[bytes], start: int, end: int) -> None:
        """Blocks ``blocks[start:end]`` of ``group`` were just offered to the cache."""
        if group not in self.attention_groups:
            return
        pred_block, pred_hash, children, demoted = self._pred_block, self._pred_hash, self._children, self._demoted
        for i in range(max(start, 1), end):
            b = blocks[i]
            if b:
                if pred_hash[b] is not None:
                    self._unlink(b)
                h = hashes[i - 1]
                pred_block[b] = blocks[i - 1]
                pred_hash[b] = h
                kids = children.get(h)
                if kids is None:
                    children[h] = {b}
                else:
                    kids.add(b)
                demoted[b] = 0
        if start == 0 and end > 0 and blocks[0]:
            self._unlink(blocks[0])
            self._pred_block[blocks[0]] = 0
            self._pred_hash[blocks[0]] = None
            self._demoted[blocks[0]] = 0

    def _unlink(self, block: int) -> None:
        """Forget ``block`` as a child of its recorded predecessor."""
        pred_hash = self._pred_hash[block]
        if pred_hash is not None:
            children = self._children.get(pred_hash)
            if children is not None:
                children.discard(block)
                if not children:
                    del self._children[pred_hash]

    def branches_after(self, block_hash: bytes) -> bool:
        """Whether a cached attention block continues the prefix that ends at ``block_hash``
        (a later request diverging there branches off a cached chain, not extends one)."""
        children = self._children.get(block_hash)
        if not children:
            return False
        pool = self.pool
        for b in list(children):
            if pool.block_group[b] in self.attention_groups and self._pred_hash[b] == block_hash:
                return True
            children.discard(b)
        del self._children[block_hash]
        return False

    def _has_checkpoint(self, block_hash: bytes) -> bool:
        return any(block_hash in m for m in self._state_maps)

    def on_evict(self, block_id: int, block_hash: bytes, group: int) -> None:
        """Attention block ``block_id`` (cached as ``block_hash``) is being evicted."""
        if group not in self.attention_groups or self.pool.has_other_copy(block_id):
            return
        for m in self._state_maps:
            state = m.get(block_hash)
            if state is not None:
                self.state_pool.demote([state])
        pool = self.pool
        useless = []
        b = block_id
        while True:
            pred, pred_hash = self._pred_block[b], self._pred_hash[b]
            if (
                not pred
                or pred_hash is None
                or self._demoted[pred]
                or self._has_checkpoint(pred_hash)
                or not pool.is_cached_as(pred, group, pred_hash)
                or not pool.is_free(pred)
            ):
                break
            useless.append(pred)
            self._demoted[pred] = 1
            b = pred
        self._unlink(block_id)
        self._pred_block[block_id] = 0
        self._pred_hash[block_id] = None
        if useless:
            pool.demote(useless)
