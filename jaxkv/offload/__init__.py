"""The host-memory offload tier: manager (metadata), policies, host pool, transfers."""

from jaxkv.offload.host_pool import (
    Backend,
    HostKVPool,
    HostPoolError,
    HostSlotBackend,
    blocks_in_budget,
    pinned_host_supported,
)
from jaxkv.offload.manager import (
    KeysRemoved,
    KeysStored,
    NotPinnedError,
    NotReadyError,
    NotStoredError,
    OffloadError,
    OffloadingManager,
    PolicyOffloadingManager,
    PrepareStoreOutput,
)
from jaxkv.offload.policies import (
    POLICIES,
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    make_policy,
)
from jaxkv.offload.transfer import (
    TransferEngine,
    TransferError,
    TransferResult,
    bucket_size,
)

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "Backend",
    "EvictionPolicy",
    "HostKVPool",
    "HostPoolError",
    "HostSlotBackend",
    "KeysRemoved",
    "KeysStored",
    "LRUPolicy",
    "NotPinnedError",
    "NotReadyError",
    "NotStoredError",
    "OffloadError",
    "OffloadingManager",
    "PolicyOffloadingManager",
    "PrepareStoreOutput",
    "TransferEngine",
    "TransferError",
    "TransferResult",
    "blocks_in_budget",
    "bucket_size",
    "make_policy",
    "pinned_host_supported",
]
