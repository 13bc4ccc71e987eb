"""The free-block queue: eviction order of unreferenced blocks, built for bulk use.

Blocks are freed in batches (a request's whole block list) and taken in batches (a
prefill's new blocks), while removing one block from the middle (a cache hit on a
free cached block) must stay O(1). The queue is a deque of *chunks*, one per insert
call, each a plain list of block ids; every queued block records the id of the chunk
it sits in. Removal just clears that record, so stale entries are skipped when the
head passes them, and the chunks are compacted when stale entries pile up.

Compared with a hash-based ordered dict this touches one compact list per block
instead of a large hash table and a linked node, which is what dominates freeing a
long request on a pool of tens of thousands of blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sized
from typing import Any

NOT_QUEUED = 0


class FreeBlockQueue:
    """FIFO of block ids with O(1) removal by id, bulk insertion at either end."""

    def __init__(self, block_ids: Iterable[int], num_blocks: int) -> None:
        self._where = [NOT_QUEUED] * num_blocks  # chunk id holding each queued block
        self._chunks: deque[list[Any]] = deque()  # [chunk id, read position, block ids]
        self._next_chunk = NOT_QUEUED + 1
        self._len = 0
        self._entries = 0  # ids stored in the chunks past their read positions
        self.append(list(block_ids))

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return self._where[block_id] != NOT_QUEUED

    def __iter__(self) -> Iterator[int]:
        where = self._where
        for cid, pos, ids in self._chunks:
            for i in range(pos, len(ids)):
                if where[ids[i]] == cid:
                    yield ids[i]

    def append(self, block_ids: list[int]) -> None:
        """Queue blocks at the tail (evicted last), in the given order; the queue
        keeps the list, so the caller must not reuse it."""
        if block_ids:
            self._chunks.append(self._new_chunk(block_ids))

    def prepend(self, block_ids: list[int]) -> None:
        """Queue blocks at the head (taken first), the first given taken first; the
        queue keeps the list."""
        if block_ids:
            self._chunks.appendleft(self._new_chunk(block_ids))

    def remove(self, block_id: int) -> None:
        """Take a queued block out of the queue, wherever it is."""
        self._where[block_id] = NOT_QUEUED
        self._len -= 1
        if self._entries > 2 * self._len + 64:
            self._compact()

    def popleft_n(self, n: int) -> list[int]:
        """Take the ``n`` blocks at the head; the caller checked ``n <= len(self)``."""
        where = self._where
        chunks = self._chunks
        out: list[int] = []
        while len(out) < n:
            chunk = chunks[0]
            cid, pos, ids = chunk
            end = len(ids)
            while pos < end:
                b = ids[pos]
                pos += 1
                if where[b] == cid:
                    where[b] = NOT_QUEUED
                    out.append(b)
                    if len(out) == n:
                        break
            self._entries -= pos - chunk[1]
            if pos == end:
                chunks.popleft()
            else:
                chunk[1] = pos
        self._len -= n
        return out

    def popleft_covering(self, n: int, units: Mapping[int, Sized]) -> tuple[list[int], int]:
        """Take blocks at the head until they cover ``n`` blocks, each covering itself and,
        if it heads a unit (a key of ``units``), the unit's other blocks: the fewest head
        entries that do, or the whole queue if it covers fewer. Returns them and what they cover."""
        where = self._where
        chunks = self._chunks
        out: list[int] = []
        covered = 0
        queued = self._len
        while covered < n and len(out) < queued:
            chunk = chunks[0]
            cid, pos, ids = chunk
            end = len(ids)
            while pos < end:
                b = ids[pos]
                pos += 1
                if where[b] == cid:
                    where[b] = NOT_QUEUED
                    out.append(b)
                    members = units.get(b)
                    covered += 1 + len(members) if members else 1
                    if covered >= n:
                        break
            self._entries -= pos - chunk[1]
            if pos == end:
                chunks.popleft()
            else:
                chunk[1] = pos
        self._len -= len(out)
        return out, covered

    def _new_chunk(self, block_ids: list[int]) -> list[Any]:
        cid = self._next_chunk
        self._next_chunk += 1
        where = self._where
        for b in block_ids:
            where[b] = cid
        self._len += len(block_ids)
        self._entries += len(block_ids)
        return [cid, 0, block_ids]

    def _compact(self) -> None:
        """Rebuild the chunks from the queued blocks alone, keeping their order."""
        live = list(self)
        self._chunks.clear()
        self._len = self._entries = 0
        self.append(live)
