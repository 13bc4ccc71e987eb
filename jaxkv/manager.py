"""The scheduler-facing KV cache manager and the request it tracks.

``KVCacheManager`` is the one object a serving loop's scheduler talks to: look up a
request's cached prefix, allocate slots for the tokens it schedules (two-phase: adopt
the hit blocks, then take fresh ones, after checking that everything fits), free a
finished or preempted request, and read the block ids per KV cache group that the
device step needs. The vocabulary follows vLLM's scheduler side on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jaxkv.coordinator import KVCacheCoordinator
from jaxkv.hashing import BlockHasher, ExtraKeys, MultiModalItem
from jaxkv.planner import KVCacheConfig
from jaxkv.pool import NULL_BLOCK, BlockPool, KVCacheEvent


class KVCacheManagerError(ValueError):
    """A call named something the manager cannot act on; nothing was changed."""


class UnknownRequestError(KVCacheManagerError, KeyError):
    """The request id holds no blocks in this manager."""

    def __str__(self) -> str:
        return str(self.args[0])


class MaxModelLenExceededError(KVCacheManagerError):
    """An allocation would give a request more tokens than ``max_model_len``."""


class StaleCacheHitError(KVCacheManagerError):
    """Blocks from ``get_computed_blocks`` were evicted before ``allocate_slots``."""


class Request:
    """A request's tokens and scheduling progress, as the KV cache manager sees them.

    ``num_computed_tokens`` is advanced by the caller's scheduler, as in vLLM. Block
    hashes are filled in lazily by the manager, only for full blocks.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise KVCacheManagerError(f"request_id must be a non-empty str, got {request_id!r}")
        if len(prompt_token_ids) == 0:
            raise KVCacheManagerError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.extra_keys = ExtraKeys(cache_salt=cache_salt, lora_name=lora_name, mm_items=tuple(mm_items))
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        # (block size, algorithm) of the hasher that filled block_hashes.
        self.block_hash_key: tuple[int, str] | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def cache_salt(self) -> str | None:
        return self.extra_keys.cache_salt

    @property
    def lora_name(self) -> str | None:
        return self.extra_keys.lora_name

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Record generated tokens (one id or several)."""
        if isinstance(token_ids, int):
            self.all_token_ids.append(token_ids)
        else:
            self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )


@dataclass(frozen=True)
class KVCacheBlocks:
    """Block ids per KV cache group (one list each), as handed to the scheduler.

    ``eviction_stamp`` records the pool's eviction count when a cache hit was found,
    so ``allocate_slots`` can tell in O(1) that the hit is still intact.
    """

    blocks: tuple[Sequence[int], ...]
    eviction_stamp: int = -1

    def get_block_ids(self) -> tuple[Sequence[int], ...]:
        return self.blocks

    def num_blocks(self) -> int:
        """Blocks in the longest group list."""
        return max((len(b) for b in self.blocks), default=0)


@dataclass(frozen=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters (tokens, not blocks)."""

    num_requests: int
    num_queried_tokens: int
    num_hit_tokens: int
    num_resets: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class KVCacheManager:
    """Decides which blocks hold which tokens, for every KV cache group of a model."""

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        max_model_len: int | None = None,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        enable_events: bool = False,
    ) -> None:
        max_model_len = max_model_len if max_model_len is not None else config.max_model_len
        if not isinstance(max_model_len, int) or max_model_len <= 0:
            raise KVCacheManagerError(
                f"max_model_len must be a positive int (here or in the config), got {max_model_len!r}"
            )
        self.config = config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(config.num_blocks, len(config.groups), enable_events=enable_events)
        self.coordinator = KVCacheCoordinator(config, self.pool)
        self.hasher = BlockHasher(self.coordinator.hash_block_size, hash_algo)
        # Returned for a miss or an allocation needing no new block: immutable, so shared.
        self._no_blocks = KVCacheBlocks(tuple(() for _ in config.groups))
        self._hasher_key = (self.hasher.block_size, self.hasher.algo)
        self._num_requests = 0
        self._num_queried = 0
        self._num_hits = 0
        self._num_resets = 0

    # --------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool's blocks referenced by requests now."""
        return self.pool.usage

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(g.block_size for g in self.config.groups)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per group (nulls for skipped blocks)."""
        if not self.coordinator.has_request(request_id):
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return self.coordinator.get_block_ids(request_id)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_requests, self._num_queried, self._num_hits, self._num_resets)

    def take_events(self) -> list[KVCacheEvent]:
        """Cache events (stored, removed, cleared) since the last call."""
        return self.pool.take_events()

    # ------------------------------------------------------------ operations
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's longest cached prefix: its blocks per group and its length in tokens.

        Only full blocks hit, and at most ``num_tokens - 1`` tokens, so the last token
        is always computed (its logits are needed).
        """
        if not self.enable_caching:
            return self._no_blocks, 0
        self.hash_request(request)
        blocks, n = self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)
        self._num_requests += 1
        self._num_queried += request.num_tokens
        self._num_hits += n
        if n == 0:
            return self._no_blocks, 0
        return KVCacheBlocks(blocks, self.pool.num_evictions), n

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
        ``get_computed_blocks`` for a request that holds no blocks yet.
        ``num_external_computed_tokens`` (whole blocks of every group, new requests
        only) follow the device hit and are filled by the caller (an offload tier):
        they get fresh blocks, except the blocks a group no longer needs after them
        (out of a sliding window), which stay null. Their hashes are registered now,
        so a caller that fails to fill them must :meth:`evict_blocks` them. Returns the
        newly allocated blocks per group, or ``None`` when the pool cannot serve the
        request (the caller preempts); a ``None`` or an error changes nothing.
        """
        rid = request.request_id
        if (
            type(num_new_tokens) is not int
            or type(num_new_computed_tokens) is not int
            or type(num_lookahead_tokens) is not int
            or type(num_external_computed_tokens) is not int
            or min(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens) < 0
        ):
            self._raise_bad_counts(
                rid, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens
            )
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise KVCacheManagerError(f"request {rid!r}: nothing to allocate (num_new_tokens=0)")
        num_computed = request.num_computed_tokens
        total_computed = num_computed + num_new_computed_tokens + num_external_computed_tokens
        if total_computed + num_new_tokens > self.max_model_len:
            raise MaxModelLenExceededError(
                f"request {rid!r}: {num_computed} computed + {num_new_computed_tokens} cached "
                f"+ {num_external_computed_tokens} external + {num_new_tokens} new tokens exceeds max_model_len={self.max_model_len}"
            )
        num_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_cacheable = min(total_computed + num_new_tokens, request.num_tokens) if self.enable_caching else -1
        coord = self.coordinator
        if (
            new_computed_blocks is None
            and not num_new_computed_tokens
            and not num_external_computed_tokens
            and coord.is_noop(rid, num_slots, num_cacheable, num_computed)
        ):
            return self._no_blocks
        hits = self._check_hit(request, num_new_computed_tokens, new_computed_blocks)
        if num_external_computed_tokens:
            hits = self._external_hits(request, hits, num_external_computed_tokens, total_computed)
        needed = coord.num_blocks_to_allocate(rid, num_slots, hits, num_computed)
        if needed > self.pool.num_free_blocks:
            return None
        new_blocks = coord.allocate(rid, num_slots, hits, num_computed)
        if self.enable_caching:
            self.hash_request(request)
            coord.cache_blocks(rid, request.block_hashes, num_cacheable, request.all_token_ids, request.lora_name)
        coord.update_thresholds(rid)
        return KVCacheBlocks(new_blocks)

    def free(self, request: Request | str) -> None:
        """Release every block the request holds (finished or preempted)."""
        rid = request if isinstance(request, str) else request.request_id
        if not self.coordinator.has_request(rid):
            raise UnknownRequestError(f"cannot free unknown (or already freed) request {rid!r}")
        self.coordinator.free(rid)

    def evict_blocks(self, block_ids: Sequence[int]) -> int:
        """Drop the cached hashes of these blocks; return how many were cached."""
        return self.pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget the whole prefix cache; refused (False) while any block is in use."""
        ok = self.pool.reset_prefix_cache()
        if ok:
            self._num_resets += 1
        return ok

    def hash_request(self, request: Request) -> None:
        """Hash the request's newly full blocks now.

        The manager does this lazily when it needs the hashes; an engine may call it
        earlier, off the critical path (on arrival, after appending tokens)."""
        if request.block_hash_key is None:
            request.block_hash_key = self._hasher_key
        elif request.block_hash_key != self._hasher_key:
            raise KVCacheManagerError(
                f"request {request.request_id!r} was hashed with (block_size, algo)="
                f"{request.block_hash_key}, this manager uses {self._hasher_key}"
            )
        self.hasher.extend(request.block_hashes, request.all_token_ids, request.extra_keys)

    @staticmethod
    def _raise_bad_counts(rid: str, *counts: object) -> None:
        names = ("num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens", "num_external_computed_tokens")
        for name, value in zip(names, counts):
            if type(value) is not int or value < 0:
                raise KVCacheManagerError(f"{name} must be an int >= 0, got {value!r} (request {rid!r})")

    def _check_hit(
        self, request: Request, num_new_computed_tokens: int, hit: KVCacheBlocks | None
    ) -> tuple[list[int], ...] | None:
        """Validate a cache hit handed back by the caller; return its blocks per group."""
        rid = request.request_id
        has_blocks = self.coordinator.has_request(rid)
        if hit is None or not any(hit.blocks):
            if num_new_computed_tokens:
                raise KVCacheManagerError(
                    f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens} without new_computed_blocks"
                )
            return None
        if has_blocks:
            raise KVCacheManagerError(f"request {rid!r} already holds blocks; a cache hit applies only to a new request")
        if len(hit.blocks) != self.coordinator.num_groups:
            raise KVCacheManagerError(
                f"request {rid!r}: new_computed_blocks has {len(hit.blocks)} groups, config has {self.coordinator.num_groups}"
            )
        for blocks, bs in zip(hit.blocks, self.block_sizes):
            if len(blocks) * bs != num_new_computed_tokens:
                raise KVCacheManagerError(
                    f"request {rid!r}: {len(blocks)} hit blocks of {bs} tokens do not cover "
                    f"num_new_computed_tokens={num_new_computed_tokens}"
                )
        if hit.eviction_stamp != self.pool.num_evictions:
            self.hash_request(request)
            block_hash = self.pool.block_hash
            coord = self.coordinator
            for t in coord.types:
                hashes = coord.group_hashes(request.block_hashes, t.hash_stride)
                for g in t.group_ids:
                    for b, h in zip(hit.blocks[g], hashes):
                        if b and block_hash[b] != h:
                            raise StaleCacheHitError(
                                f"request {rid!r}: hit block {b} of group {g} was evicted since get_computed_blocks"
                            )
        return hit.blocks

    def _external_hits(
        self, request: Request, hits: tuple[Sequence[int], ...] | None, num_external: int, total_computed: int
    ) -> tuple[list[int], ...]:
        """The hit blocks per group, null wherever a group's span no longer reaches at the
        end of the external tokens: such device-hit blocks are not taken at all."""
        rid = request.request_id
        coord = self.coordinator
        if coord.has_request(rid):
            raise KVCacheManagerError(f"request {rid!r} already holds blocks; external tokens apply only to a new request")
        if num_external % coord.lcm_block_size:
            raise KVCacheManagerError(
                f"request {rid!r}: num_external_computed_tokens={num_external} is not a multiple of "
                f"the block sizes' lcm {coord.lcm_block_size}"
            )
        out = []
        for g, m in enumerate(coord.managers):
            blocks = list(hits[g]) if hits else []
            skipped = m.num_skipped_tokens(total_computed) // m.block_size
            out.append([NULL_BLOCK] * skipped + blocks[skipped:])
        return tuple(out)
