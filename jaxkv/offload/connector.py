"""The connector between the host offload tier and the KV cache manager / serving loop.

Admission (:meth:`OffloadConnector.allocate_admitted`, called by the scheduler): the
device prefix hit first, then the host tier for the blocks after it. A block position
counts only if every group holds it on host; a sliding-window group only needs the
blocks still in its window at the end of the host hit (the others stay null, see
``KVCacheManager.allocate_slots(num_external_computed_tokens=...)``). The needed blocks
get fresh device blocks and are loaded host->device at once; the load is waited for
during admission, so a failed load falls back to the device hit before the step is
built: the request's blocks are dropped from the prefix cache and freed, and it is
allocated again to recompute those tokens (never reading garbage KV).

Stores are **write-through**: after each step, the blocks its chunks filled are
stored (:meth:`OffloadConnector.store`), and the stores are waited for before the
next schedule (:meth:`OffloadConnector.finish_stores`), i.e. before the pool can
hand one of those device blocks to another request. Storing on eviction instead would
have to run inside ``BlockPool.get_new_blocks``, synchronously, just before the block
is overwritten, and would miss sliding-window blocks, which leave a request (and are
reused) as soon as they fall out of the window, without ever being evicted from the
prefix cache. Write-through stores each block once (keys already on host are
skipped), off the allocation path, while its request still holds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxkv.manager import KVCacheBlocks, KVCacheManager, Request
from jaxkv.managers import MambaManager
from jaxkv.offload.host_pool import HostKVPool, HostSlotBackend
from jaxkv.offload.manager import OffloadingManager, OffloadKey, PolicyOffloadingManager
from jaxkv.offload.transfer import FailureHook, Transfer, TransferEngine
from jaxkv.serving.runner import ModelRunner
from jaxkv.serving.scheduler import ScheduledChunk


class ConnectorError(ValueError):
    """The connector cannot serve this manager or configuration."""


@dataclass(frozen=True)
class OffloadConfig:
    """A host tier of ``host_bytes`` with an eviction ``policy`` (and failure injection)."""

    host_bytes: int
    policy: str = "lru"
    memory_kind: str | None = None
    fail_store: FailureHook | None = None
    fail_load: FailureHook | None = None


@dataclass
class ConnectorStats:
    """Cumulative counters (blocks are (block, group) keys)."""

    num_loaded_tokens: int = 0
    num_loaded_blocks: int = 0
    num_failed_loads: int = 0
    num_stored_blocks: int = 0
    num_failed_stores: int = 0
    num_skipped_stores: int = 0


@dataclass
class _PendingStore:
    keys: tuple[OffloadKey, ...]
    transfer: Transfer


class OffloadConnector:
    """Moves blocks between one runner's device cache and a host tier, for one manager."""

    def __init__(
        self,
        manager: KVCacheManager,
        runner: ModelRunner,
        offload: OffloadingManager,
        transfers: TransferEngine,
    ) -> None:
        if not manager.enable_caching:
            raise ConnectorError("the host tier is keyed by block hashes: it needs enable_caching=True")
        mamba = [m.group_id for m in manager.coordinator.managers if isinstance(m, MambaManager)]
        if mamba:
            raise ConnectorError(f"groups {mamba} hold Mamba state, which the host tier does not offload")
        self.manager = manager
        self.runner = runner
        self.offload = offload
        self.transfers = transfers
        self.stats = ConnectorStats()
        self._slots: dict[OffloadKey, int] = {}
        self._pending: list[_PendingStore] = []

    @classmethod
    def create(cls, manager: KVCacheManager, runner: ModelRunner, config: OffloadConfig) -> OffloadConnector:
        """A host pool of ``config.host_bytes``, its slot backend, manager and transfer engine."""
        pool = HostKVPool.for_cache(runner.cache, config.host_bytes, memory_kind=config.memory_kind)
        offload = PolicyOffloadingManager(HostSlotBackend(pool.num_blocks), config.policy, enable_events=False)
        transfers = TransferEngine(pool, fail_store=config.fail_store, fail_load=config.fail_load)
        return cls(manager, runner, offload, transfers)

    # ------------------------------------------------------------- helpers
    def _group_hashes(self, request: Request) -> list[Sequence[bytes]]:
        coord = self.manager.coordinator
        out: list[Sequence[bytes]] = [()] * coord.num_groups
        for t in coord.types:
            for g in t.group_ids:
                out[g] = coord.group_hashes(request.block_hashes, t.hash_stride)
        return out

    def _needed(self, g: int, start: int, end: int) -> range:
        """Block indices of group ``g`` in tokens ``[start, end)`` still needed at ``end``."""
        m = self.manager.coordinator.managers[g]
        first = max(start // m.block_size, m.num_skipped_tokens(end) // m.block_size)
        return range(first, end // m.block_size)

    def _host_hit(self, request: Request, start: int) -> int:
        """Tokens after ``start`` whose needed blocks are on host in every group."""
        coord = self.manager.coordinator
        lcm = coord.lcm_block_size
        max_end = (request.num_tokens - 1) // lcm * lcm
        if max_end <= start:
            return 0
        hashes = self._group_hashes(request)
        ready = []  # per group: prefix counts of ready blocks from start's block on
        for g, m in enumerate(coord.managers):
            lo, hi = start // m.block_size, max_end // m.block_size
            flags = [self.offload.lookup([(hashes[g][i], g)]) == 1 for i in range(lo, hi)]
            ready.append((lo, np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])))

        def covered(end: int) -> bool:
            for g, (lo, cum) in enumerate(ready):
                r = self._needed(g, start, end)
                if cum[r.stop - lo] - cum[r.start - lo] != len(r):
                    return False
            return True

        return next((end - start for end in range(max_end, start, -lcm) if covered(end)), 0)

    # ----------------------------------------------------------- admission
    def allocate_admitted(self, request: Request, hit: KVCacheBlocks, num_hit: int, budget: int) -> int | None:
        """Allocate a waiting request after its device hit; its computed tokens, or None if it does not fit.

        Extends the hit from the host tier when it can (loading the blocks now); the
        request then has slots for ``min(num_tokens - computed, budget)`` new tokens.
        """
        mgr = self.manager
        num_ext = self._host_hit(request, num_hit)
        if num_ext:
            n = min(request.num_tokens - num_hit - num_ext, budget)
            allocated = mgr.allocate_slots(request, n, num_hit, hit, num_external_computed_tokens=num_ext)
            if allocated is not None and self._load(request, num_hit, num_hit + num_ext):
                return num_hit + num_ext
        n = min(request.num_tokens - num_hit, budget)
        return num_hit if mgr.allocate_slots(request, n, num_hit, hit) is not None else None

    def _load(self, request: Request, start: int, end: int) -> bool:
        """Load the needed blocks of tokens ``[start, end)``; on failure free the request."""
        hashes = self._group_hashes(request)
        table = self.manager.get_block_ids(request.request_id)
        keys: list[OffloadKey] = []
        ids: list[int] = []
        for g in range(len(table)):
            for i in self._needed(g, start, end):
                keys.append((hashes[g][i], g))
                ids.append(table[g][i])
        slots = self.offload.prepare_load(keys)
        self.offload.touch(keys)
        self.runner.cache, transfer = self.transfers.load(self.runner.cache, ids, slots)
        result = self.transfers.wait(transfer)
        self.offload.complete_load(keys)
        if not result.failed:
            self.stats.num_loaded_tokens += end - start
            self.stats.num_loaded_blocks += len(keys)
            return True
        self.stats.num_failed_loads += 1
        # Every block past the device hit was registered before its data arrived.
        mgr = self.manager
        mgr.evict_blocks(
            [b for g, blocks in enumerate(table) for b in blocks[start // mgr.block_sizes[g] :] if b]
        )
        mgr.free(request)
        return False

    # -------------------------------------------------------------- stores
    def store(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Issue stores of the full blocks the step's chunks completed (call after the step)."""
        block_of: dict[OffloadKey, int] = {}
        for chunk in chunks:
            hashes = self._group_hashes(chunk.seq.request)
            start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens
            for g, (blocks, bs) in enumerate(zip(chunk.block_ids, self.manager.block_sizes)):
                for i in range(start // bs, end // bs):
                    if blocks[i]:
                        block_of.setdefault((hashes[g][i], g), blocks[i])
        if not block_of:
            return
        plan = self.offload.prepare_store(list(block_of))
        if plan is None:
            self.stats.num_skipped_stores += len(block_of)
            return
        if plan.evicted:
            self.transfers.pool.release([self._slots.pop(k) for k in plan.evicted])
        if not plan.keys_to_store:
            return
        self._slots.update(zip(plan.keys_to_store, plan.where))
        transfer = self.transfers.store(
            self.runner.cache, [block_of[k] for k in plan.keys_to_store], plan.where
        )
        self._pending.append(_PendingStore(plan.keys_to_store, transfer))

    def finish_stores(self) -> None:
        """Wait for every issued store and settle it (call before the pool hands blocks out)."""
        for p in self._pending:
            result = self.transfers.wait(p.transfer)
            ok = [p.keys[i] for i in result.ok]
            failed = [p.keys[i] for i in result.failed]
            if ok:
                self.offload.complete_store(ok, success=True)
            if failed:
                self.offload.complete_store(failed, success=False)
                self.transfers.pool.release([self._slots.pop(k) for k in failed])
            self.stats.num_stored_blocks += len(ok)
            self.stats.num_failed_stores += len(failed)
        self._pending.clear()
