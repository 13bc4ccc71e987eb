"""The typed errors a :class:`~jaxkv.core.manager.KVCacheManager` call or a
:class:`~jaxkv.core.request.Request` raises for bad input; a refused call changes nothing.

A module of their own below the request, its checks and the manager, which all raise
them; ``jaxkv.core.manager`` re-exports them.
"""

from jaxkv.errors import JaxkvError


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
