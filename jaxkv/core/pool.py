"""The shared block pool: free queue, reference counts and the prefix-cache map.

One pool serves every KV cache group, so one block id means the same bytes in every
group. Block 0 is the null block: a padding sink that is never handed out, never freed
and never cached. Blocks whose reference count drops to zero stay cached (their hash
is kept) and wait in the free queue in eviction order; allocating pops from the head
and evicts whatever hash the popped block still carries.

A *unit* is several blocks taken, held, cached and evicted as one (a recurrent state
stored as pages of the pool, :meth:`BlockPool.get_new_unit`): its first block (the
head) stands for it everywhere (reference count, hash, free queue); the others are
attached to the head. A freed cached unit queues by its head alone, its other blocks
counted free with it; when the head leaves the queue for reuse, the unit dissolves and
all its blocks are handed out. A freed uncached unit dissolves at once.

Hot-path layout: reference counts and per-block hashes live in plain lists indexed by
block id, the free queue is a ``FreeBlockQueue`` (bulk insertion at either end, O(1)
removal of a cached block that is hit again), and each group has its own ``dict``
hash -> block id.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from jaxkv.core.evicted_hashes import EvictedHashes
from jaxkv.core.free_queue import FreeBlockQueue
from jaxkv.errors import JaxkvError

_log = logging.getLogger(__name__)

NULL_BLOCK = 0


class BlockPoolError(JaxkvError, ValueError):
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

Registered with :meth:`BlockPool.add_reuse_listener`: the last moment its KV (still
intact) can be copied elsewhere, e.g. to a host tier that stores on eviction. Explicit
evictions (:meth:`BlockPool.evict_blocks`, :meth:`BlockPool.reset_prefix_cache`,
:meth:`BlockPool.rollback_journal`) do not call it: they drop hashes whose data must
not be kept.
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
            raise BlockPoolError(f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}")
        if not isinstance(num_groups, int) or num_groups < 1:
            raise BlockPoolError(f"num_groups must be an int >= 1, got {num_groups!r}")
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.enable_events = enable_events
        self.ref_cnt: list[int] = [0] * num_blocks
        # block id -> its hash while cached, and the group it is cached for.
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_group: list[int] = [-1] * num_blocks
        # group -> {hash: the earliest cached block still holding it}; read by the hit searches.
        self.cached: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        # group -> {hash: later copies, oldest first}: every computed copy of a block is
        # cached (as in vLLM v1), so evicting one copy leaves the prefix findable.
        self._copies: list[dict[bytes, list[int]]] = [{} for _ in range(num_groups)]
        self._free = FreeBlockQueue(range(1, num_blocks), num_blocks)
        # Unreferenced cached blocks held back from eviction until the free queue is
        # empty (group-aware retention: window blocks that complete a hit).
        self._retained = FreeBlockQueue((), num_blocks)
        self._events: list[KVCacheEvent] = []
        # Bumped on every eviction: a cache hit found while it was N is still valid
        # as long as it is still N.
        self.num_evictions = 0
        self._reuse_listeners: list[ReuseListener] = []
        self._ghost: EvictedHashes | None = None  # see track_evictions
        # Blocks cached since begin_journal(), while a journal is open (else None); and
        # those cached late (see caching_late): written, yet dropped too on a rollback.
        self._journal: set[int] | None = None
        self._late: set[int] | None = None
        # Unit head -> its other blocks; and how many such blocks sit behind queued heads.
        self._units: dict[int, list[int]] = {}
        self._unit_free = 0
        # Free blocks (queued or retained) registered in the prefix cache, a unit's other blocks included.
        self._num_cached_free = 0
        # (block, hash) of demotions deferred while the pool had room (see demote).
        self._deferred_demotions: list[tuple[int, bytes | None]] = []
        self._deferred_size = 0  # the blocks they take

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-unreferenced ones included, and
        the blocks of free units)."""
        return len(self._free) + len(self._retained) + self._unit_free

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks (the null block excluded) referenced now."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def unit_blocks(self, block_id: int) -> list[int]:
        """All blocks of the unit whose head is ``block_id`` (just ``[block_id]`` for a plain block)."""
        return [block_id, *self._units.get(block_id, ())]

    def free_block_ids(self) -> list[int]:
        """Every unreferenced block in eviction order: the free queue head (evicted
        first) to tail, then the retained blocks, oldest first."""
        return [*self._free, *self._retained]

    def is_free(self, block_id: int) -> bool:
        """Whether the block waits to be handed out (free queue or retained)."""
        return block_id in self._free or block_id in self._retained

    @property
    def num_retained(self) -> int:
        """Retained entries (a unit counts once): see :meth:`retain_blocks`."""
        return len(self._retained)

    def is_retained(self, block_id: int) -> bool:
        """Whether the block is unreferenced but held back from eviction (see :meth:`retain_blocks`)."""
        return block_id in self._retained

    def is_cached(self, block_id: int) -> bool:
        """Whether the block is registered in the prefix cache now (findable by a hit)."""
        return self.block_hash[block_id] is not None

    def has_other_copy(self, block_id: int) -> bool:
        """Whether another block is cached under this cached block's hash (its prefix
        stays findable when this one goes)."""
        h = self.block_hash[block_id]
        g = self.block_group[block_id]
        return h is not None and (self.cached[g].get(h) != block_id or bool(self._copies[g].get(h)))

    @property
    def num_empty_free_blocks(self) -> int:
        """Free blocks that hold nothing cached (never written, or evicted): taking no
        more than these evicts nothing."""
        return self.num_free_blocks - self._num_cached_free

    def _size(self, block_id: int) -> int:
        """Blocks that ``block_id`` stands for: itself, and a unit head its other blocks."""
        members = self._units.get(block_id)
        return 1 + len(members) if members else 1

    def ref_count(self, block_id: int) -> int:
        """How many holders the block has (0: it waits in the free queue or is retained)."""
        return self.ref_cnt[block_id]

    def is_journaled(self, block_id: int) -> bool:
        """Whether the block was cached inside the open journal (its data is not written yet)."""
        return self._journal is not None and block_id in self._journal

    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache, over all groups (every copy)."""
        return sum(len(m) for m in self.cached) + sum(len(c) for d in self._copies for c in d.values())

    def hash_maps(self, groups: Sequence[int]) -> list[dict[bytes, int]]:
        """The ``hash -> block id`` maps of these groups, for hit searches (read only)."""
        cached = self.cached
        return [cached[g] for g in groups]

    def written_block(self, group: int, block_hash: bytes) -> int | None:
        """The block cached for ``group`` under ``block_hash`` whose data is written (not
        cached inside the open journal), or None."""
        b = self.cached[group].get(block_hash)
        return None if b is None or (self._journal is not None and b in self._journal) else b

    def is_cached_as(self, block_id: object, group: int, block_hash: bytes) -> bool:
        """Whether ``block_id`` is a real block cached for ``group`` under ``block_hash``."""
        return (
            type(block_id) is int
            and 0 < block_id < self.num_blocks
            and self.block_hash[block_id] == block_hash
            and self.block_group[block_id] == group
        )

    # --------------------------------------------------------------- listeners
    def add_reuse_listener(self, listener: ReuseListener) -> None:
        """Call ``listener`` for each cached block about to be handed out again."""
        self._reuse_listeners.append(listener)

    def track_evictions(self, ghost: EvictedHashes) -> None:
        """Hand ``ghost`` the hashes of its group's cached blocks handed out again, a batch
        per allocation (cheaper than a reuse listener called per block)."""
        self._ghost = ghost

    def remove_reuse_listener(self, listener: ReuseListener) -> None:
        """Stop calling a listener added by :meth:`add_reuse_listener`."""
        self._reuse_listeners.remove(listener)

    # -------------------------------------------------------------- allocation
    def get_new_blocks(self, n: int) -> list[int]:
        """Pop ``n`` blocks from the head of the free queue (then the oldest retained
        ones, once it is empty), evicting their hashes."""
        if n < 0 or n > self.num_free_blocks:
            raise BlockPoolError(f"cannot take {n} blocks: {self.num_free_blocks} free of {self.num_blocks}")
        if self._units:
            return self._take_dissolving(n)
        return self._take(n)

    def _take(self, n: int) -> list[int]:
        """Pop ``n`` queued blocks (then retained ones), evicting their hashes; the caller checked there are."""
        free = self._free
        num_queued = len(free)
        if n <= num_queued:
            out = free.popleft_n(n)
        else:
            out = free.popleft_n(num_queued) + self._retained.popleft_n(n - num_queued)
        self._claim(out)
        return out

    def _claim(self, popped: list[int]) -> None:
        """Hand out blocks just popped from a queue: evict their hashes, one reference each."""
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        journal = self._journal
        evictions = self.num_evictions
        ghost = self._ghost
        gone: list[bytes] = []
        for b in popped:
            h = block_hash[b]
            if h is not None:
                if journal is None or b not in journal:  # a journaled block's KV is not written yet
                    for listener in self._reuse_listeners:
                        listener(b, h, self.block_group[b])
                    if ghost is not None and self.block_group[b] == ghost.group:
                        gone.append(h)
                self._evict(b)
            ref_cnt[b] = 1
        if self.num_evictions != evictions:  # one record per call: this is the allocation hot path
            _log.debug("evicted %d cached block(s) to hand out %d", self.num_evictions - evictions, len(popped))
            if gone and ghost is not None:
                ghost.add(gone)

    def _take_dissolving(self, n: int) -> list[int]:
        """:meth:`_take` where popped heads of free units bring their other blocks along
        (the unit dissolves); blocks beyond ``n`` go back to the queue's head. Only the
        head entries needed to cover ``n`` blocks are popped: a unit head covers many
        blocks, so popping ``n`` entries would evict every state among them."""
        units = self._units
        heads, covered = self._free.popleft_covering(n, units)
        if covered < n:
            heads += self._retained.popleft_covering(n - covered, units)[0]
        self._claim(heads)
        ref_cnt = self.ref_cnt
        out: list[int] = []
        for b in heads:
            out.append(b)
            members = units.pop(b, None)
            if members:
                self._unit_free -= len(members)
                for m in members:
                    ref_cnt[m] = 1
                out.extend(members)
        if len(out) > n:
            extra = out[n:]
            del out[n:]
            for b in extra:
                ref_cnt[b] = 0
            self._free.prepend(extra)
        return out

    def get_new_unit(self, size: int) -> int:
        """Take ``size`` blocks as one unit (see the module doc) and return its head."""
        blocks = self.get_new_blocks(size)
        if size > 1:
            self._units[blocks[0]] = blocks[1:]
        return blocks[0]

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block (a cache hit), pulling free ones out of the queue."""
        ref_cnt = self.ref_cnt
        free = self._free
        retained = self._retained
        units = self._units
        for b in block_ids:
            if b:
                r = ref_cnt[b]
                if r == 0:
                    (free if b in free else retained).remove(b)
                    if self.block_hash[b] is not None:
                        self._num_cached_free -= self._size(b)
                    if units and b in units:
                        self._unit_free -= len(units[b])
                ref_cnt[b] = r + 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in eviction-priority order.

        The ids must be distinct real blocks (no null block): callers filter it out.

        Blocks reaching zero references join the free queue: cached ones at the tail,
        in the given order (kept longest), uncached ones at the head (reused first,
        the first given ends up first).
        """
        self.free_block_lists((ordered_block_ids,))

    def free_block_lists(self, block_lists: Sequence[Iterable[int]]) -> None:
        """:meth:`free_blocks` of each list in turn (one per group, as vLLM frees a
        request group by group), in one pass: cached blocks reach the tail in list
        order, each list's uncached blocks the head, the last list's first."""
        cached: list[int] = []
        uncached_per_list = []
        for ids in block_lists:
            uncached: list[int] = []
            self._release(ids, cached, uncached)
            uncached_per_list.append(uncached)
        self._free.append(cached)
        if len(uncached_per_list) == 1:
            self._free.prepend(uncached_per_list[0])
        else:
            self._free.prepend([b for uncached in reversed(uncached_per_list) for b in uncached])

    def _release(self, block_ids: Iterable[int], cached: list[int], uncached: list[int]) -> None:
        """Drop one reference from each block; those reaching zero go to ``cached`` (counted
        free and cached, a unit with its other blocks) or ``uncached`` (a unit dissolved)."""
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        units = self._units
        num_cached = 0
        for b in block_ids:
            r = ref_cnt[b] - 1
            ref_cnt[b] = r
            if r == 0:
                if block_hash[b] is None:
                    uncached.append(b)
                    if units and b in units:
                        uncached.extend(self._dissolve(b))
                else:
                    cached.append(b)
                    num_cached += 1
                    if units and b in units:
                        self._unit_free += len(units[b])
                        num_cached += len(units[b])
        self._num_cached_free += num_cached

    def _dissolve(self, head: int) -> list[int]:
        """Detach an unreferenced unit's other blocks (now plain free blocks) and return them."""
        members = self._units.pop(head)
        for m in members:
            self.ref_cnt[m] = 0
        return members

    def retain_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; cached ones reaching zero are *retained*:
        evictable only once the free queue is empty, until :meth:`free_in_order` queues
        them. Uncached ones join the free queue's head as in :meth:`free_blocks`."""
        cached: list[int] = []
        uncached: list[int] = []
        self._release(block_ids, cached, uncached)
        self._retained.append(cached)
        self._free.prepend(uncached)

    def free_blocks_first(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; those reaching zero join the free queue's
        head, cached or not (group-aware retention: blocks unlikely to complete a hit)."""
        ref_cnt = self.ref_cnt
        freed: list[int] = []
        for b in block_ids:
            r = ref_cnt[b] - 1
            ref_cnt[b] = r
            if r == 0:
                freed.append(b)
        self._num_cached_free += sum(self._size(b) for b in freed if self.block_hash[b] is not None)
        self._free.prepend(freed)

    def free_in_order(self, entries: Iterable[tuple[int, bool]]) -> None:
        """Release ``(block_id, was_retained)`` entries in eviction-priority order.

        A held block (``False``) drops one reference, as in :meth:`free_blocks`; a block
        this caller retained (``True``) moves from the retained blocks to the free
        queue's tail at its place in the order, unless it was since taken (then it is
        someone else's and is left alone)."""
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        retained = self._retained
        cached: list[int] = []
        uncached: list[int] = []
        for b, was_retained in entries:
            if was_retained:
                if b in retained:
                    retained.remove(b)
                    cached.append(b)
                continue
            r = ref_cnt[b] - 1
            ref_cnt[b] = r
            if r == 0:
                if block_hash[b] is None:
                    uncached.append(b)
                else:
                    cached.append(b)
                    self._num_cached_free += self._size(b)
        self._free.append(cached)
        self._free.prepend(uncached)

    def demote(self, block_ids: Iterable[int]) -> None:
        """Move the unreferenced ones among these blocks to the free queue's head: still
        cached, but the first to be handed out (a state checkpoint a newer one supersedes;
        a retained one is no longer held back).
        While the pool has empty free blocks (:attr:`num_empty_free_blocks`) for them and
        for the demotions deferred before, nothing moves yet: handing them out before
        empty blocks would evict what memory still has room for. The first call that
        finds no such room moves the deferred ones (still cached as they were) too."""
        deferred = self._deferred_demotions
        retained = self._retained
        for b in block_ids:
            if b in retained:  # held back no longer: back in the queue, to be demoted as the others
                retained.remove(b)
                self._free.append([b])
            deferred.append((b, self.block_hash[b]))
            self._deferred_size += self._size(b)
        if len(deferred) > self.num_blocks:  # keep those still cached as they were, once each
            deferred[:] = list({b: h for b, h in deferred if h is not None and self.block_hash[b] == h}.items())
            self._deferred_size = sum(map(self._size, (b for b, _ in deferred)))
        if self.num_empty_free_blocks < self._deferred_size:
            # memory is full: the ones deferred while it had room go first too (oldest first)
            self._deferred_demotions, self._deferred_size = [], 0
            self._free.prepend(self._unqueue([b for b, h in deferred if h is not None and self.block_hash[b] == h]))

    def promote(self, block_ids: Iterable[int]) -> None:
        """Move the unreferenced ones among these blocks to the free queue's tail: still
        cached, and the last to be handed out (a shared state checkpoint a hit passed through)."""
        self._free.append(self._unqueue(block_ids))

    def _unqueue(self, block_ids: Iterable[int]) -> list[int]:
        """Take the queued ones among these blocks out of the free queue; return them in order
        (a block given twice, as one demoted twice before memory filled, moves once)."""
        free = self._free
        moved = [b for b in dict.fromkeys(block_ids) if b in free]
        for b in moved:
            free.remove(b)
        return moved

    def count_newly_freed(self, block_ids: Iterable[int]) -> int:
        """How many of these (distinct) blocks one ``free_blocks`` call would return to the queue."""
        ref_cnt = self.ref_cnt
        return sum(1 for b in block_ids if b and ref_cnt[b] == 1)

    def count_evictable(self, block_ids: Iterable[int]) -> int:
        """How many of these blocks wait in the free queue (a hit on them uses up a free block).
        Counted in C: the null block also has no references, so its entries are taken off."""
        ids = block_ids if type(block_ids) is list else list(block_ids)
        return list(map(self.ref_cnt.__getitem__, ids)).count(0) - ids.count(NULL_BLOCK)

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

        Null blocks and blocks already cached are skipped. A hash already cached by
        another block gets this block as one more copy (vLLM v1's rule): lookups find
        the earliest copy, and evicting it leaves the next one findable.
        """
        cached = self.cached[group]
        block_hash = self.block_hash
        block_group = self.block_group
        journal = self._journal
        stored = []
        for i in range(start, end):
            b = block_ids[i]
            if not b or block_hash[b] is not None:
                continue
            h = block_hashes[i]
            if h in cached:
                self._copies[group].setdefault(h, []).append(b)
            else:
                cached[h] = b
            block_hash[b] = h
            block_group[b] = group
            if self.ref_cnt[b] == 0:
                self._num_cached_free += self._size(b)
            if journal is not None:
                journal.add(b)
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

    def reuse_held(self, block_id: int) -> None:
        """A cached block its one holder is about to overwrite (a recurrent state written
        over the checkpoint it was read from): the reuse listeners hear of it as of any
        block handed out again, then its hash is evicted. It stays held."""
        h = self.block_hash[block_id]
        if h is None or self.ref_cnt[block_id] != 1:
            raise BlockPoolError(
                f"block {block_id} cannot be overwritten in place: cached={h is not None}, "
                f"references={self.ref_cnt[block_id]} (needs a cached block with one holder)"
            )
        if self._journal is None or block_id not in self._journal:
            for listener in self._reuse_listeners:
                listener(block_id, h, self.block_group[block_id])
        self._evict(block_id)

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
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        self._free.append(self._retained.popleft_n(len(self._retained)))
        for head in list(self._units):
            self._free.append(self._dissolve(head))
        self._unit_free = 0
        for m in self.cached:
            m.clear()
        for d in self._copies:
            d.clear()
        for journal in (self._journal, self._late):
            if journal is not None:
                journal.clear()
        self.block_hash = [None] * self.num_blocks
        self.block_group = [-1] * self.num_blocks
        self._num_cached_free = 0
        self._deferred_demotions, self._deferred_size = [], 0
        self.num_evictions += 1
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Return and clear the events since the last call."""
        events, self._events = self._events, []
        return events

    # ----------------------------------------------------------------- journal
    def begin_journal(self) -> None:
        """Record the blocks cached from now on, until :meth:`commit_journal` or
        :meth:`rollback_journal` (a step whose KV writes may still fail)."""
        self._journal = set()
        self._late = set()

    def commit_journal(self) -> None:
        """The journaled blocks hold their KV: keep them cached; close the journal."""
        self._journal = self._late = None

    def rollback_journal(self) -> int:
        """Drop the hashes of the journaled blocks still cached (their KV was never
        written), those cached late among them; close the journal and return how many were dropped."""
        journal, late = self._journal or set(), self._late or set()
        self._journal = self._late = None
        n = 0
        for b in journal | late:
            if self.block_hash[b] is not None:
                self._evict(b)
                n += 1
        return n

    @contextlib.contextmanager
    def caching_late(self) -> Iterator[None]:
        """Blocks cached inside the scope hold data a step dispatched earlier writes (their
        hash became known a step late, with the token read back): inside an open journal
        they count as written (hits, host copies, a state written over in place may use
        them), yet a rollback drops them too, since that step may still fail."""
        journal = self._journal
        if journal is None or self._late is None:
            yield
            return
        self._journal = self._late
        try:
            yield
        finally:
            self._journal = journal

    def _evict(self, b: int) -> None:
        h = self.block_hash[b]
        assert h is not None, f"block {b} is not cached"  # callers evict cached blocks only
        g = self.block_group[b]
        cached = self.cached[g]
        copies = self._copies[g].get(h)
        if cached[h] == b:
            if copies:
                cached[h] = copies.pop(0)
            else:
                del cached[h]
        else:
            assert copies is not None, f"block {b} is cached under {h!r} but is no copy"
            copies.remove(b)
        if copies is not None and not copies:
            del self._copies[g][h]
        self.block_hash[b] = None
        self.block_group[b] = -1
        if self.ref_cnt[b] == 0:
            self._num_cached_free -= self._size(b)
        self.num_evictions += 1
        if self.enable_events:
            self._events.append(BlockRemoved(group=g, block_hashes=(h,)))
