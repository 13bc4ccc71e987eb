"""The scheduler-facing KV cache manager and the request it tracks.

``KVCacheManager`` is the one object a serving loop's scheduler talks to: look up a
request's cached prefix, allocate slots for the tokens it schedules (two-phase: adopt
the hit blocks, then take fresh ones, after checking that everything fits), free a
finished or preempted request, and read the block ids per KV cache group that the
device step needs. The vocabulary follows vLLM's scheduler side on purpose.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from threading import get_ident as _get_ident
from typing import NamedTuple, cast, overload

import numpy as np

from jaxkv.coordinator import KVCacheCoordinator
from jaxkv.errors import JaxkvError, OwnerThread
from jaxkv.hashing import MAX_TOKEN_ID, BlockHasher, ExtraKeys, MultiModalItem
from jaxkv.ints import is_int
from jaxkv.planner import KVCacheConfig
from jaxkv.pool import NULL_BLOCK, BlockPool, KVCacheEvent, ReuseListener
from jaxkv.single_type import NEVER, MambaManager


class KVCacheManagerError(JaxkvError, ValueError):
    """A call named something the manager cannot act on; nothing was changed."""


class UnknownRequestError(KVCacheManagerError, KeyError):
    """The request id holds no blocks in this manager."""

    def __str__(self) -> str:
        return str(self.args[0])


class DuplicateRequestError(KVCacheManagerError):
    """Another live request already uses this request id."""


class MaxModelLenExceededError(KVCacheManagerError):
    """An allocation would give a request more tokens than ``max_model_len``."""


class InvalidCacheHitError(KVCacheManagerError):
    """A cache hit handed to ``allocate_slots`` was not computed for this request."""


class StaleCacheHitError(InvalidCacheHitError):
    """Blocks from ``get_computed_blocks`` were evicted before ``allocate_slots``."""


class ReadOnlyTokenIds(Sequence[int]):
    """A read-only view of a request's token ids (slices come back as lists).

    The manager hashes full blocks once and caches them under those hashes, so a token
    edited in place afterwards would cache KV under the hash of tokens never computed;
    tokens only grow through :meth:`Request.append_output_token_ids`.
    """

    __slots__ = ("_ids",)

    def __init__(self, ids: list[int]) -> None:
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self._ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __add__(self, other: Sequence[int]) -> list[int]:
        return self._ids + list(other)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReadOnlyTokenIds):
            other = other._ids
        return isinstance(other, (list, tuple)) and self._ids == list(other)

    def __hash__(self) -> int:
        raise TypeError("ReadOnlyTokenIds is unhashable: it grows as tokens are appended")

    def __repr__(self) -> str:
        return repr(self._ids)


def _plain_token_ids(values: Sequence[int]) -> list[int] | None:
    """``values`` as a list when every one is a plain int in ``[2, MAX_TOKEN_ID]``, checked
    in bulk (~4x faster than per item for a long prompt); None: take the checking path.

    Packing as uint32 refuses non-ints, negatives and ids >= 2**32; read back as int32,
    ids >= 2**31 turn negative; an int sum means no numpy ints (they would make it a
    numpy scalar); 0 and 1 go the long way, since they may be bools.
    """
    try:
        packed = array("I", values)
    except (TypeError, OverflowError, ValueError):
        return None
    if not packed or type(sum(values)) is not int or np.frombuffer(packed, np.int32).min() <= 1:
        return None
    return list(values)


def token_id_list(values: object, what: str) -> list[int]:
    """``values`` as a list of token ids; :class:`KVCacheManagerError` naming the first bad one.

    A 1-D sequence or array of ints (numpy ints too) in ``[0, MAX_TOKEN_ID]``; bools,
    floats, strings, nested lists and 2-D arrays are refused.
    """
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise KVCacheManagerError(f"{what} must be a sequence of token ids, got {values!r:.80}")
    if isinstance(values, (list, tuple)):
        plain = _plain_token_ids(values)
        if plain is not None:
            return plain
    ndim = getattr(values, "ndim", 1)
    if ndim != 1:
        raise KVCacheManagerError(f"{what} must be 1-D, got an array of shape {getattr(values, 'shape', None)}")
    ids: list[int] = list(values)  # type: ignore[call-overload]
    if set(map(type, ids)) - {int}:
        bad = [t for t in ids if not is_int(t)][:1]  # is_int refuses bools
        if bad:
            raise KVCacheManagerError(f"{what}: {bad[0]!r} is not a token id (an int)")
        ids = [int(t) for t in ids]
    if ids and (min(ids) < 0 or max(ids) > MAX_TOKEN_ID):
        outside = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        raise KVCacheManagerError(f"{what}: token id {outside} is outside [0, {MAX_TOKEN_ID}]")
    return ids


class Request:
    """A request's tokens and scheduling progress, as the KV cache manager sees them.

    ``num_computed_tokens`` is advanced by the caller's scheduler, as in vLLM. Block
    hashes are filled in lazily by the manager, only for full blocks. Token ids are
    checked on the way in and read-only afterwards (``all_token_ids`` is a view).
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
        ids = token_id_list(prompt_token_ids, f"request {request_id!r}: prompt_token_ids")
        if not ids:
            raise KVCacheManagerError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(ids)
        self._token_ids = ids
        self._token_view = ReadOnlyTokenIds(ids)
        self.num_prompt_tokens = len(ids)
        self.extra_keys = ExtraKeys(cache_salt=cache_salt, lora_name=lora_name, mm_items=tuple(mm_items))
        self.num_computed_tokens = 0
        self.block_hashes: list[bytes] = []
        # (block size, algorithm) of the hasher that filled block_hashes.
        self.block_hash_key: tuple[int, str] | None = None
        # Set by the manager holding the request's blocks: the manager, and the event
        # thresholds below which its next allocation changes nothing.
        self._holder: object | None = None
        self._thresholds = (0, 0, 0)
        # How far full attention alone matched at the last lookup (an anchor for retention).
        self._reach = 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self._token_ids)

    @property
    def all_token_ids(self) -> ReadOnlyTokenIds:
        """Prompt plus generated tokens (a read-only view)."""
        return self._token_view

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self.num_prompt_tokens :]

    @property
    def cache_salt(self) -> str | None:
        return self.extra_keys.cache_salt

    @property
    def lora_name(self) -> str | None:
        return self.extra_keys.lora_name

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        """Record generated tokens (one id or several); a bad id changes nothing."""
        if type(token_ids) is int and 0 <= token_ids <= MAX_TOKEN_ID:
            self._token_ids.append(token_ids)
        elif (
            type(token_ids) is list
            and len(token_ids) == 1
            and type(t := token_ids[0]) is int
            and 0 <= t <= MAX_TOKEN_ID
        ):
            self._token_ids.append(t)
        elif is_int(token_ids):
            self._token_ids.extend(token_id_list([token_ids], f"request {self.request_id!r}: output token"))
        else:
            self._token_ids.extend(token_id_list(token_ids, f"request {self.request_id!r}: output tokens"))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )


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
    """Decides which blocks hold which tokens, for every KV cache group of a model.

    Single-owner: the thread that creates it is the only one that may call it (a call
    from another thread raises :class:`~jaxkv.errors.WrongThreadError`), as vLLM's
    scheduler thread owns its manager. It talks to the coordinator only.

    ``retention`` picks how unreferenced blocks queue for eviction
    (:data:`jaxkv.coordinator.RETENTION_RULES`): ``vllm`` makes vLLM v1's decisions;
    ``group_aware`` keeps, under memory pressure, the sliding-window blocks that
    complete hits of a hybrid model.

    With the planner's ``state_pool`` layout, recurrent state is cached at *checkpoint
    positions* (:meth:`checkpoint_positions`): where the request's prompt ends, where
    full attention alone matched further than the whole hit (so the next request
    sharing that prefix finds a state there), every ``checkpoint_interval`` tokens of
    the prompt if set, and every block boundary while it decodes, of which only the
    newest stays in queue order (the prompt's end is superseded too). A scheduler ends
    prefill chunks there (:meth:`chunk_limit`): a state exists only where a step ends.
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
    ) -> None:
        if not isinstance(config, KVCacheConfig):
            raise KVCacheManagerError(f"config must be a KVCacheConfig, got {config!r:.80}")
        max_model_len = max_model_len if max_model_len is not None else config.max_model_len
        if not is_int(max_model_len) or max_model_len <= 0:
            raise KVCacheManagerError(
                f"max_model_len must be a positive int (here or in the config), got {max_model_len!r}"
            )
        if checkpoint_interval is not None and (
            not is_int(checkpoint_interval) or checkpoint_interval <= 0 or checkpoint_interval % config.hash_block_size
        ):
            raise KVCacheManagerError(
                f"checkpoint_interval must be a positive multiple of the hash block size "
                f"{config.hash_block_size}, got {checkpoint_interval!r}"
            )
        self.config = config
        self.max_model_len = int(max_model_len)
        self.checkpoint_interval = checkpoint_interval
        # Block size of the state groups (the hash block size; state pool or shared pages), 0 without.
        self._state_block_size = config.hash_block_size if config.state_group_ids else 0
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.coordinator = KVCacheCoordinator(config, enable_events=enable_events, retention=retention)
        self.hasher = BlockHasher(self.coordinator.hash_block_size, hash_algo)
        # Returned for a miss or an allocation needing no new block: immutable, so shared.
        self._no_blocks = KVCacheBlocks(tuple(() for _ in config.groups))
        self._hasher_key = (self.hasher.block_size, self.hasher.algo)
        self._hash_block_size = self.hasher.block_size
        self._owner = OwnerThread("KVCacheManager")
        # Requests holding blocks, by id: a second live request with the same id is refused.
        self._requests: dict[str, Request] = {}
        self._num_requests = 0
        self._num_queried = 0
        self._num_hits = 0
        self._num_resets = 0

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
        return tuple(g.block_size for g in self.config.groups)

    @property
    def lcm_block_size(self) -> int:
        """The granularity of a hit: every group's blocks end on its multiples."""
        return self.coordinator.lcm_block_size

    @property
    def num_requests(self) -> int:
        """Requests holding blocks now."""
        return len(self._requests)

    def has_request(self, request_id: str) -> bool:
        """Whether a request of this id holds blocks."""
        return request_id in self._requests

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
        if request_id not in self._requests:
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

    def _shared_checkpoints(self, request: Request, num_computed_tokens: int) -> set[int]:
        """Checkpoint positions other requests are expected to hit: where full attention
        alone matched (when that ran ahead of the hit) and every ``checkpoint_interval``."""
        bs = self._state_block_size
        prompt_end = request.num_prompt_tokens // bs * bs
        positions = {request._reach // bs * bs}
        if self.checkpoint_interval:
            positions.update(range(self.checkpoint_interval, prompt_end, self.checkpoint_interval))
        return {p for p in positions if num_computed_tokens < p <= prompt_end}

    def checkpoint_positions(self, request: Request, num_computed_tokens: int) -> tuple[int, ...]:
        """Positions past ``num_computed_tokens``, in order, where the request's prefill
        caches its recurrent state (empty without a state pool or without caching):
        the last block boundary of the prompt, the boundary where full attention alone
        matched (when that ran ahead of the hit) and every ``checkpoint_interval``."""
        bs = self._state_block_size
        if not bs or not self.enable_caching:
            return ()
        positions = self._shared_checkpoints(request, num_computed_tokens)
        prompt_end = request.num_prompt_tokens // bs * bs
        if prompt_end > num_computed_tokens:
            positions.add(prompt_end)
        return tuple(sorted(positions))

    def chunk_limit(self, request: Request, start: int, num_new_tokens: int) -> int:
        """``num_new_tokens`` cut so a chunk starting at ``start`` ends at the request's
        next checkpoint position, if one falls inside it (a state exists only where a
        step ends); unchanged without a state pool."""
        if self._state_block_size and num_new_tokens > 1:
            positions = self.checkpoint_positions(request, start)
            if positions and positions[0] < start + num_new_tokens:
                return positions[0] - start
        return num_new_tokens

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_requests, self._num_queried, self._num_hits, self._num_resets)

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
        is always computed (its logits are needed).
        """
        self._owner.check()
        self._check_request(request)
        if not self.enable_caching:
            return self._no_blocks, 0
        self.hash_request(request)
        blocks, n, request._reach = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        self._num_requests += 1
        self._num_queried += request.num_tokens
        self._num_hits += n
        if n == 0:
            return self._no_blocks, 0
        prefix_hash = request.block_hashes[n // self.coordinator.hash_block_size - 1]
        return KVCacheBlocks(blocks, self.coordinator.num_evictions, request.request_id, prefix_hash), n

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
            and request._holder is self
            and new_computed_blocks is None
            and type(num_new_tokens) is int
            and type(num_lookahead_tokens) is int
            and num_new_tokens > 0
            and num_lookahead_tokens >= 0
            and num_new_computed_tokens == 0
            and num_external_computed_tokens == 0
        ):
            capacity, next_full, next_skip = request._thresholds
            computed = request.num_computed_tokens
            end = computed + num_new_tokens
            if end + num_lookahead_tokens <= capacity and end < next_full and computed < next_skip:
                return self._no_blocks
        self._check_request(request)
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
                f"+ {num_external_computed_tokens} external + {num_new_tokens} new tokens exceeds "
                f"max_model_len={self.max_model_len}"
            )
        num_slots = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_cacheable = min(total_computed + num_new_tokens, request.num_tokens) if self.enable_caching else -1
        coord = self.coordinator
        held = self._requests.get(rid) is request
        if not held:
            self._check_new_request(request)
        if self.enable_caching:
            self.hash_request(request)
        hits = self._check_hit(request, num_new_computed_tokens, new_computed_blocks)
        if num_external_computed_tokens:
            hits = self._external_hits(request, hits, num_external_computed_tokens, total_computed)
        if not coord.can_allocate(rid, num_slots, hits, num_computed):
            return None
        if not held:
            coord.set_anchors(rid, (total_computed, request._reach))
            if self._state_block_size:
                coord.set_checkpoints(rid, self._shared_checkpoints(request, total_computed), request.num_prompt_tokens)
        new_blocks = coord.allocate(rid, num_slots, hits, num_computed)
        self._requests[rid] = request
        if self.enable_caching:
            coord.cache_blocks(rid, request.block_hashes, num_cacheable, request._token_ids, request.lora_name)
        capacity, next_full, next_skip = coord.thresholds(rid)
        request._thresholds = (
            min(capacity, self.max_model_len),
            next_full if self.enable_caching else NEVER,
            next_skip,
        )
        request._holder = self
        return KVCacheBlocks(new_blocks)

    def free(self, request: Request | str) -> None:
        """Release every block the request holds (finished or preempted)."""
        self._owner.check()
        rid = cast(str, request if isinstance(request, str) else getattr(request, "request_id", request))
        held = self._requests.pop(rid, None)
        if held is None:
            raise UnknownRequestError(f"cannot free unknown (or already freed) request {rid!r}")
        held._holder = None
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
        tokens = request._token_ids
        if len(tokens) >= (len(request.block_hashes) + 1) * self._hash_block_size:  # a new full block
            self.hasher.extend(request.block_hashes, tokens, request.extra_keys)

    # ------------------------------------------------------------------ checks
    @staticmethod
    def _check_request(request: object) -> None:
        if not isinstance(request, Request):
            raise KVCacheManagerError(f"expected a jaxkv.manager.Request, got {request!r:.80}")

    def _check_new_request(self, request: Request) -> None:
        """A request about to get its first blocks: its id is free and nothing counts as computed."""
        rid = request.request_id
        if rid in self._requests:
            raise DuplicateRequestError(f"request id {rid!r} is already used by another live request")
        if request.num_computed_tokens:
            raise KVCacheManagerError(
                f"request {rid!r} holds no blocks but has num_computed_tokens={request.num_computed_tokens} "
                "(stale after free or preemption?): a request starts from 0 computed tokens"
            )

    @staticmethod
    def _raise_bad_counts(rid: str, *counts: object) -> None:
        names = ("num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens", "num_external_computed_tokens")
        for name, value in zip(names, counts, strict=True):
            if type(value) is not int or value < 0:
                raise KVCacheManagerError(f"{name} must be an int >= 0, got {value!r} (request {rid!r})")

    def _check_hit(
        self, request: Request, num_new_computed_tokens: int, hit: KVCacheBlocks | None
    ) -> tuple[Sequence[int], ...] | None:
        """Validate a cache hit handed back by the caller; return its blocks per group."""
        rid = request.request_id
        if hit is not None and not isinstance(hit, KVCacheBlocks):
            raise KVCacheManagerError(f"request {rid!r}: new_computed_blocks must be KVCacheBlocks, got {hit!r:.80}")
        if hit is None or not any(hit.blocks):
            if num_new_computed_tokens:
                raise KVCacheManagerError(
                    f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens} without new_computed_blocks"
                )
            return None
        coord = self.coordinator
        if rid in self._requests:
            raise KVCacheManagerError(
                f"request {rid!r} already holds blocks; a cache hit applies only to a new request"
            )
        if not self.enable_caching:
            raise InvalidCacheHitError(f"request {rid!r}: a cache hit was given to a manager without prefix caching")
        if len(hit.blocks) != coord.num_groups:
            raise KVCacheManagerError(
                f"request {rid!r}: new_computed_blocks has {len(hit.blocks)} groups, config has {coord.num_groups}"
            )
        for blocks, bs in zip(hit.blocks, self.block_sizes, strict=True):
            if len(blocks) * bs != num_new_computed_tokens:
                raise KVCacheManagerError(
                    f"request {rid!r}: {len(blocks)} hit blocks of {bs} tokens do not cover "
                    f"num_new_computed_tokens={num_new_computed_tokens}"
                )
        hashes = request.block_hashes
        n = num_new_computed_tokens // coord.hash_block_size
        if n > len(hashes) or num_new_computed_tokens >= request.num_tokens:
            raise InvalidCacheHitError(
                f"request {rid!r}: a hit of {num_new_computed_tokens} tokens does not fit its "
                f"{request.num_tokens}-token prompt"
            )
        mine = hit.request_id == rid and hit.prefix_hash == hashes[n - 1]
        if not mine or hit.eviction_stamp != coord.num_evictions:
            bad = coord.invalid_hit_block(hashes, hit.blocks)
            if bad is not None:
                error = StaleCacheHitError if mine else InvalidCacheHitError
                raise error(
                    f"request {rid!r}: hit block {bad[1]!r} of group {bad[0]} is not cached for this request's "
                    + (
                        "prefix (evicted since get_computed_blocks)"
                        if mine
                        else "prefix (another request's or forged hit)"
                    )
                )
        return hit.blocks

    def _external_hits(
        self, request: Request, hits: tuple[Sequence[int], ...] | None, num_external: int, total_computed: int
    ) -> tuple[list[int], ...]:
        """The hit blocks per group, null wherever a group's span no longer reaches at the
        end of the external tokens: such device-hit blocks are not taken at all."""
        rid = request.request_id
        coord = self.coordinator
        if rid in self._requests:
            raise KVCacheManagerError(
                f"request {rid!r} already holds blocks; external tokens apply only to a new request"
            )
        if num_external % coord.lcm_block_size:
            raise KVCacheManagerError(
                f"request {rid!r}: num_external_computed_tokens={num_external} is not a multiple of "
                f"the block sizes' lcm {coord.lcm_block_size}"
            )
        if not self.enable_caching:
            raise KVCacheManagerError(f"request {rid!r}: external tokens are keyed by block hashes (caching is off)")
        out = []
        for g in range(coord.num_groups):
            blocks = list(hits[g]) if hits else []
            skipped = coord.needed_blocks(g, 0, total_computed).start
            out.append([NULL_BLOCK] * skipped + blocks[skipped:])
        return tuple(out)
