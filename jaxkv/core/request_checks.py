"""The checks a manager call runs on a request and on a cache hit handed back to it.

Pure functions over what each check needs (the coordinator through its public
methods): each raises a typed :class:`~jaxkv.core.manager_errors.KVCacheManagerError`
naming the offending value, before the manager changes anything.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxkv.core.coordinator import KVCacheCoordinator
from jaxkv.core.kv_cache_blocks import KVCacheBlocks
from jaxkv.core.manager_errors import (
    DuplicateRequestError,
    InvalidCacheHitError,
    KVCacheManagerError,
    StaleCacheHitError,
)
from jaxkv.core.request import Request

COUNT_NAMES = ("num_new_tokens", "num_new_computed_tokens", "num_lookahead_tokens", "num_external_computed_tokens")
"""The token counts ``allocate_slots`` takes, in the order :func:`check_counts` takes them."""


def check_request(request: object) -> None:
    """Refuse anything but a :class:`~jaxkv.core.request.Request`."""
    if not isinstance(request, Request):
        raise KVCacheManagerError(f"expected a jaxkv.core.manager.Request, got {request!r:.80}")


def check_new_request(request: Request, id_in_use: bool) -> None:
    """A request about to get its first blocks: its id is free (``id_in_use``: another
    live request holds blocks under it) and nothing counts as computed."""
    rid = request.request_id
    if id_in_use:
        raise DuplicateRequestError(f"request id {rid!r} is already used by another live request")
    if request.num_computed_tokens:
        raise KVCacheManagerError(
            f"request {rid!r} holds no blocks but has num_computed_tokens={request.num_computed_tokens} "
            "(stale after free or preemption?): a request starts from 0 computed tokens"
        )


def check_counts(rid: str, *counts: object) -> None:
    """Refuse the first of ``allocate_slots``' counts (in :data:`COUNT_NAMES` order) that
    is not an int >= 0. The manager tests them inline and calls this only to name one."""
    for name, value in zip(COUNT_NAMES, counts, strict=True):
        if type(value) is not int or value < 0:
            raise KVCacheManagerError(f"{name} must be an int >= 0, got {value!r} (request {rid!r})")


def check_hit(
    request: Request,
    num_new_computed_tokens: int,
    hit: KVCacheBlocks | None,
    *,
    held: bool,
    enable_caching: bool,
    block_sizes: Sequence[int],
    coordinator: KVCacheCoordinator,
) -> tuple[Sequence[int], ...] | None:
    """A cache hit handed back for ``request`` (``held``: it holds blocks already): its
    blocks per group, None without one. Refused unless it is this request's hit from
    ``get_computed_blocks``, still cached, and covers exactly ``num_new_computed_tokens``."""
    rid = request.request_id
    if hit is not None and not isinstance(hit, KVCacheBlocks):
        raise KVCacheManagerError(f"request {rid!r}: new_computed_blocks must be KVCacheBlocks, got {hit!r:.80}")
    if hit is None or not any(hit.blocks):
        if num_new_computed_tokens:
            raise KVCacheManagerError(
                f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens} without new_computed_blocks"
            )
        return None
    if held:
        raise KVCacheManagerError(f"request {rid!r} already holds blocks; a cache hit applies only to a new request")
    if not enable_caching:
        raise InvalidCacheHitError(f"request {rid!r}: a cache hit was given to a manager without prefix caching")
    if len(hit.blocks) != coordinator.num_groups:
        raise KVCacheManagerError(
            f"request {rid!r}: new_computed_blocks has {len(hit.blocks)} groups, config has {coordinator.num_groups}"
        )
    for blocks, bs in zip(hit.blocks, block_sizes, strict=True):
        if len(blocks) * bs != num_new_computed_tokens:
            raise KVCacheManagerError(
                f"request {rid!r}: {len(blocks)} hit blocks of {bs} tokens do not cover "
                f"num_new_computed_tokens={num_new_computed_tokens}"
            )
    hashes = request.block_hashes
    n = num_new_computed_tokens // coordinator.hash_block_size
    if n > len(hashes) or num_new_computed_tokens >= request.num_tokens:
        raise InvalidCacheHitError(
            f"request {rid!r}: a hit of {num_new_computed_tokens} tokens does not fit its "
            f"{request.num_tokens}-token prompt"
        )
    mine = hit.request_id == rid and hit.prefix_hash == hashes[n - 1]
    if not mine or hit.eviction_stamp != coordinator.num_evictions:
        bad = coordinator.invalid_hit_block(hashes, hit.blocks)
        if bad is not None:
            error = StaleCacheHitError if mine else InvalidCacheHitError
            raise error(
                f"request {rid!r}: hit block {bad[1]!r} of group {bad[0]} is not cached for this request's "
                + ("prefix (evicted since get_computed_blocks)" if mine else "prefix (another request's or forged hit)")
            )
    return hit.blocks


def check_external(rid: str, num_external: int, *, held: bool, lcm_block_size: int, enable_caching: bool) -> None:
    """``num_external`` tokens an offload tier fills for request ``rid`` (``held``: it
    holds blocks already): whole blocks of every group, for a new request, keyed by
    block hashes (so only with prefix caching)."""
    if held:
        raise KVCacheManagerError(f"request {rid!r} already holds blocks; external tokens apply only to a new request")
    if num_external % lcm_block_size:
        raise KVCacheManagerError(
            f"request {rid!r}: num_external_computed_tokens={num_external} is not a multiple of "
            f"the block sizes' lcm {lcm_block_size}"
        )
    if not enable_caching:
        raise KVCacheManagerError(f"request {rid!r}: external tokens are keyed by block hashes (caching is off)")
