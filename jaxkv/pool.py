"""The shared block pool: free queue, reference counts and the prefix-cache map.

One pool serves every KV cache group, so one block id means the same bytes in every
group. Block 0 is the null block: a padding sink that is never handed out, never freed
and never cached. Blocks whose reference count drops to zero stay cached (their hash
is kept) and wait in the free queue in eviction order; allocating pops from the head
and evicts whatever hash the popped block still carries.

Hot-path layout: reference counts and per-block hashes live in plain lists indexed by
block id, the free queue is a ``FreeBlockQueue`` (bulk insertion at either end, O(1)
removal of a cached block that is hit again), and each group has its own ``dict``
hash -> block id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from jaxkv.free_queue import FreeBlockQueue

NULL_BLOCK = 0


class BlockPoolError(ValueError):
    """A pool operation was given ids or counts it cannot act on."""


@dataclass(frozen=True)
class BlockStored:
    """Blocks of one group became cached (their KV is complete and reusable)."""

    group: int
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    block_size: int
    token_ids: tuple[int, ...]
    lora_name: str | None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks of one group were evicted; their hashes no longer hit."""

    group: int
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared

ReuseListener = Callable[[int, bytes, int], None]
"""``(block_id, block_hash, group)`` of a cached block about to be handed out again.

Set as :attr:`BlockPool.on_reuse`: the last moment its KV (still intact) can be copied
elsewhere, e.g. to a host tier that stores on eviction. Explicit evictions
(:meth:`BlockPool.evict_blocks`, :meth:`BlockPool.reset_prefix_cache`) do not call it:
they drop hashes whose data must not be kept.
"""


class BlockPool:
    """Owns every block id: who holds it, whether it is cached, when it is evicted."""

    def __init__(
        self,
        num_blocks: int,
        num_groups: int = 1,
        *,
        enable_events: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise BlockPoolError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        if not isinstance(num_groups, int) or num_groups < 1:
            raise BlockPoolError(f"num_groups must be an int >= 1, got {num_groups!r}")
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.enable_events = enable_events
        self.ref_cnt: list[int] = [0] * num_blocks
        # block id -> its hash while cached, and the group it is cached for.
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_group: list[int] = [-1] * num_blocks
        # group -> {hash: block id}; read directly by the managers' hit searches.
        self.cached: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self._free = FreeBlockQueue(range(1, num_blocks), num_blocks)
        self._events: list[KVCacheEvent] = []
        # Bumped on every eviction: a cache hit found while it was N is still valid
        # as long as it is still N.
        self.num_evictions = 0
        self.on_reuse: ReuseListener | None = None

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks (the null block excluded) referenced now."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def free_block_ids(self) -> list[int]:
        """The free queue, head (evicted first) to tail (kept longest)."""
        return list(self._free)

    def is_free(self, block_id: int) -> bool:
        """Whether the block waits in the free queue."""
        return block_id in self._free

    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache, over all groups."""
        return sum(len(m) for m in self.cached)

    # -------------------------------------------------------------- allocation
    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue, evicting their hashes."""
        if n < 0 or n > len(self._free):
            raise BlockPoolError(
                f"cannot take {n} blocks: {len(self._free)} free of {self.num_blocks}"
            )
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        out = self._free.popleft_n(n)
        for b in out:
            if block_hash[b] is not None:
                if self.on_reuse is not None:
                    self.on_reuse(b, block_hash[b], self.block_group[b])
                self._evict(b)
            ref_cnt[b] = 1
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a cache hit), pulling free ones out of the queue."""
        ref_cnt = self.ref_cnt
        free = self._free
        for b in block_ids:
            if b:
                r = ref_cnt[b]
                if r == 0:
                    free.remove(b)
                ref_cnt[b] = r + 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in eviction-priority order.

        The ids must be distinct real blocks (no null block): callers filter it out.

        Blocks reaching zero references join the free queue: cached ones at the tail,
        in the given order (kept longest), uncached ones at the head (reused first,
        the first given ends up first).
        """
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        cached = []
        uncached = []
        for b in ordered_block_ids:
            r = ref_cnt[b] - 1
            ref_cnt[b] = r
            if r == 0:
                if block_hash[b] is None:
                    uncached.append(b)
                else:
                    cached.append(b)
        self._free.append(cached)
        self._free.prepend(uncached)

    def count_newly_freed(self, block_ids: Iterable[int]) -> int:
        """How many of these (distinct) blocks one ``free_blocks`` call would return to the queue."""
        ref_cnt = self.ref_cnt
        return sum(1 for b in block_ids if b and ref_cnt[b] == 1)

    def count_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks wait in the free queue (a hit on them uses up a free block)."""
        ref_cnt = self.ref_cnt
        return sum(1 for b in block_ids if b and ref_cnt[b] == 0)

    # ----------------------------------------------------------------- caching
    def cache_blocks(
        self,
        group: int,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
        *,
        parent_block_hash: bytes | None = None,
        block_size: int = 0,
        token_ids: Sequence[int] = (),
        lora_name: str | None = None,
    ) -> None:
        """Register blocks ``block_ids[start:end]`` of one group under their hashes.

        Null blocks are skipped. A hash already cached by another block keeps that
        block: the duplicate stays uncached, so when freed it is reused first instead
        of pushing a useful cached block out of the queue.
        """
        cached = self.cached[group]
        block_hash = self.block_hash
        block_group = self.block_group
        stored = []
        for i in range(start, end):
            b = block_ids[i]
            if not b or block_hash[b] is not None:
                continue
            h = block_hashes[i]
            if h in cached:
                continue
            cached[h] = b
            block_hash[b] = h
            block_group[b] = group
            if self.enable_events:
                stored.append(i)
        if stored:
            first, last = stored[0], stored[-1] + 1
            self._events.append(
                BlockStored(
                    group=group,
                    block_hashes=tuple(block_hashes[i] for i in stored),
                    parent_block_hash=block_hashes[first - 1] if first > 0 else parent_block_hash,
                    block_size=block_size,
                    token_ids=tuple(token_ids[first * block_size : last * block_size]),
                    lora_name=lora_name,
                )
            )

    def evict_blocks(self, block_ids: Iterable[int]) -> int:
        """Drop the cached hashes of these blocks (wherever they are); return how many were cached."""
        ids = list(block_ids)
        bad = [b for b in ids if not isinstance(b, int) or not 0 <= b < self.num_blocks]
        if bad:
            raise BlockPoolError(f"block ids out of range [0, {self.num_blocks}): {bad}")
        n = 0
        for b in ids:
            if self.block_hash[b] is not None:
                self._evict(b)
                n += 1
        return n

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is referenced."""
        if len(self._free) != self.num_blocks - 1:
            return False
        for m in self.cached:
            m.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_group = [-1] * self.num_blocks
        self.num_evictions += 1
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the events since the last call."""
        events, self._events = self._events, []
        return events

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        g = self.block_group[b]
        del self.cached[g][h]
        self.block_hash[b] = None
        self.block_group[b] = -1
        self.num_evictions += 1
        if self.enable_events:
            self._events.append(BlockRemoved(group=g, block_hashes=(h,)))
