"""The hashes of recently evicted blocks of one group, to tell an evicted prefix from one never cached.

A prompt's missed tokens past its hit are either a prefix no one cached (another prompt,
another salt) or one that was cached and pushed out by memory pressure: the second is a
retention miss a user can act on (more memory, a host tier), the first is not. The pool
tells its reuse listeners of every cached block it hands out again; this keeps the hashes
of the last ``capacity`` such blocks of one group (as many as the pool holds: a "ghost"
of the cache), oldest forgotten first. Explicit evictions (a reset, a rolled-back step)
do not pass through it. Host-only: no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence


class EvictedHashes:
    """A bounded FIFO set of the hashes that ``group``'s blocks held when they were evicted."""

    def __init__(self, group: int, capacity: int) -> None:
        self.group = group
        self.capacity = capacity
        self._hashes: dict[bytes, None] = {}

    def __len__(self) -> int:
        return len(self._hashes)

    def on_evict(self, block_id: int, block_hash: bytes, group: int) -> None:
        """A pool reuse listener: ``block_id``, cached as ``block_hash`` for ``group``, is being evicted."""
        if group != self.group:
            return
        hashes = self._hashes
        hashes.pop(block_hash, None)
        hashes[block_hash] = None
        if len(hashes) > self.capacity:
            del hashes[next(iter(hashes))]

    def run(self, hashes: Sequence[bytes], start: int, stop: int) -> int:
        """How many of ``hashes[start:stop]``, from ``start`` on, were evicted (the run stops at
        the first that was not)."""
        evicted = self._hashes
        n = start
        while n < stop and hashes[n] in evicted:
            n += 1
        return n - start
