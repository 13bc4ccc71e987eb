"""One block manager per KV cache group, specialised by layer type.

A manager owns one group's block list per request: which block holds which tokens,
which blocks fell out of the attention span (replaced by the null block and freed),
how many new blocks an allocation needs, and which full blocks become cached.

Each layer type also defines its cache-hit search. A search over several groups of
the same type (same spec and block size) returns ``(num_blocks, first_real)``: the hit
covers ``num_blocks`` blocks, the first ``first_real`` of which are not needed to
compute later tokens and stay null; blocks ``[first_real, num_blocks)`` are cached in
every one of the groups.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxkv.pool import NULL_BLOCK, BlockPool
from jaxkv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SingleTypeManager:
    """Block lists of one group; the base behaviour is full attention's."""

    def __init__(self, pool: BlockPool, group_id: int, block_size: int, spec: KVCacheSpec) -> None:
        self.pool = pool
        self.group_id = group_id
        self.block_size = block_size
        self.spec = spec
        self.req_blocks: dict[str, list[int]] = {}
        # Leading blocks of each request already offered to the prefix cache.
        self.num_cached: dict[str, int] = {}

    # ----------------------------------------------------------- hit search
    @classmethod
    def find_longest_cache_hit(
        cls,
        maps: Sequence[dict[bytes, int]],
        hashes: Sequence[bytes],
        max_blocks: int,
        spec: KVCacheSpec,
        block_size: int,
    ) -> tuple[int, int]:
        """Longest run of leading blocks cached in every group (left to right)."""
        n = min(max_blocks, len(hashes))
        for m in maps:
            hits = list(map(m.get, hashes[:n]))
            if None in hits:
                n = hits.index(None)
        return n, 0

    # ---------------------------------------------------------- span rules
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens later tokens never attend to (their blocks can go)."""
        return 0

    def skippable_blocks(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Real blocks that fell out of the span and are still held."""
        skip = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        blocks = self.req_blocks.get(request_id)
        if not skip or not blocks:
            return []
        out = []
        for i in range(min(skip, len(blocks)) - 1, -1, -1):
            b = blocks[i]
            if b == NULL_BLOCK:
                break
            out.append(b)
        return out

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace out-of-span blocks by the null block and free them (last first)."""
        freed = self.skippable_blocks(request_id, num_computed_tokens)
        if freed:
            blocks = self.req_blocks[request_id]
            skip = min(self.num_skipped_tokens(num_computed_tokens) // self.block_size, len(blocks))
            for i in range(skip - len(freed), skip):
                blocks[i] = NULL_BLOCK
            self.pool.free_blocks(freed)

    # ----------------------------------------------------------- allocation
    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        """Fresh blocks needed so ``num_tokens`` tokens have slots."""
        held = len(self.req_blocks.get(request_id, ())) + num_hit_blocks
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def add_hit_blocks(self, request_id: str, block_ids: list[int]) -> None:
        """Adopt the (already touched) blocks of a cache hit; they are cached already."""
        self.req_blocks[request_id] = list(block_ids)
        self.num_cached[request_id] = len(block_ids)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Append fresh blocks so ``num_tokens`` tokens have slots; return them."""
        blocks = self.req_blocks.setdefault(request_id, [])
        n = cdiv(num_tokens, self.block_size) - len(blocks)
        if n <= 0:
            return []
        new = self.pool.get_new_blocks(n)
        blocks.extend(new)
        return new

    def cache_blocks(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        num_tokens: int,
        token_ids: Sequence[int],
        lora_name: str | None,
    ) -> None:
        """Offer the request's full blocks up to ``num_tokens`` to the prefix cache."""
        end = num_tokens // self.block_size
        start = self.num_cached.get(request_id, 0)
        if end <= start:
            return
        self.pool.cache_blocks(
            self.group_id,
            self.req_blocks[request_id],
            hashes,
            start,
            end,
            block_size=self.block_size,
            token_ids=token_ids,
            lora_name=lora_name,
        )
        self.num_cached[request_id] = end

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first (evicted first)."""
        blocks = self.req_blocks.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))


class FullAttentionManager(SingleTypeManager):
    """Full attention and MLA: every token's KV is kept; hits are prefixes."""


