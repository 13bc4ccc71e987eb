"""The scheduler-facing KV cache manager.

``KVCacheManager`` is the one object a serving loop's scheduler talks to: look up a
request's cached prefix, allocate slots for the tokens it schedules (two-phase: adopt
the hit blocks, then take fresh ones, after checking that everything fits), free a
finished or preempted request, and read the block ids per KV cache group that the
device step needs. The vocabulary follows vLLM's scheduler side on purpose.

What it takes and gives back lives beside it (:mod:`jaxkv.core.request`,
:mod:`jaxkv.core.kv_cache_blocks`, :mod:`jaxkv.core.manager_errors`), as do the checks of its
calls' arguments (:mod:`jaxkv.core.request_checks`), what it keeps for each request holding
blocks (:mod:`jaxkv.core.held_request`) and the recurrent checkpoint policy
(:mod:`jaxkv.core.state_checkpoints`); the names users import come from here too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from threading import get_ident as _get_ident
from typing import cast

from jaxkv.core.coordinator import KVCacheCoordinator
from jaxkv.core.hashing import BlockHasher
from jaxkv.core.held_request import HeldRequest
from jaxkv.core.kv_cache_blocks import KVCacheBlocks
from jaxkv.core.manager_errors import (
    DuplicateRequestError,
    InvalidCacheHitError,
    KVCacheManagerError,
    MaxModelLenExceededError,
    StaleCacheHitError,
    UnknownRequestError,
)
from jaxkv.core.pool import NULL_BLOCK, BlockPool, KVCacheEvent, ReuseListener
from jaxkv.core.prompt_digests import PromptDigests
from jaxkv.core.request import ReadOnlyTokenIds, Request, append_checked_token_ids, token_id_list
from jaxkv.core.request_checks import check_counts, check_external, check_hit, check_new_request, check_request
from jaxkv.core.salted_prefixes import SaltedPrefixes
from jaxkv.core.single_type import MambaManager
from jaxkv.core.state_checkpoints import AlignedChunks, CheckpointPolicy
from jaxkv.errors import OwnerThread
from jaxkv.ints import is_int
from jaxkv.planner import KVCacheConfig

__all__ = [
    "DuplicateRequestError",
    "InvalidCacheHitError",
    "KVCacheBlocks",
    "KVCacheManager",
    "KVCacheManagerError",
    "MaxModelLenExceededError",
    "PrefixCacheStats",
    "ReadOnlyTokenIds",
    "Request",
    "StaleCacheHitError",
    "UnknownRequestError",
    "token_id_list",
]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters (tokens, not blocks).

    Each lookup's missed tokens (queried minus hit) are counted by cause, so a
    structural miss tells from a bug: ``num_missed_no_checkpoint`` full attention alone
    matched but no recurrent state was cached where the hit could end (a hybrid's
    junction not checkpointed, or its checkpoint evicted); ``num_missed_below_block``
    the tokens past the last whole block a hit may cover (a hit leaves the last token
    to compute); ``num_missed_evicted`` the tokens past full attention's hit whose blocks
    were cached under the request's hashes and evicted by memory pressure (as far as the
    run of evicted blocks goes, remembered for as many blocks as the pool holds);
    ``num_missed_salt`` a salted request's tokens, from its first block on, that full
    attention holds for the same prompt under another salt or none (asked only on a miss at
    the first block of a salted request that is not an evicted prefix: the memo of
    :mod:`jaxkv.core.salted_prefixes`); ``num_missed_not_cached`` the rest: blocks never
    cached under the request's hashes (another prompt) or evicted longer ago.
    """

    num_requests: int
    num_queried_tokens: int
    num_hit_tokens: int
    num_resets: int
    num_missed_no_checkpoint: int = 0
    num_missed_below_block: int = 0
    num_missed_not_cached: int = 0
    num_missed_evicted: int = 0
    num_missed_salt: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    """Decides which blocks hold which tokens, for every KV cache group of a model.

    Single-owner: the thread that creates it is the only one that may call it (a call
    from another thread raises :class:`~jaxkv.errors.WrongThreadError`), as vLLM's
    scheduler thread owns its manager. It talks to the coordinator only.

    ``retention`` picks how unreferenced blocks queue for eviction
    (:data:`jaxkv.core.coordinator.RETENTION_RULES`): ``vllm`` makes vLLM v1's decisions;
    ``group_aware`` keeps, under memory pressure, the sliding-window blocks that
    complete hits of a hybrid model.

    With the planner's ``state_pool`` layout, recurrent state is cached at *checkpoint
    positions* (:meth:`checkpoint_positions`): the prompt's last block boundary before
    its last token (where the same prompt sent again resumes), where the prompt ends,
    where full attention alone matched further than the whole hit and a cached chain
    branches off (so the next request sharing that prefix finds a state there), with
    ``branch_ahead`` (the default) 256 to 2,048 tokens back from the end of a prompt longer
    than 1,024 tokens that starts or branches off a chain, within a share of the states memory
    holds (at least one; two where it starts a chain), or
    instead at the ``Request.branch_points`` its caller names
    (:meth:`~jaxkv.core.state_checkpoints.CheckpointPolicy.ahead`: the second request of a
    shared prefix hits too), every ``checkpoint_interval`` tokens of the prompt if set, and every block boundary while
    it decodes; of the request's own (all but the shared ones) only the newest stays in
    queue order once memory is full, and not even that when recent prompts branch off
    cached chains and almost none extends one at its end
    (:meth:`~jaxkv.core.state_checkpoints.CheckpointPolicy.continuations_resumed`): then
    it is demoted as the request decodes past it, and the one it ends with when it ends. A
    scheduler ends prefill chunks there (:meth:`chunk_limit`): a state exists only where a
    step ends. A running request
    holds its live state and, while the pool has room, the checkpoint its next step
    reads; when the pool is short that checkpoint is
    written over (what :func:`jaxkv.planner.held_blocks` counts).
    """

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        max_model_len: int | None = None,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        enable_events: bool = False,
        retention: str = "vllm",
        checkpoint_interval: int | None = None,
        branch_ahead: bool = True,
    ) -> None:
        if not isinstance(config, KVCacheConfig):
            raise KVCacheManagerError(f"config must be a KVCacheConfig, got {config!r:.80}")
        max_model_len = max_model_len if max_model_len is not None else config.max_model_len
        if not is_int(max_model_len) or max_model_len <= 0:
            raise KVCacheManagerError(
                f"max_model_len must be a positive int (here or in the config), got {max_model_len!r}"
            )
        if not isinstance(branch_ahead, bool):
            raise KVCacheManagerError(f"branch_ahead must be a bool, got {branch_ahead!r}")
        self._checkpoints = CheckpointPolicy(
            config, checkpoint_interval, enable_caching=enable_caching, branch_ahead=branch_ahead
        )
        self._aligned_chunks = AlignedChunks(config)
        self.config = config
        self._block_sizes = tuple(g.block_size for g in config.groups)
        self.max_model_len = int(max_model_len)
        self.checkpoint_interval = checkpoint_interval
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.coordinator = KVCacheCoordinator(config, enable_events=enable_events, retention=retention)
        self.hasher = BlockHasher(self.coordinator.hash_block_size, hash_algo)
        # Returned for a miss or an allocation needing no new block: immutable, so shared.
        self._no_blocks = KVCacheBlocks(tuple(() for _ in config.groups))
        self._hasher_key = (self.hasher.block_size, self.hasher.algo)
        self._prompt_digests = PromptDigests(self.hasher.block_bytes)
        self._salted_prefixes = SaltedPrefixes(self.hasher.block_bytes)
        self._owner = OwnerThread("KVCacheManager")
        # Requests holding blocks, by id, with their event thresholds: a second live
        # request with the same id is refused.
        self._held: dict[str, HeldRequest] = {}
        self._num_requests = 0
        self._num_queried = 0
        self._num_hits = 0
        self._num_resets = 0
        self._num_missed_no_checkpoint = 0
        self._num_missed_below_block = 0
        self._num_missed_evicted = 0
        self._num_missed_salt = 0

    # --------------------------------------------------------------- queries
    @property
    def pool(self) -> BlockPool:
        """The coordinator's block pool, read only: for tests and benchmarks to inspect."""
        return self.coordinator.pool

    @property
    def state_pool(self) -> BlockPool | None:
        """The coordinator's state-row pool (None without a state pool), read only."""
        return self.coordinator.state_pool

    @property
    def num_free_blocks(self) -> int:
        return self.coordinator.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks referenced by requests now."""
        return self.coordinator.usage

    @property
    def num_free_states(self) -> int | None:
        """Free state rows of the state pool (None without the state-pool layout)."""
        return self.coordinator.num_free_states

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return self._block_sizes

    @property
    def lcm_block_size(self) -> int:
        """The granularity of a hit: every group's blocks end on its multiples."""
        return self.coordinator.lcm_block_size

    @property
    def num_requests(self) -> int:
        """Requests holding blocks now."""
        return len(self._held)

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id holds blocks."""
        return request_id in self._held

    def recurrent_group_ids(self) -> list[int]:
        """Groups holding recurrent (Mamba / linear-attention) state, not token KV."""
        return self.coordinator.group_ids_of(MambaManager)

    def state_blocks(self, block_id: int) -> list[int]:
        """The blocks of the pool one recurrent state occupies, given the block id a
        recurrent group lists for it: with ``shared_pages`` all blocks of its unit, head
        first (what the device reads the state's pages from); otherwise just ``[block_id]``."""
        return self.coordinator.pool.unit_blocks(block_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group (nulls for skipped blocks)."""
        if request_id not in self._held:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return self.coordinator.get_block_ids(request_id)

    def hashes_per_group(self, request: Request) -> list[Sequence[bytes]]:
        """The request's chained block hashes at each group's block size (hashing it first)."""
        self.hash_request(request)
        return self.coordinator.hashes_per_group(request.block_hashes)

    def needed_blocks(self, group: int, start: int, end: int) -> range:
        """Block indices of ``group`` for tokens ``[start, end)`` that later tokens still
        read once ``end`` tokens are computed (what an offload tier must load)."""
        return self.coordinator.needed_blocks(group, start, end)

    def checkpoint_positions(self, request: Request, num_computed_tokens: int) -> tuple[int, ...]:
        """Positions past ``num_computed_tokens``, in order, where the request's prefill
        caches its recurrent state (empty without a state pool or without caching):
        the prompt's resend position and last block boundary, the boundary where full attention alone
        matched (when that ran ahead of the hit, at a branch of a cached chain) and every ``checkpoint_interval``
        (:class:`~jaxkv.core.state_checkpoints.CheckpointPolicy`)."""
        return self._checkpoints.positions(
            request.num_prompt_tokens, request.prefix_reach, num_computed_tokens, request.checkpoint_ahead
        )

    def chunk_limit(
        self, request: Request, start: int, num_new_tokens: int, max_chunk_tokens: int | None = None
    ) -> int:
        """``num_new_tokens`` cut so a chunk starting at ``start`` ends at the request's
        next checkpoint position, if one falls inside it (a state exists only where a
        step ends). A recurrent model in vLLM's layout has its chunks cut as vLLM's
        scheduler cuts them in align mode (:class:`~jaxkv.core.state_checkpoints.AlignedChunks`;
        0 when no chunk within the budget ends on a block boundary: the request waits a
        step; ``max_chunk_tokens``, the scheduler's step budget, says whether one ever can,
        default the plan's ``max_num_batched_tokens``). Unchanged without recurrent groups
        or without caching."""
        if self._checkpoints.block_size:
            return self._checkpoints.chunk_limit(
                request.num_prompt_tokens, request.prefix_reach, start, num_new_tokens, request.checkpoint_ahead
            )
        if self._aligned_chunks.block_size and self.enable_caching:
            return self._aligned_chunks.chunk_limit(
                request.num_prompt_tokens,
                request.num_tokens,
                request.prefix_reach,
                start,
                num_new_tokens,
                max_chunk_tokens,
            )
        return num_new_tokens

    def prefix_cache_stats(self) -> PrefixCacheStats:
        no_checkpoint, below_block = self._num_missed_no_checkpoint, self._num_missed_below_block
        evicted, salt = self._num_missed_evicted, self._num_missed_salt
        not_cached = self._num_queried - self._num_hits - no_checkpoint - below_block - evicted - salt
        return PrefixCacheStats(
            self._num_requests,
            self._num_queried,
            self._num_hits,
            self._num_resets,
            no_checkpoint,
            below_block,
            not_cached,
            evicted,
            salt,
        )

    def take_events(self) -> list[KVCacheEvent]:
        """Cache events (stored, removed, cleared) since the last call."""
        return self.coordinator.take_events()

    def add_reuse_listener(self, listener: ReuseListener) -> None:
        """Call ``listener(block_id, block_hash, group)`` whenever a cached block (or state
        checkpoint: ``group`` says which) is about to be handed out again (its data is
        still intact then)."""
        self._owner.check()
        self.coordinator.add_reuse_listener(listener)

    def remove_reuse_listener(self, listener: ReuseListener) -> None:
        self._owner.check()
        self.coordinator.remove_reuse_listener(listener)

    # ------------------------------------------------------------ operations
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's longest cached prefix: its blocks per group and its length in tokens.

        Only full blocks hit, and at most ``num_tokens - 1`` tokens, so the last token
        is always computed (its logits are needed). A request that skips reading the prefix
        cache (``Request.skip_reading_prefix_cache``) finds none, and is not counted.
        """
        self._owner.check()
        check_request(request)
        if not self.enable_caching:
            return self._no_blocks, 0
        self.hash_request(request)
        if request.skip_reading_prefix_cache:
            request.prefix_reach, request.checkpoint_ahead, request.prefix_diverged = 0, (), None
            request.prefix_extends = None
            return self._no_blocks, 0
        blocks, n, request.prefix_reach, matched, diverged = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        if request.branch_points:
            ahead = self._checkpoints.branch_positions(request.branch_points, n)
        else:
            ahead = self._checkpoints.ahead(
                request.num_prompt_tokens, n, request.prefix_reach, matched, len(self._held)
            )
        request.checkpoint_ahead = ahead
        request.prefix_diverged = diverged if matched else None
        request.prefix_extends = self.coordinator.extends_chain(request.block_hashes, matched)
        self._num_requests += 1
        self._num_queried += request.num_tokens
        self._num_hits += n
        self._num_missed_no_checkpoint += matched - n
        lcm = self.coordinator.lcm_block_size
        limit = (request.num_tokens - 1) // lcm * lcm
        self._num_missed_below_block += request.num_tokens - limit
        evicted = self.coordinator.evicted_tokens(request.block_hashes, matched, limit)
        self._num_missed_evicted += evicted
        if request.cache_salt is not None:
            self._count_salt_miss(request, matched or evicted, limit)
        if n == 0:
            return self._no_blocks, 0
        prefix_hash = request.block_hashes[n // self.coordinator.hash_block_size - 1]
        return KVCacheBlocks(blocks, self.coordinator.num_evictions, request.request_id, prefix_hash), n

    def _count_salt_miss(self, request: Request, found: int, limit: int) -> None:
        """A salted request was looked up: remember its salt and, when its own hashes
        ``found`` nothing cached or evicted, count as missed by salt the tokens full attention
        holds for the same prompt under another salt or none (up to ``limit``)."""
        prompt, extra = request.prompt_bytes, request.extra_keys
        salted = self._salted_prefixes
        first = self.coordinator.lcm_block_size
        stop = min(limit, len(prompt) // 4 // first * first)
        if not found and stop:
            best = 0
            for other in salted.others(prompt, extra):
                hashes: list[bytes] = []
                self.hasher.extend_bytes(hashes, prompt[: first * 4], other)
                if self.coordinator.full_attention_hit(hashes, first):
                    self.hasher.extend_bytes(hashes, prompt[: stop * 4], other)
                    best = max(best, self.coordinator.full_attention_hit(hashes, stop))
            self._num_missed_salt += best
        salted.note(prompt, extra)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens (plus lookahead).

        ``new_computed_blocks`` / ``num_new_computed_tokens`` come from
        ``get_computed_blocks`` for this request, which holds no blocks yet.
        ``num_external_computed_tokens`` (whole blocks of every group, new requests
        only) follow the device hit and are filled by the caller (an offload tier):
        they get fresh blocks, except the blocks a group no longer needs after them
        (out of a sliding window), which stay null. Their hashes are registered now,
        so a caller that fails to fill them must :meth:`evict_blocks` them. Returns the
        newly allocated blocks per group, or ``None`` when the pool cannot serve the
        request (the caller preempts); a ``None`` or an error changes nothing.
        """
        if _get_ident() != self._owner.ident:
            self._owner.check()
        # Fast path, most decode steps: a held request grows within its blocks and crosses
        # no event threshold. Everything else was validated when it got those blocks.
        if (
            type(request) is Request
            and (record := self._held.get(request.request_id)) is not None
            and record.request is request
            and new_computed_blocks is None
            and type(num_new_tokens) is int
            and type(num_lookahead_tokens) is int
            and num_new_tokens > 0
            and num_lookahead_tokens >= 0
            and num_new_computed_tokens == 0
            and num_external_computed_tokens == 0
        ):
            computed = request.num_computed_tokens
            end = computed + num_new_tokens
            if end + num_lookahead_tokens <= record.capacity and end < record.next_full and computed < record.next_skip:
                return self._no_blocks
            if end <= self.max_model_len:
                new = self._grow_held(record, num_new_tokens, num_lookahead_tokens)
                return None if new is None else KVCacheBlocks(new)
        check_request(request)
        rid = request.request_id
        if (
            type(num_new_tokens) is not int
            or type(num_new_computed_tokens) is not int
            or type(num_lookahead_tokens) is not int
            or type(num_external_computed_tokens) is not int
            or min(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens) < 0
        ):
            check_counts(
                rid, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens
            )
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise KVCacheManagerError(f"request {rid!r}: nothing to allocate (num_new_tokens=0)")
        num_computed = request.num_computed_tokens
        total_computed = num_computed + num_new_computed_tokens + num_external_computed_tokens
        if total_computed + num_new_tokens > self.max_model_len:
            raise MaxModelLenExceededError(
                f"request {rid!r}: {num_computed} computed + {num_new_computed_tokens} cached "
                f"+ {num_external_computed_tokens} external + {num_new_tokens} new tokens exceeds "
                f"max_model_len={self.max_model_len}"
            )
        num_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_cacheable = min(total_computed + num_new_tokens, request.num_tokens) if self.enable_caching else -1
        coord = self.coordinator
        record = self._held.get(rid)
        held = record is not None and record.request is request
        if not held:
            check_new_request(request, record is not None)
        if self.enable_caching:
            self.hash_request(request)
        hits = check_hit(
            request,
            num_new_computed_tokens,
            new_computed_blocks,
            held=held,
            enable_caching=self.enable_caching,
            block_sizes=self._block_sizes,
            coordinator=coord,
        )
        if num_external_computed_tokens:
            check_external(
                rid,
                num_external_computed_tokens,
                held=held,
                lcm_block_size=coord.lcm_block_size,
                enable_caching=self.enable_caching,
            )
            hits = self._external_hits(hits, total_computed)
        if not coord.can_allocate(rid, num_slots, hits, num_computed):
            return None
        if held:
            self._cache_late(cast(HeldRequest, record))
        if not held:
            coord.set_anchors(rid, (total_computed, request.prefix_reach))
            if self._checkpoints.block_size:
                warm = self._checkpoints.continuations_resumed()
                self._checkpoints.observe(request.prefix_diverged, request.prefix_extends)
                shared = self._checkpoints.shared(
                    request.num_prompt_tokens, request.prefix_reach, total_computed, request.checkpoint_ahead
                )
                ahead = request.checkpoint_ahead
                guesses = () if request.branch_points else self._checkpoints.unwarmed(request.num_prompt_tokens, ahead)
                coord.set_checkpoints(rid, shared, request.num_prompt_tokens, warm_continuation=warm, guesses=guesses)
        new_blocks = coord.allocate(rid, num_slots, hits, num_computed)
        if record is None:
            record = self._held[rid] = HeldRequest(request)
        if self.enable_caching:
            coord.cache_blocks(rid, request.block_hashes, num_cacheable, request.all_token_ids, request.lora_name)
        record.read_thresholds(coord, self.max_model_len, caching=self.enable_caching)
        return KVCacheBlocks(new_blocks)

    def allocate_decode_slots(self, requests: Sequence[Request], num_lookahead_tokens: int = 0) -> int:
        """One more slot (a decode step's token, plus lookahead) for each request, in order.

        A decode batch in one call: what ``allocate_slots(request, 1, ...)`` does for each
        held request, at a fraction of the per-call cost. Returns how many requests got
        their slot: it stops at the first the pool cannot serve, which changes nothing,
        so the caller preempts (e.g. the newest running request) and calls again from it.
        """
        self._owner.check()
        if type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            raise KVCacheManagerError(f"num_lookahead_tokens must be an int >= 0, got {num_lookahead_tokens!r}")
        held_requests = self._held
        for i, request in enumerate(requests):
            if (
                type(request) is Request
                and (held := held_requests.get(request.request_id)) is not None
                and held.request is request
            ):
                computed = request.num_computed_tokens
                if computed < held.quiet_below - num_lookahead_tokens:
                    continue
                if computed < self.max_model_len:
                    if self._grow_held(held, 1, num_lookahead_tokens) is None:
                        return i
                    continue
            if self.allocate_slots(request, 1, num_lookahead_tokens=num_lookahead_tokens) is None:
                return i
        return len(requests)

    def _grow_held(
        self, held: HeldRequest, num_new_tokens: int, num_lookahead_tokens: int
    ) -> tuple[Sequence[int], ...] | None:
        """``allocate_slots(request, num_new_tokens, num_lookahead_tokens=...)`` for a
        request this manager holds whose new tokens cross a threshold, within
        ``max_model_len``: the checks it needs were done when it got its blocks. Only
        the events that happen run (skipping, new blocks, caching), and only their
        thresholds are recomputed. Returns the new blocks per group, or None, changing
        nothing, when the pool cannot serve it."""
        coord = self.coordinator
        request = held.request
        rid = request.request_id
        computed = request.num_computed_tokens
        end = computed + num_new_tokens
        grows = end + num_lookahead_tokens > held.capacity
        skips = computed >= held.next_skip
        new_blocks: tuple[Sequence[int], ...] = self._no_blocks.blocks
        num_slots = min(end + num_lookahead_tokens, self.max_model_len)
        if grows and not coord.can_allocate(rid, num_slots, None, computed):
            return None
        self._cache_late(held)
        if grows:
            new_blocks = coord.allocate(rid, num_slots, None, computed)
        elif skips:  # every group has the slots already
            coord.remove_skipped_blocks(rid, computed)
        fills = end >= held.next_full
        if fills:
            self.hash_request(request)
            coord.cache_blocks(
                rid, request.block_hashes, min(end, request.num_tokens), request.all_token_ids, request.lora_name
            )
        held.update_thresholds(coord, self.max_model_len, grew=grows, filled=fills, skipped=skips)
        return new_blocks

    def _cache_late(self, held: HeldRequest) -> None:
        """Cache the held request's computed blocks whose last tokens became known since it
        was last allocated (the overlapped loop feeds a decode the token the step before
        drew, read back a step later, so the block that decode completes gets its hash a
        step late; without caching ``next_full`` is never reached). Called once an
        allocation is known to fit and before it places the request's next state: a
        recurrent state on a block boundary is then kept as a checkpoint, as the synchronous
        loop keeps it (the next state takes a fresh row, or writes over it where the pool
        is short, so the allocation still fits: a state group's count in ``can_allocate``
        is the same either way)."""
        request = held.request
        known = min(request.num_computed_tokens, request.num_tokens)
        if known < held.next_full:
            return
        coord = self.coordinator
        self.hash_request(request)
        with coord.caching_late():
            coord.cache_blocks(
                request.request_id, request.block_hashes, known, request.all_token_ids, request.lora_name
            )
        held.update_thresholds(coord, self.max_model_len, grew=False, filled=True, skipped=False)

    def append_token_ids(self, requests: Sequence[Request], token_ids: Sequence[int]) -> None:
        """Append one generated token to each request (``token_ids[i]`` to ``requests[i]``):
        a decode step's outputs in one call. A block that fills is hashed when the manager
        next needs its hash (the allocation that caches it, a lookup), as for any request;
        a held request that now has more tokens than computed (no step in flight extends
        it, e.g. one at its length) has its computed blocks cached if a token appended here
        completed one (:meth:`_cache_late`).

        Checks everything first: a bad id or request raises a typed error naming it and
        appends nothing. ``token_ids``: a list or 1-D array of ints.
        """
        self._owner.check()
        ids = token_id_list(token_ids, "append_token_ids: token_ids")
        if len(ids) != len(requests):
            raise KVCacheManagerError(f"append_token_ids: {len(ids)} token ids for {len(requests)} requests")
        key = self._hasher_key
        caching = self.enable_caching
        for request in requests:
            if type(request) is not Request or (caching and request.block_hash_key is not key):
                check_request(request)
                if caching:
                    self.hash_request(request)  # claims it for this hasher, or refuses another's
        append_checked_token_ids(requests, ids)
        if caching:
            held_requests = self._held
            for request in requests:
                if request.num_tokens > request.num_computed_tokens:
                    held = held_requests.get(request.request_id)
                    if held is not None and held.request is request:
                        self._cache_late(held)

    def free(self, request: Request | str) -> None:
        """Release every block the request holds (finished or preempted)."""
        self._owner.check()
        rid = cast(str, request if isinstance(request, str) else getattr(request, "request_id", request))
        if self._held.pop(rid, None) is None:
            raise UnknownRequestError(f"cannot free unknown (or already freed) request {rid!r}")
        self.coordinator.free(rid)

    def evict_blocks(self, block_ids: Sequence[int]) -> int:
        """Drop the cached hashes of these (attention pool) blocks; return how many were cached."""
        self._owner.check()
        return self.coordinator.evict_blocks(block_ids)

    def evict_group_blocks(self, group: int, block_ids: Sequence[int]) -> int:
        """:meth:`evict_blocks` for one group's blocks, wherever they come from (a
        state-pool group's are state rows)."""
        self._owner.check()
        return self.coordinator.evict_blocks(block_ids, group)

    def is_cached_as(self, group: int, block_id: int, block_hash: bytes) -> bool:
        """Whether ``group``'s block (a state row for a state-pool group) is cached as ``block_hash``."""
        return self.coordinator.is_cached_as(group, block_id, block_hash)

    def written_block(self, group: int, block_hash: bytes) -> int | None:
        """``group``'s block (a state row for a state-pool group) cached as ``block_hash`` whose
        data is written (not cached in the step still open), or None: what a host tier may copy now."""
        return self.coordinator.written_block(group, block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget the whole prefix cache; refused (False) while any block is in use."""
        self._owner.check()
        ok = self.coordinator.reset_prefix_cache()
        if ok:
            self._num_resets += 1
        return ok

    @contextlib.contextmanager
    def step_transaction(self) -> Iterator[None]:
        """Scope one engine step: blocks cached inside it are trusted only once it ends.

        Blocks are cached when allocated (vLLM's rule, so a request admitted later in
        the same step shares them), before the step writes their KV. If anything
        raises inside the scope (an interrupt, a failed compile, a failing callback),
        those blocks' hashes are dropped before the exception propagates, so no later
        lookup can hit KV that was never written.
        """
        self._owner.check()
        with self.coordinator.journal():
            yield

    def hash_request(self, request: Request) -> None:
        """Hash the request's newly full blocks now.

        The manager does this lazily when it needs the hashes; an engine may call it
        earlier, off the critical path (on arrival, after appending tokens)."""
        key = request.block_hash_key
        if key is not self._hasher_key:
            if key is None:
                request.block_hash_key = self._hasher_key
            elif key != self._hasher_key:
                raise KVCacheManagerError(
                    f"request {request.request_id!r} was hashed with (block_size, algo)="
                    f"{request.block_hash_key}, this manager uses {self._hasher_key}"
                )
        request.extend_block_hashes(self.hasher, self._prompt_digests)

    def _external_hits(self, hits: tuple[Sequence[int], ...] | None, total_computed: int) -> tuple[list[int], ...]:
        """The hit blocks per group, null wherever a group's span no longer reaches at the
        end of the external tokens: such device-hit blocks are not taken at all."""
        coord = self.coordinator
        out = []
        for g in range(coord.num_groups):
            blocks = list(hits[g]) if hits else []
            skipped = coord.needed_blocks(g, 0, total_computed).start
            out.append([NULL_BLOCK] * skipped + blocks[skipped:])
        return tuple(out)
