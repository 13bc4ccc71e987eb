"""One block manager per KV cache group, specialised by layer type.

A manager owns one group's block list per request: which block holds which tokens,
which blocks fell out of the attention span (replaced by the null block and freed),
how many new blocks an allocation needs, and which full blocks become cached.

Each layer type also defines its cache-hit search. A search over several groups of
the same type (same spec and block size) returns a ``CacheHit``: the hit covers
``num_blocks`` blocks, the first ``first_real`` of which are not needed to compute
later tokens and stay null; blocks ``[first_real, num_blocks)`` are cached in every
one of the groups, and ``block_ids`` holds them, one list per group.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from jaxkv.core.pool import NULL_BLOCK, BlockPool
from jaxkv.core.state_checkpoints import resend_position
from jaxkv.errors import JaxkvError
from jaxkv.ints import cdiv
from jaxkv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)

NEVER = sys.maxsize


_MIN_FLAG_CHUNK = 32
"""Blocks whose cache flags a window search reads at a time (at least a window's)."""


def _cached_flags(maps: Sequence[dict[bytes, int]], hashes: Sequence[bytes]) -> bytes:
    """One byte per hash: 1 where every map holds it, else 0."""
    flags = map(maps[0].__contains__, hashes)
    for m in maps[1:]:
        flags = map(operator.and_, flags, map(m.__contains__, hashes))
    return bytes(flags)


class UnsupportedSpecError(JaxkvError, TypeError):
    """No single-type manager implements this spec type."""


class CacheHit(NamedTuple):
    """A hit of one attention type: blocks ``[first_real, num_blocks)`` per group."""

    num_blocks: int
    first_real: int
    block_ids: list[list[int]]


class SingleTypeManager:
    """Block lists of one group; the base behaviour is full attention's."""

    skips_blocks = False
    """Whether leading blocks can fall out of the span (then they are nulled and freed)."""

    pages_per_block = 1
    """Pool blocks one of this group's blocks takes (a state on shared pages takes several)."""

    hits_are_prefixes = False
    """Whether the first ``k`` blocks of a hit are the hit at ``k`` blocks (full attention),
    so a search at a shorter length can cut the last hit instead of searching again."""

    counts_alike_within_type = True
    """Whether every group of one attention type holds the same counts for a request (blocks,
    skip frontier, cached blocks: the coordinator hands them the same hits and token counts,
    and these rules read nothing else), so one group's counts answer for all of them."""

    def __init__(self, pool: BlockPool, group_id: int, block_size: int, spec: KVCacheSpec) -> None:
        self.pool = pool
        self.group_id = group_id
        self.block_size = block_size
        self.spec = spec
        self.req_blocks: dict[str, list[int]] = {}
        # Leading blocks of each request already offered to the prefix cache.
        self.num_cached: dict[str, int] = {}
        # Blocks before this index are null: skipped, or never needed by a hit.
        self.skip_frontier: dict[str, int] = {}
        # Group-aware retention only: token positions where a later request is likely to
        # hit (see :meth:`set_anchors`), and the skipped blocks retained for them.
        self.anchors: dict[str, tuple[int, ...]] = {}
        self.retained: dict[str, list[tuple[int, int]]] = {}
        # Hit lengths are multiples of this (the lcm of the model's block sizes; the
        # coordinator sets it): a window group caches only blocks a hit can end on.
        self.hit_alignment = block_size

    # ----------------------------------------------------------- hit search
    @classmethod
    def find_longest_cache_hit(
        cls,
        maps: Sequence[dict[bytes, int]],
        hashes: Sequence[bytes],
        max_blocks: int,
        spec: KVCacheSpec,
        block_size: int,
    ) -> CacheHit:
        """Longest run of leading blocks cached in every group (left to right)."""
        n = min(max_blocks, len(hashes))
        found = []
        for m in maps:
            ids = list(map(m.get, hashes[:n]))
            if None in ids:
                n = ids.index(None)
            found.append(ids)
        return CacheHit(n, 0, [ids[:n] for ids in found])  # type: ignore[misc]  # no None before n

    # ---------------------------------------------------------- span rules
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens later tokens never attend to (their blocks can go)."""
        return 0

    def min_computed_to_skip(self, num_blocks: int) -> int:
        """Fewest computed tokens at which ``num_blocks`` leading blocks are out of span."""
        return NEVER

    def _skip_range(self, request_id: str, num_computed_tokens: int) -> tuple[int, int]:
        """Block indices ``[start, stop)`` newly out of span (empty when ``stop <= start``)."""
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return 0, 0
        skip = min(self.num_skipped_tokens(num_computed_tokens) // self.block_size, len(blocks))
        return self.skip_frontier.get(request_id, 0), skip

    def skippable_blocks(self, request_id: str, num_computed_tokens: int) -> list[int]:
        """Real blocks that fell out of the span and are still held, last first."""
        start, stop = self._skip_range(request_id, num_computed_tokens)
        if stop <= start:
            return []
        return [b for b in reversed(self.req_blocks[request_id][start:stop]) if b]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace out-of-span blocks by the null block and free them (last first);
        those a hit at one of the request's anchors needs are retained instead."""
        start, stop = self._skip_range(request_id, num_computed_tokens)
        if stop <= start:
            return
        blocks = self.req_blocks[request_id]
        anchors = self.anchors.get(request_id)
        if anchors:
            spans = [self.span_blocks(a) for a in anchors]
            kept = [(i, blocks[i]) for i in range(start, stop) if blocks[i] and any(i in s for s in spans)]
            self.retained.setdefault(request_id, []).extend(kept)
            self.pool.retain_blocks([b for _, b in kept])
            kept_ids = {b for _, b in kept}
            self.pool.free_blocks_first([b for b in blocks[start:stop] if b and b not in kept_ids])
        else:
            self.pool.free_blocks([b for b in reversed(blocks[start:stop]) if b])
        blocks[start:stop] = [NULL_BLOCK] * (stop - start)
        self.skip_frontier[request_id] = stop

    def span_blocks(self, num_tokens: int) -> range:
        """Block indices a hit of ``num_tokens`` tokens needs in this group."""
        return range(self.num_skipped_tokens(num_tokens) // self.block_size, num_tokens // self.block_size)

    def set_anchors(self, request_id: str, anchors: Sequence[int]) -> None:
        """Token positions where later requests are likely to hit this request's prefix
        (its own hit, how far full attention alone matched): the blocks a hit there
        needs are retained when they fall out of span, not queued for eviction."""
        kept = tuple(a for a in anchors if a > 0)
        if kept:
            self.anchors[request_id] = kept

    def next_skip_computed(self, request_id: str) -> int:
        """Fewest computed tokens at which skipping would free another block."""
        return self.min_computed_to_skip(self.skip_frontier.get(request_id, 0) + 1)

    # ----------------------------------------------------------- allocation
    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        """Fresh blocks needed so ``num_tokens`` tokens have slots."""
        held = len(self.req_blocks.get(request_id, ())) + num_hit_blocks
        return max(0, cdiv(num_tokens, self.block_size) - held)

    def add_hit_blocks(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Adopt the (already touched) blocks of a cache hit; they are cached already."""
        self.req_blocks[request_id] = list(block_ids)
        self.num_cached[request_id] = len(block_ids)
        leading = 0
        while leading < len(block_ids) and block_ids[leading] == NULL_BLOCK:
            leading += 1
        self.skip_frontier[request_id] = leading

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Append fresh blocks so ``num_tokens`` tokens have slots; return them."""
        blocks = self.req_blocks.setdefault(request_id, [])
        n = cdiv(num_tokens, self.block_size) - len(blocks)
        if n <= 0:
            return []
        new = self.pool.get_new_blocks(n)
        blocks.extend(new)
        return new

    def add_new_blocks(self, request_id: str, block_ids: list[int]) -> None:
        """Append fresh blocks the caller took from the pool for this group (the
        :meth:`num_new_blocks` it asked for): :meth:`allocate_new_blocks` with the take
        done once for several groups."""
        self.req_blocks.setdefault(request_id, []).extend(block_ids)

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

    def next_cache_tokens(self, request_id: str) -> int:
        """Fewest tokens at which :meth:`cache_blocks` would cache another block."""
        return (self.num_cached.get(request_id, 0) + 1) * self.block_size

    def release(self, request_id: str) -> Iterable[int]:
        """Forget the request; return the blocks it held, last first (evicted first),
        for the caller to free together with the other groups' blocks."""
        blocks = self.req_blocks.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        start = self.skip_frontier.pop(request_id, 0)
        return self._release_order(blocks, start) if blocks else ()

    def release_by_position(self, request_id: str) -> list[tuple[int, int, bool]]:
        """Forget the request; return ``(end token, block, retained)`` for every block it
        held or retained, for the caller to free all groups' blocks position by position."""
        bs = self.block_size
        self.anchors.pop(request_id, None)
        out = [((i + 1) * bs, b, True) for i, b in self.retained.pop(request_id, ())]
        blocks = self.req_blocks.pop(request_id, ())
        self.num_cached.pop(request_id, None)
        first = self.skip_frontier.pop(request_id, 0)
        out.extend(((i + 1) * bs, blocks[i], False) for i in range(first, len(blocks)) if blocks[i])
        return out

    def _release_order(self, blocks: list[int], start: int) -> Iterable[int]:
        """Held blocks from ``start`` on, last first; past the skip frontier none is null."""
        return reversed(blocks[start:])


class FullAttentionManager(SingleTypeManager):
    """Full attention and MLA: every token's KV is kept; hits are prefixes."""

    hits_are_prefixes = True


class SlidingWindowManager(SingleTypeManager):
    """Sliding-window attention: only the last ``window - 1`` tokens are kept."""

    spec: SlidingWindowSpec
    skips_blocks = True

    @classmethod
    def find_longest_cache_hit(
        cls,
        maps: Sequence[dict[bytes, int]],
        hashes: Sequence[bytes],
        max_blocks: int,
        spec: KVCacheSpec,
        block_size: int,
    ) -> CacheHit:
        """Rightmost contiguous run of cached blocks covering the window (vLLM's rule).

        Linear in the blocks scanned: chunks of "cached in every group" flags are read
        right to left (C-level dict lookups into a byte string) and searched for a run
        of ``needed`` ones; each block is read once, however many of the newest blocks
        were evicted.
        """
        assert isinstance(spec, SlidingWindowSpec)
        needed = cdiv(spec.sliding_window - 1, block_size)
        end = min(max_blocks, len(hashes))
        if needed == 0:
            return CacheHit(end, end, [[] for _ in maps])
        lo = end - needed
        if lo >= 0:  # the usual case first: the newest window is cached whole
            found = [list(map(m.get, hashes[lo:end])) for m in maps]
            if not any(None in ids for ids in found):
                return CacheHit(end, lo, found)  # type: ignore[arg-type]  # no None in found
        window = b"\x01" * needed
        chunk = max(needed, _MIN_FLAG_CHUNK)
        flags = b""  # cached-in-every-group flags of blocks [lo, end)
        lo = end
        while lo > 0:
            new_lo = max(0, lo - chunk)
            flags = _cached_flags(maps, hashes[new_lo:lo]) + flags
            at = flags.rfind(window, 0, lo - new_lo + needed - 1)  # runs starting in the new chunk
            lo = new_lo
            if at >= 0:
                first = lo + at
                ids = hashes[first : first + needed]
                return CacheHit(first + needed, first, [list(map(m.__getitem__, ids)) for m in maps])
        # No full window: only the run from block 0 (shorter than the window) serves.
        run = flags.find(b"\x00")
        run = len(flags) if run < 0 else run
        return CacheHit(run, 0, [list(map(m.__getitem__, hashes[:run])) for m in maps])

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.spec.sliding_window + 1)

    def min_computed_to_skip(self, num_blocks: int) -> int:
        return num_blocks * self.block_size + self.spec.sliding_window - 1

    def cache_blocks(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        num_tokens: int,
        token_ids: Sequence[int],
        lora_name: str | None,
    ) -> None:
        """Cache only the blocks a hit can end on (vLLM's rule when block sizes differ).

        A hit's length is a multiple of :attr:`hit_alignment`, so of each aligned
        segment only the trailing ``cdiv(window - 1, block_size)`` blocks can be the
        window of a hit (the coordinator offers blocks up to an aligned boundary only).
        The others stay uncached: freed, they join the head of the free queue instead
        of pushing useful blocks out."""
        per_segment = self.hit_alignment // self.block_size
        needed = cdiv(self.spec.sliding_window - 1, self.block_size)
        if needed >= per_segment:
            super().cache_blocks(request_id, hashes, num_tokens, token_ids, lora_name)
            return
        end = num_tokens // self.block_size
        start = self.num_cached.get(request_id, 0)
        if end <= start:
            return
        blocks = self.req_blocks[request_id]
        first_tail = per_segment - needed
        for segment in range(start // per_segment * per_segment, end, per_segment):
            lo, hi = max(start, segment + first_tail), min(end, segment + per_segment)
            if lo < hi:
                self.pool.cache_blocks(
                    self.group_id,
                    blocks,
                    hashes,
                    lo,
                    hi,
                    block_size=self.block_size,
                    token_ids=token_ids,
                    lora_name=lora_name,
                )
        self.num_cached[request_id] = end


class ChunkedLocalAttentionManager(SingleTypeManager):
    """Chunked-local attention: a token attends only within its own chunk."""

    spec: ChunkedLocalAttentionSpec
    skips_blocks = True

    @classmethod
    def find_longest_cache_hit(
        cls,
        maps: Sequence[dict[bytes, int]],
        hashes: Sequence[bytes],
        max_blocks: int,
        spec: KVCacheSpec,
        block_size: int,
    ) -> CacheHit:
        """Blocks before the current chunk are null; then cached blocks left to right."""
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        chunk = spec.attention_chunk_size
        first = (max_blocks * block_size // chunk) * chunk // block_size
        n = min(max_blocks, len(hashes))
        if first >= n:
            return CacheHit(n, n, [[] for _ in maps])
        hit = super().find_longest_cache_hit(maps, hashes[first:], n - first, spec, block_size)
        return CacheHit(first + hit.num_blocks, first, hit.block_ids)

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        chunk = self.spec.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk

    def min_computed_to_skip(self, num_blocks: int) -> int:
        chunk = self.spec.attention_chunk_size
        return cdiv(num_blocks * self.block_size, chunk) * chunk


class MambaManager(SingleTypeManager):
    """Mamba / linear-attention state: one live state block per request.

    Block ``i`` holds the state after ``(i + 1) * block_size`` tokens once that
    boundary is reached (a checkpoint that prefix caching can reuse) and the running
    state before that. Only the block holding the newest state is allocated; the
    indices a long chunk jumps over stay null, since a kernel that writes only the
    final state never materialises them.
    """

    skips_blocks = True

    @classmethod
    def find_longest_cache_hit(
        cls,
        maps: Sequence[dict[bytes, int]],
        hashes: Sequence[bytes],
        max_blocks: int,
        spec: KVCacheSpec,
        block_size: int,
    ) -> CacheHit:
        """The last block boundary whose state is cached in every group."""
        first, *rest = maps  # a miss is nearly always a miss in the first group: test the rest only on its hits
        for i in range(min(max_blocks, len(hashes)) - 1, -1, -1):
            h = hashes[i]
            if h in first and all(h in m for m in rest):
                return CacheHit(i + 1, i, [[m[h]] for m in maps])
        return CacheHit(0, 0, [[] for _ in maps])

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - 1)

    def min_computed_to_skip(self, num_blocks: int) -> int:
        return num_blocks * self.block_size + 1

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        held = len(self.req_blocks.get(request_id, ())) + num_hit_blocks
        return 1 if cdiv(num_tokens, self.block_size) > held else 0

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        blocks = self.req_blocks.setdefault(request_id, [])
        n = cdiv(num_tokens, self.block_size) - len(blocks)
        if n <= 0:
            return []
        new = [self.pool.get_new_unit(self.pages_per_block)]
        blocks.extend([NULL_BLOCK] * (n - 1))
        blocks.extend(new)
        return new

    def _release_order(self, blocks: list[int], start: int) -> Iterable[int]:
        """Mamba lists keep nulls between states: drop them."""
        return [b for b in reversed(blocks[start:]) if b]

    def cache_blocks(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        num_tokens: int,
        token_ids: Sequence[int],
        lora_name: str | None,
    ) -> None:
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


PROVEN_HITS = 2
"""Hits a state checkpoint must have served before it is retained (see
:meth:`StatePoolManager.remove_skipped_blocks`)."""
SHARED_SEEN_LIMIT = 1 << 16
"""Shared checkpoint hashes remembered to tell one cached again after an eviction (~4 MB)."""


class StatePoolManager(MambaManager):
    """Recurrent state drawn from a pool of its own (the planner's ``state_pool`` layout),
    or as units of ``pages_per_block`` blocks of the attention pool (``shared_pages``).

    Its block size is the hash block size, so a checkpoint can sit at any attention
    block boundary. A request holds one running state row, updated in place: as the
    request grows the slot moves to the newest block index. The slot becomes a
    *checkpoint* when the step ending at one of the request's checkpoint positions
    (see :meth:`set_checkpoints`) writes it; then it is cached under the chained hash of
    that position and the request takes a fresh row for its next state (copy-on-write:
    the checkpoint stays intact) while the pool has room; when it is short, the next
    state is written over the checkpoint if no one else holds it
    (:meth:`overwrite_checkpoint`), so a running request needs its live state alone.
    Shared checkpoints (where other requests are expected to hit) stay in queue order;
    of the request's own continuation checkpoints (its prompt's resend position, the
    last boundary before its last token where the same prompt sent again resumes; its
    end when that is a boundary; then each block boundary it decodes through) only the
    newest does: an older one is superseded (the next turn of a chat resumes from the
    newest) and is demoted to be evicted first once memory is full. A hit that
    resumes past a shared checkpoint passes through it: that checkpoint is requeued as
    recently used, as the hit's attention blocks are (the system prompt's state stays
    as warm as the system prompt's KV).
    """

    counts_alike_within_type = False  # whether a fresh row is needed depends on the group's own slot

    def __init__(
        self, pool: BlockPool, group_id: int, block_size: int, spec: KVCacheSpec, pages_per_block: int = 1
    ) -> None:
        super().__init__(pool, group_id, block_size, spec)
        self.pages_per_block = pages_per_block
        self.checkpoints: dict[str, tuple[frozenset[int], int]] = {}
        # The request's newest continuation checkpoint: (block, hash).
        self.continuation: dict[str, tuple[int, bytes]] = {}
        # Every cached continuation checkpoint (block -> hash), and per request the one its
        # hit resumed from: superseded once the request caches its own.
        self._continuations: dict[int, bytes] = {}
        self.resumed: dict[str, tuple[int, bytes]] = {}
        # Per request: its newest checkpoint at its prompt's resend position or end.
        self._prompt_checkpoints: dict[str, int] = {}
        # Per request that adopted a hit and has not cached since: the hit's length in blocks.
        self._hit_blocks: dict[str, int] = {}
        # Per request: the shared checkpoints it cached (block, hash), requeued when it ends.
        self._shared_cached: dict[str, list[tuple[int, bytes]]] = {}
        # Per checkpoint a hit resumed from: the hash it was cached under then, and how many hits it served.
        self._served: dict[int, tuple[bytes | None, int]] = {}
        # Per request that adopted a hit: the (index, block) of the checkpoint it resumed from, until it leaves span.
        self._resumed_from: dict[str, tuple[int, int]] = {}
        # Hashes of the shared checkpoints cached, and of those cached again after an eviction.
        self._shared_seen: set[bytes] = set()
        self._rewritten: set[bytes] = set()
        # Retained entries the pool may hold at most before no more checkpoint is retained (set by the coordinator).
        self.max_retained = 0
        # Per request whose newest continuation is not kept warm while it runs: the last one demoted.
        self._cold: dict[str, int] = {}
        # Per request: its guess positions (set_checkpoints); per block cached at one: its hash (one entry a block).
        self._guess_positions: dict[str, frozenset[int]] = {}
        self._guesses: dict[int, bytes] = {}

    def add_hit_blocks(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Adopt a hit; remember the checkpoint it resumes from if that is another request's continuation."""
        super().add_hit_blocks(request_id, block_ids)
        state = block_ids[-1] if block_ids else NULL_BLOCK
        if state:
            served = self._served.get(state)
            h = self.pool.block_hash[state]
            self._served[state] = (h, served[1] + 1 if served is not None and served[0] == h else 1)
            self._resumed_from[request_id] = (len(block_ids) - 1, state)
        h = self._continuations.get(state)
        if h is not None and self.pool.is_cached_as(state, self.group_id, h):
            self.resumed[request_id] = (state, h)
        if len(block_ids) > 1:
            self._hit_blocks[request_id] = len(block_ids)

    def _promote_passed_checkpoints(self, hashes: Sequence[bytes], num_blocks: int) -> None:
        """Requeue as recently used the shared checkpoints cached before block ``num_blocks - 1``
        of the chain ``hashes`` (those a hit ending there passed through), but not one of the
        ``guesses`` (:meth:`set_checkpoints`) that no hit ended on yet, or that lies behind a
        junction on the same chain (a shared checkpoint that is no guess, the hit's own end
        included): a request sharing that far resumes at the junction, so the guess serves
        no one, and kept as warm as the prefix it would hold a state's bytes for good."""
        (cached,) = self.pool.hash_maps((self.group_id,))
        continuations, guesses = self._continuations, self._guesses
        passed: list[tuple[int, bool]] = []
        for h in hashes[:num_blocks]:
            b = cached.get(h)
            if b is not None and continuations.get(b) != h:
                passed.append((b, guesses.get(b) == h))
        junction = max((i for i, (_, guess) in enumerate(passed) if not guess), default=-1)
        if passed and cached.get(hashes[num_blocks - 1]) == passed[-1][0]:
            passed.pop()
        served = self._served
        promote = [
            b
            for i, (b, guess) in enumerate(passed)
            if not guess or (i > junction and served.get(b, (None, 0))[0] == self.pool.block_hash[b])
        ]
        if promote:
            self.pool.promote(promote)

    def set_checkpoints(
        self,
        request_id: str,
        shared: Iterable[int],
        num_prompt_tokens: int,
        *,
        warm_continuation: bool = True,
        guesses: Iterable[int] = (),
    ) -> None:
        """The request's checkpoint positions (block multiples): ``shared`` ones (``guesses``
        among them: placed before any branch was seen, kept warm by hits passing through only
        as :meth:`_promote_passed_checkpoints` says), and its
        continuation checkpoints: the prompt's last block boundary and, past the prompt,
        every block boundary it decodes through. Without ``warm_continuation`` its newest
        continuation is demoted as soon as it decodes past it (no later turn is expected to
        resume mid-run; see :meth:`cold_continuation` for the one it ends with)."""
        self.checkpoints[request_id] = (frozenset(shared), num_prompt_tokens)
        if guesses:
            self._guess_positions[request_id] = frozenset(guesses)
        if not warm_continuation:
            self._cold[request_id] = NULL_BLOCK

    def set_anchors(self, request_id: str, anchors: Sequence[int]) -> None:
        """No retention anchors: this group's prefix hits are its checkpoints."""

    def _checkpoint_kind(self, request_id: str, num_tokens: int) -> str | None:
        """The kind of checkpoint at a block boundary: shared, continuation (the prompt's
        :func:`~jaxkv.core.state_checkpoints.resend_position`, its end when that is a
        boundary, then every boundary it decodes through), or None."""
        shared, num_prompt_tokens = self.checkpoints.get(request_id, (frozenset(), NEVER))
        if num_tokens in shared:
            return "shared"
        if num_tokens >= num_prompt_tokens or num_tokens == resend_position(num_prompt_tokens, self.block_size):
            return "continuation"
        return None

    def num_new_blocks(self, request_id: str, num_tokens: int, num_hit_blocks: int) -> int:
        blocks = self.req_blocks.get(request_id)
        if cdiv(num_tokens, self.block_size) <= len(blocks or ()) + num_hit_blocks:
            return 0
        if num_hit_blocks or not blocks or not blocks[-1]:
            return 1
        return 1 if self.pool.is_cached(blocks[-1]) else 0

    def can_overwrite_checkpoint(self, request_id: str, hit_blocks: Sequence[int]) -> bool:
        """Whether the state the request reads next (the last of ``hit_blocks``, a hit not
        adopted yet, else its own newest block) is a written checkpoint no one else holds,
        so its next state can overwrite it instead of taking a fresh unit."""
        if hit_blocks:
            block, holders = hit_blocks[-1], 0
        else:
            blocks = self.req_blocks.get(request_id)
            block, holders = (blocks[-1], 1) if blocks else (NULL_BLOCK, 1)
        pool = self.pool
        return (
            block != NULL_BLOCK
            and pool.is_cached(block)
            and pool.ref_count(block) == holders
            and not pool.is_journaled(block)
        )

    def holds_prompt_checkpoint(self, request_id: str) -> bool:
        """Whether the request's newest block is its own checkpoint at its prompt's resend
        position or end: superseded by its next continuation, worth keeping only while
        memory has room (the coordinator writes over it rather than evict a cached block)."""
        blocks = self.req_blocks.get(request_id)
        return blocks is not None and bool(blocks) and self._prompt_checkpoints.get(request_id) == blocks[-1]

    def overwrite_checkpoint(self, request_id: str) -> None:
        """Give up the checkpoint the request holds as its newest block (the pool is short):
        it leaves the prefix cache and becomes the running state, updated in place."""
        block = self.req_blocks[request_id][-1]
        self.pool.reuse_held(block)
        self._continuations.pop(block, None)
        for held in (self.continuation, self.resumed):
            if held.get(request_id, (NULL_BLOCK,))[0] == block:
                del held[request_id]
        self._prompt_checkpoints.pop(request_id, None)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """Move the running slot to the newest index, or take a fresh one when it is a checkpoint."""
        blocks = self.req_blocks.setdefault(request_id, [])
        n = cdiv(num_tokens, self.block_size) - len(blocks)
        if n <= 0:
            return []
        if blocks and blocks[-1] and not self.pool.is_cached(blocks[-1]):
            slot = blocks[-1]
            blocks[-1] = NULL_BLOCK
            blocks.extend([NULL_BLOCK] * (n - 1))
            blocks.append(slot)
            return []
        return super().allocate_new_blocks(request_id, num_tokens)

    def cache_blocks(
        self,
        request_id: str,
        hashes: Sequence[bytes],
        num_tokens: int,
        token_ids: Sequence[int],
        lora_name: str | None,
    ) -> None:
        """Cache the newest state when it sits on one of the request's checkpoint positions;
        a new continuation checkpoint demotes the previous one. The first call after a hit
        requeues the shared checkpoints the hit passed through; each call that caches a
        block requeues the shared checkpoints the request cached (they stay as warm as its
        own KV while it runs, for a request that branches off its prefix meanwhile)."""
        num_hit_blocks = self._hit_blocks.pop(request_id, 0)
        if num_hit_blocks:
            self._promote_passed_checkpoints(hashes, num_hit_blocks)
        end = num_tokens // self.block_size
        if end <= self.num_cached.get(request_id, 0):
            return
        if request_id in self._shared_cached:
            self.pool.promote(self.shared_checkpoints(request_id))
        kind = self._checkpoint_kind(request_id, num_tokens) if num_tokens % self.block_size == 0 else None
        if kind is not None:
            super().cache_blocks(request_id, hashes, num_tokens, token_ids, lora_name)
            block = self.req_blocks[request_id][end - 1]
            if kind == "shared":
                self._shared_cached.setdefault(request_id, []).append((block, hashes[end - 1]))
                self._note_shared(hashes[end - 1])
                if num_tokens in self._guess_positions.get(request_id, ()):
                    self._guesses[block] = hashes[end - 1]
                else:  # cached again as a junction: no longer a guess
                    self._guesses.pop(block, None)
            if kind == "continuation" and self.pool.is_cached_as(block, self.group_id, hashes[end - 1]):
                previous = self.continuation.get(request_id)
                if previous is not None and self.pool.is_cached_as(previous[0], self.group_id, previous[1]):
                    self.pool.demote([previous[0]])
                self._demote_resumed(request_id)
                self.continuation[request_id] = (block, hashes[end - 1])
                if num_tokens <= self.checkpoints.get(request_id, (frozenset(), NEVER))[1]:
                    self._prompt_checkpoints[request_id] = block
                else:
                    self._prompt_checkpoints.pop(request_id, None)
                self._continuations[block] = hashes[end - 1]
        self.num_cached[request_id] = end

    def _demote_resumed(self, request_id: str) -> None:
        """The previous turn's continuation this request resumed from is superseded by its
        own: demote it once the request no longer holds it (a chat resumes from the newest)."""
        resumed = self.resumed.get(request_id)
        if resumed is None:
            return
        block, h = resumed
        if not self.pool.is_cached_as(block, self.group_id, h):
            del self.resumed[request_id]
        elif self.pool.is_free(block):
            self.pool.demote([block])
            del self.resumed[request_id]

    def shared_checkpoints(self, request_id: str) -> list[int]:
        """The shared checkpoints the request cached that are still cached as it cached them.

        One joins the free queue when the request moves past it, mid-prefill, while the
        attention blocks it needs join when the request ends: it is requeued as the
        request caches blocks and, by the coordinator, when the request ends, so it is not
        evicted before the prefix it completes."""
        return [b for b, h in self._shared_cached.get(request_id, ()) if self.pool.is_cached_as(b, self.group_id, h)]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the states behind the request's newest; the checkpoint it resumed from is
        *retained* instead (evicted only once the free queue is empty) when the request was
        its last holder, it served :data:`PROVEN_HITS` hits, and plain LRU order already lost
        it once (it was cached again after an eviction): a junction many prompts resume from
        outranks one request's continuation and the KV no one reused, within
        :attr:`max_retained` retained entries in the pool."""
        resumed = self._resumed_from.get(request_id)
        if resumed is not None:
            index, block = resumed
            start, stop = self._skip_range(request_id, num_computed_tokens)
            blocks = self.req_blocks[request_id]
            if start <= index < stop:
                del self._resumed_from[request_id]
                if blocks[index] == block and self._retains(block):
                    blocks[index] = NULL_BLOCK
                    self.pool.retain_blocks([block])
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        if request_id in self._cold and num_computed_tokens > self.checkpoints[request_id][1]:
            self._cool(request_id)

    def _cool(self, request_id: str) -> None:
        """Demote a cold request's newest continuation once it has let go of it (each once):
        it is superseded within a block of decoding, and kept at the queue's tail, as each
        running request's would be, it holds a state's bytes that cached prefixes need."""
        newest = self.continuation.get(request_id)
        if newest is None or self._cold[request_id] == newest[0]:
            return
        block, h = newest
        if self.pool.is_free(block) and self.pool.is_cached_as(block, self.group_id, h):
            self.pool.demote([block])
            self._cold[request_id] = block

    def cold_continuation(self, request_id: str) -> list[int]:
        """A cold request's newest continuation, if still cached and not demoted yet: the
        coordinator demotes it when the request ends (no turn is expected to resume it)."""
        newest = self.continuation.get(request_id)
        if (
            request_id not in self._cold
            or newest is None
            or self._cold[request_id] == newest[0]
            or not self.pool.is_cached_as(newest[0], self.group_id, newest[1])
        ):
            return []
        return [newest[0]]

    def _note_shared(self, block_hash: bytes) -> None:
        """A shared checkpoint was cached under ``block_hash``: a second time means plain LRU order lost it once."""
        seen = self._shared_seen
        if block_hash in seen:
            self._rewritten.add(block_hash)
        elif len(seen) >= SHARED_SEEN_LIMIT:  # bounded memory: forget them wholesale
            seen.clear()
            self._rewritten.clear()
        seen.add(block_hash)

    def _retains(self, block: int) -> bool:
        """Whether checkpoint ``block``, leaving its last holder's span, is retained (see
        :meth:`remove_skipped_blocks`): not a continuation, still cached as when it served
        :data:`PROVEN_HITS` hits, cached before under its hash, and the pool under its cap."""
        pool = self.pool
        h = pool.block_hash[block]
        served_hash, served = self._served[block]
        return (
            h is not None
            and served_hash == h
            and served >= PROVEN_HITS
            and h in self._rewritten
            and pool.ref_count(block) == 1
            and pool.num_retained < self.max_retained
            and self._continuations.get(block) != h
        )

    def release(self, request_id: str) -> Iterable[int]:
        self._cold.pop(request_id, None)
        self._guess_positions.pop(request_id, None)
        self._shared_cached.pop(request_id, None)
        self._resumed_from.pop(request_id, None)
        self.checkpoints.pop(request_id, None)
        self.continuation.pop(request_id, None)
        self.resumed.pop(request_id, None)
        self._prompt_checkpoints.pop(request_id, None)
        self._hit_blocks.pop(request_id, None)
        return super().release(request_id)


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
    raise UnsupportedSpecError(f"no block manager for spec type {type(spec).__name__}: {spec!r}")
