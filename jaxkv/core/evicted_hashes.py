"""The hashes of recently evicted blocks of one group, to tell an evicted prefix from one never cached.

A prompt's missed tokens past its hit are either a prefix no one cached (another prompt,
another salt) or one that was cached and pushed out by memory pressure: the second is a
retention miss a user can act on (more memory, a host tier), the first is not. The pool
hands this the hashes of one group's cached blocks it hands out again, one batch per
allocation (:meth:`~jaxkv.core.pool.BlockPool.track_evictions`); it keeps the last
``capacity`` of them (as many as the pool holds: a "ghost" of the cache), the first
evicted forgotten first. Explicit evictions (a reset, a rolled-back step) do not pass
through it. Host-only: no JAX.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence


class EvictedHashes:
    """A bounded FIFO set of the hashes that ``group``'s blocks held when they were evicted."""

    def __init__(self, group: int, capacity: int) -> None:
        self.group = group
        self.capacity = capacity
        self._hashes: set[bytes] = set()
        self._order: deque[bytes] = deque()  # oldest first: a hash evicted again keeps its first place

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, block_hashes: Sequence[bytes]) -> None:
        """Blocks of ``group`` cached as ``block_hashes`` were just evicted for reuse."""
        hashes, order = self._hashes, self._order
        for h in block_hashes:
            if h not in hashes:
                hashes.add(h)
                order.append(h)
        while len(order) > self.capacity:
            hashes.discard(order.popleft())

    def run(self, hashes: Sequence[bytes], start: int, stop: int) -> int:
        """How many of ``hashes[start:stop]``, from ``start`` on, were evicted (the run stops at
        the first that was not)."""
        evicted = self._hashes
        n = start
        while n < stop and hashes[n] in evicted:
            n += 1
        return n - start
