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

Stores (``OffloadConfig.store``, see :data:`STORE_POLICIES`):

- ``on_eviction`` (default): a cached device block is stored when the pool hands it out
  again (:attr:`jaxkv.pool.BlockPool.on_reuse`), so host holds what the device lost
  and the two tiers together keep more distinct blocks. The gather of those blocks is
  issued before anything can overwrite them: before an admission's host load into
  fresh blocks, and before the step (:meth:`OffloadConnector.before_step`).
- ``write_through``: every full block is stored after the step that completes it
  (:meth:`OffloadConnector.after_step`); keys already on host are skipped.

``scripts/bench_offload.py`` compares the two on the multi-turn traces: storing on
eviction gets the higher hit rate (host does not duplicate the device's blocks) and
moves fewer bytes, hence the default. Sliding-window blocks are stored either way: a
block leaving the window stays cached in the free queue until it is reused.

Device order makes the early gather enough: it reads the blocks before any later
write to the (donated) cache, so a device block can be reused as soon as its store is
issued; the host copy and the offloading manager's bookkeeping settle later, without
blocking the loop (:meth:`OffloadConnector.finish_stores`).
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


STORE_POLICIES = ("on_eviction", "write_through")
"""When device blocks are stored to host: as the pool reuses them, or once filled."""


class ConnectorError(ValueError):
    """The connector cannot serve this manager or configuration."""


@dataclass(frozen=True)
class OffloadConfig:
    """A host tier of ``host_bytes`` with an eviction ``policy``, a ``store`` policy (and failure injection)."""

    host_bytes: int
    policy: str = "lru"
    store: str = "on_eviction"
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
        store: str = "on_eviction",
    ) -> None:
        if store not in STORE_POLICIES:
            raise ConnectorError(f"unknown store policy {store!r}; valid: {', '.join(STORE_POLICIES)}")
        if not manager.enable_caching:
            raise ConnectorError("the host tier is keyed by block hashes: it needs enable_caching=True")
        mamba = [m.group_id for m in manager.coordinator.managers if isinstance(m, MambaManager)]
        if mamba:
            raise ConnectorError(f"groups {mamba} hold Mamba state, which the host tier does not offload")
        self.manager = manager
        self.runner = runner
        self.offload = offload
        self.transfers = transfers
        self.store_policy = store
        self.stats = ConnectorStats()
        self._slots: dict[OffloadKey, int] = {}
        self._pending: list[_PendingStore] = []
        self._reused: dict[OffloadKey, int] = {}
        if store == "on_eviction":
            manager.pool.on_reuse = self._on_reuse

    @classmethod
    def create(cls, manager: KVCacheManager, runner: ModelRunner, config: OffloadConfig) -> OffloadConnector:
        """A host pool of ``config.host_bytes``, its slot backend, manager and transfer engine."""
        pool = HostKVPool.for_cache(runner.cache, config.host_bytes, memory_kind=config.memory_kind)
        offload = PolicyOffloadingManager(HostSlotBackend(pool.num_blocks), config.policy, enable_events=False)
        transfers = TransferEngine(pool, fail_store=config.fail_store, fail_load=config.fail_load)
        return cls(manager, runner, offload, transfers, config.store)

    # ------------------------------------------------------------- helpers
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
        hashes = self.manager.coordinator.hashes_per_group(request.block_hashes)
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
            self._store_reused()  # the fresh blocks may be reused ones: read them before the load
            if allocated is not None and self._load(request, num_hit, num_hit + num_ext):
                return num_hit + num_ext
        n = min(request.num_tokens - num_hit, budget)
        return num_hit if mgr.allocate_slots(request, n, num_hit, hit) is not None else None

    def _load(self, request: Request, start: int, end: int) -> bool:
        """Load the needed blocks of tokens ``[start, end)``; on failure free the request."""
        hashes = self.manager.coordinator.hashes_per_group(request.block_hashes)
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
    def _on_reuse(self, block_id: int, block_hash: bytes, group: int) -> None:
        self._reused.setdefault((block_hash, group), block_id)  # the first block holds computed KV

    def before_step(self) -> None:
        """Store the blocks the schedule took back from the prefix cache (call before the step)."""
        self._store_reused()

    def after_step(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Write-through: store the full blocks the step's chunks completed; settle done stores."""
        if self.store_policy == "write_through":
            block_of: dict[OffloadKey, int] = {}
            for chunk in chunks:
                hashes = self.manager.coordinator.hashes_per_group(chunk.seq.request.block_hashes)
                start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens
                for g, (blocks, bs) in enumerate(zip(chunk.block_ids, self.manager.block_sizes)):
                    for i in range(start // bs, end // bs):
                        if blocks[i]:
                            block_of.setdefault((hashes[g][i], g), blocks[i])
            self._store(block_of)
        self.finish_stores(wait=False)

    def _store_reused(self) -> None:
        block_of, self._reused = self._reused, {}
        self._store(block_of)

    def _store(self, block_of: dict[OffloadKey, int]) -> None:
        """Issue one store of device blocks ``block_of[key]`` for the keys host lacks."""
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

    def finish_stores(self, wait: bool = True) -> None:
        """Settle issued stores: all of them (``wait``), or those already done."""
        pending = []
        for p in self._pending:
            if not wait and not self.transfers.is_done(p.transfer):
                pending.append(p)
                continue
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
        self._pending = pending
