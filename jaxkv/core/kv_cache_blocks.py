"""The block ids a manager call hands back, one list per KV cache group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class KVCacheBlocks(NamedTuple):
    """Block ids per KV cache group (one list each), as handed to the scheduler.

    A cache hit from ``get_computed_blocks`` also records whom it was found for: the
    request id, the chained hash of its last block and the pool's eviction count then.
    ``allocate_slots`` trusts it in O(1) while all three still hold, and otherwise
    checks every block against the request's own hashes. (A NamedTuple: immutable, and
    cheap to build on every allocation.)
    """

    blocks: tuple[Sequence[int], ...]
    eviction_stamp: int = -1
    request_id: str | None = None
    prefix_hash: bytes | None = None

    def get_block_ids(self) -> tuple[Sequence[int], ...]:
        return self.blocks

    def num_blocks(self) -> int:
        """Blocks in the longest group list."""
        return max((len(b) for b in self.blocks), default=0)
