"""The host-side manager: which blocks each request holds, and which are cached.

Everything here is plain Python and numpy (no JAX), so a scheduler, router or planning
process carries none:

- :mod:`~jaxkv.core.hashing`, :mod:`~jaxkv.core.prompt_digests`: chained block hashes;
- :mod:`~jaxkv.core.free_queue`, :mod:`~jaxkv.core.pool`: the free queue, ref counts and
  the hash -> block map (:class:`BlockPool`);
- :mod:`~jaxkv.core.single_type`, :mod:`~jaxkv.core.coordinator`: per-type rules and
  the prefix hit across KV cache groups;
- :mod:`~jaxkv.core.state_checkpoints`, :mod:`~jaxkv.core.state_retention`: where a
  recurrent state is cached, and which cached states stay;
- :mod:`~jaxkv.core.request`, :mod:`~jaxkv.core.request_checks`,
  :mod:`~jaxkv.core.held_request`, :mod:`~jaxkv.core.manager`: the façade a scheduler
  calls (:class:`KVCacheManager`) and what it keeps for each request holding blocks.
"""

from jaxkv.core.kv_cache_blocks import KVCacheBlocks
from jaxkv.core.manager import KVCacheManager, PrefixCacheStats
from jaxkv.core.manager_errors import (
    DuplicateRequestError,
    InvalidCacheHitError,
    KVCacheManagerError,
    MaxModelLenExceededError,
    StaleCacheHitError,
    UnknownRequestError,
)
from jaxkv.core.pool import NULL_BLOCK, BlockPool
from jaxkv.core.request import Request

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "DuplicateRequestError",
    "InvalidCacheHitError",
    "KVCacheBlocks",
    "KVCacheManager",
    "KVCacheManagerError",
    "MaxModelLenExceededError",
    "PrefixCacheStats",
    "Request",
    "StaleCacheHitError",
    "UnknownRequestError",
]