class SlidingWindowManager(SingleTypeManager):
    """Sliding-window attention: only the last ``window - 1`` tokens are kept."""

    @classmethod
    def find_longest_cache_hit(cls, maps, hashes, max_blocks, spec, block_size):
        """Rightmost contiguous run of cached blocks covering the window."""
        needed = cdiv(spec.sliding_window - 1, block_size)
        n = min(max_blocks, len(hashes))
        if needed == 0:
            return n, n
        run = 0
        for i in range(n - 1, -1, -1):
            h = hashes[i]
            if all(h in m for m in maps):
                run += 1
                if run >= needed:
                    return i + needed, i
            else:
                run = 0
        return run, 0

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.spec.sliding_window + 1)


class ChunkedLocalAttentionManager(SingleTypeManager):
    """Chunked-local attention: a token attends only within its own chunk."""

    @classmethod
    def find_longest_cache_hit(cls, maps, hashes, max_blocks, spec, block_size):
        """Blocks before the current chunk are null; then cached blocks left to right."""
        chunk = spec.attention_chunk_size
        first = (max_blocks * block_size // chunk) * chunk // block_size
        n = min(max_blocks, len(hashes))
        if first >= n:
            return n, n
        end = first
        while end < n and all(hashes[end] in m for m in maps):
            end += 1
        return end, first

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        chunk = self.spec.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk


class MambaManager(SingleTypeManager):
    """Mamba / linear-attention state: one live state block per request.

    Block ``i`` holds the state after ``(i + 1) * block_size`` tokens once that
    boundary is reached (a checkpoint that prefix caching can reuse) and the running
    state before that. Only the block holding the newest state is allocated; the
    indices a long chunk jumps over stay null, since a kernel that writes only the
    final state never materialises them.
    """

    @classmethod
    def find_longest_cache_hit(cls, maps, hashes, max_blocks, spec, block_size):
        """The last block boundary whose state is cached in every group."""
        for i in range(min(max_blocks, len(hashes)) - 1, -1, -1):
            h = hashes[i]
            if all(h in m for m in maps):
                return i + 1, i
        return 0, 0

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        held = len(self.req_blocks.get(request_id, ())) + num_hit_blocks
        return 1 if cdiv(num_tokens, self.block_size) > held else 0

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        blocks = self.req_blocks.setdefault(request_id, [])
        n = cdiv(num_tokens, self.block_size) - len(blocks)
        if n <= 0:
            return []
        new = self.pool.get_new_blocks(1)
        blocks.extend([NULL_BLOCK] * (n - 1))
        blocks.extend(new)
        return new

    def cache_blocks(self, request_id, hashes, num_tokens, token_ids, lora_name):
        """Cache only the newest state, and only when it sits on a block boundary."""
        end = num_tokens // self.block_size
        start = self.num_cached.get(request_id, 0)
        if end <= start:
            return
        blocks = self.req_blocks[request_id]
        if num_tokens % self.block_size == 0 and len(blocks) == end:
            self.pool.cache_blocks(
                self.group_id,
                blocks,
                hashes,
                end - 1,
                end,
                block_size=self.block_size,
                token_ids=token_ids,
                lora_name=lora_name,
            )
        self.num_cached[request_id] = end


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeManager]:
    """The manager that implements a spec's cache rules."""
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager
    if isinstance(spec, MambaSpec):
        return MambaManager
    if isinstance(spec, (FullAttentionSpec, MLASpec)):
        return FullAttentionManager
    raise TypeError(f"no block manager for spec type {type(spec).__name__}: {spec!r}")
