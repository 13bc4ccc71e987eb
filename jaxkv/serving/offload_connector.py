"""The connector between the host offload tier and the KV cache manager / serving loop.

Admission (:meth:`OffloadConnector.allocate_admitted`, called by the scheduler): the
device prefix hit first, then the host tier for the blocks after it. A block position
counts only if every group holds it on host; a sliding-window group only needs the
blocks still in its window at the end of the host hit (the others stay null, see
``KVCacheManager.allocate_slots(num_external_computed_tokens=...)``). The host keys are
pinned before anything else happens, so neither the allocation nor the stores it
triggers can evict them; the needed blocks get fresh device blocks and are loaded
host->device at once. The load is not waited for: its outcome is known when it is
issued (:meth:`~jaxkv.offload.transfer.TransferEngine.poll`; its only failures are
injected ones, decided before it is issued, and the rows it reads are fixed at issue),
and the step that reads the loaded blocks takes the cache the load's scatter returned,
so the device runs it after the load while the host goes on scheduling. A failed load
falls back before the step is built: the request's blocks past the device hit are
dropped from the prefix cache and freed, the prefix is looked up again (the allocation
may have evicted blocks of the first device hit) and the rest is recomputed, never
read as garbage KV. Any exception during admission leaves nothing held. Every admission
refreshes the host recency of the request's prefix, as vLLM does on each lookup, so a
prefix served from the device does not age out of the host tier.

With peers (``OffloadConfig.peers``: other processes' host-tier files on this machine,
:mod:`jaxkv.offload.peers`), the blocks after the device hit that this tier lacks and a
peer holds are copied into staging rows of its host buffers (each copy checked against
the peer's journal) and loaded with the tier's own: rows past the tier's host blocks (a
quarter as many, at most one longest prompt's, beyond ``host_bytes``: transient copies, not
cache), which its catalog never hands out, so a peer hit evicts nothing and a block stays
in the host tier of the replica that computed it (the fleet's tiers hold it once). Staged
rows are neither journaled nor announced.

Stores (``OffloadConfig.store``, see :data:`STORE_POLICIES`):

- ``on_eviction`` (default): a cached device block is stored when the pool hands it out
  again (a reuse listener, :meth:`jaxkv.core.manager.KVCacheManager.add_reuse_listener`),
  so host holds what the device lost and the two tiers together keep more distinct blocks. The gather of those blocks is
  issued before anything can overwrite them: before an admission's host load into
  fresh blocks, and before the step (:meth:`OffloadConnector.before_step`).
  A hybrid's groups lose a prefix's blocks at different times (window blocks and
  state checkpoints leave early, full-attention blocks stay), while a host hit needs
  every group's blocks of the prefix on host: a reused block brings along what a
  host hit ending at it needs in every group, still cached on device and not on host
  yet (found through the chain of block hashes the connector saw its requests
  compute; the walk back stops at the first block host holds already). If some
  needed block is in neither tier, no hit can end there and nothing more is stored.
- ``write_through``: every full block is stored after the step that completes it
  (:meth:`OffloadConnector.after_step`); keys already on host are skipped. When host
  must evict, it evicts first the blocks the device still holds (they are not lost),
  and stores those again when the pool reuses them (only those: a block loaded from a
  peer stays in the peer's tier), so the two tiers hold more distinct blocks.

``scripts/bench_offload.py`` compares the two on the multi-turn traces: storing on
eviction gets the higher hit rate (host does not duplicate the device's blocks) and
moves fewer bytes, hence the default. Sliding-window blocks are stored either way: a
block leaving the window stays cached in the free queue until it is reused.

Recurrent state has a tier of its own: state checkpoints are keyed like attention
blocks (chained hash, group) in a second catalog and host buffers of state rows, stored
as their blocks are reused (or once cached, write-through) and loaded on admission
into the request's running row: a host hit needs, at its end, a state checkpoint on
host as well as every attention block before it. Every state layout: the rows are
state-pool slots, (vLLM's rule) the recurrent group's block ids, or, with shared pages,
a state's unit of KV blocks (host rows of ``state_bytes``; a reused unit's blocks are
read in the reuse listener, while the unit stands).

Device order makes the early gather enough: it reads the blocks before any later
write to the (donated) cache, so a device block can be reused as soon as its store is
issued; the host copy and the offloading manager's bookkeeping settle later, without
blocking the loop (:meth:`OffloadConnector.finish_stores`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from jaxkv.core.manager import KVCacheBlocks, KVCacheManager, Request
from jaxkv.errors import JaxkvError, OwnerThread
from jaxkv.ints import is_int
from jaxkv.offload.catalog import (
    STORE_POLICIES,
    OffloadEvent,
    OffloadingManager,
    OffloadKey,
    PolicyOffloadingManager,
)
from jaxkv.offload.host_blocks import HostBlockBackend
from jaxkv.offload.host_buffers import HostKVBuffers, blocks_in_budget, row_format, row_sharding
from jaxkv.offload.peers import PeerTiers
from jaxkv.offload.persistent import BlockInfo, PersistentHostTier
from jaxkv.offload.transfer import FailureHook, Transfer, TransferEngine
from jaxkv.serving.runner import DevicePlace, ModelRunner
from jaxkv.serving.scheduler import ScheduledChunk

_log = logging.getLogger(__name__)

STAGING_SHARE = 4
"""With peers, a host tier in a file gets staging rows for peer hits beyond its size: a
1/STAGING_SHARE of its blocks (at least one, at most one ``max_model_len`` prompt's)."""


class ConnectorError(JaxkvError, ValueError):
    """The connector cannot serve this manager or configuration."""


@dataclass(frozen=True)
class OffloadConfig:
    """A host tier of ``host_bytes`` with an eviction ``policy``, a ``store`` policy (and failure injection).

    For a model with recurrent state in a state pool, ``state_host_bytes`` of it hold
    state checkpoints (None: the device's share of state memory).

    ``path``: the tier survives the process in a file mapping and a journal
    (:mod:`jaxkv.offload.persistent`), reloaded at start; ``model_id`` names the weights
    (a file written for another model, or layout, block size, hash algorithm or seed,
    is never read). Attention-only models, one shard of a block per process.

    ``peers``: a glob naming other processes' tier files (``path`` excluded) whose blocks
    a prefix hit may copy into this tier (:mod:`jaxkv.offload.peers`); needs ``path``.
    """

    host_bytes: int
    policy: str = "lru"
    store: str = "on_eviction"
    memory_kind: str | None = None
    fail_store: FailureHook | None = None
    fail_load: FailureHook | None = None
    state_host_bytes: int | None = None
    path: str | None = None
    model_id: str = ""
    peers: str | None = None

    def __post_init__(self) -> None:
        if not is_int(self.host_bytes) or self.host_bytes <= 0:
            raise ConnectorError(f"host_bytes must be a positive int, got {self.host_bytes!r}")
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if self.host_bytes > physical:
            raise ConnectorError(f"host_bytes={self.host_bytes:,} exceeds this host's {physical:,} bytes of memory")
        if self.state_host_bytes is not None and (
            not is_int(self.state_host_bytes) or not 0 <= self.state_host_bytes <= self.host_bytes
        ):
            raise ConnectorError(
                f"state_host_bytes must be an int in [0, host_bytes={self.host_bytes:,}], got {self.state_host_bytes!r}"
            )
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ConnectorError(f"path must be None or a file path, got {self.path!r}")
        if self.peers is not None and (not isinstance(self.peers, str) or not self.peers or self.path is None):
            raise ConnectorError(f"peers must be None or a glob, with a path of this tier's own; got {self.peers!r}")
        if self.path is not None and self.memory_kind not in (None, "numpy"):
            raise ConnectorError(f"a host tier in a file is a numpy mapping, not memory_kind={self.memory_kind!r}")
        for name in ("fail_store", "fail_load"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise ConnectorError(f"{name} must be None or a callable, got {hook!r}")


@dataclass
class ConnectorStats:
    """Cumulative counters (blocks are (block, group) keys; states count state checkpoints among
    them; queried tokens are those past the device hit that admitted requests asked of the host tier)."""

    num_queried_tokens: int = 0
    num_loaded_tokens: int = 0
    num_loaded_blocks: int = 0
    num_loaded_bytes: int = 0
    num_loaded_states: int = 0
    num_failed_loads: int = 0
    num_stored_blocks: int = 0
    num_failed_stores: int = 0
    num_skipped_stores: int = 0
    num_stored_bytes: int = 0
    num_peer_blocks: int = 0
    num_peer_dropped: int = 0


@dataclass
class _Tier:
    """A catalog, its transfer engine and where its keys sit on host, for one kind of
    device rows: attention blocks, or recurrent state rows (``states``)."""

    offload: OffloadingManager
    transfers: TransferEngine
    states: bool
    host_blocks: dict[OffloadKey, int] = field(default_factory=dict)


@dataclass
class _PendingStore:
    tier: _Tier
    keys: tuple[OffloadKey, ...]
    transfer: Transfer


@dataclass(frozen=True)
class _HostHit:
    """Tokens ``[start, end)`` served by the host tier: the keys to load, group by group."""

    start: int
    end: int
    keys: tuple[OffloadKey, ...]


class OffloadConnector:
    """Moves blocks between one runner's device cache and a host tier, for one manager."""

    def __init__(
        self,
        manager: KVCacheManager,
        runner: ModelRunner,
        offload: OffloadingManager,
        transfers: TransferEngine,
        store: str = "on_eviction",
        *,
        states: tuple[OffloadingManager, TransferEngine] | None = None,
        persistent: PersistentHostTier | None = None,
        peers: PeerTiers | None = None,
        staging_rows: Sequence[int] = (),
    ) -> None:
        if store not in STORE_POLICIES:
            raise ConnectorError(f"unknown store policy {store!r}; valid: {', '.join(STORE_POLICIES)}")
        if not manager.enable_caching:
            raise ConnectorError("the host tier is keyed by block hashes: it needs enable_caching=True")
        recurrent = manager.recurrent_group_ids()
        if recurrent and states is None:
            raise ConnectorError(f"groups {recurrent} hold recurrent state: the host tier needs a state tier")
        self.manager = manager
        self.runner = runner
        self.offload = offload
        self.transfers = transfers
        self.store_policy = store
        self.stats = ConnectorStats()
        self._owner = OwnerThread("OffloadConnector")
        attention = _Tier(offload, transfers, states=False)
        self._tiers = [attention] if states is None else [attention, _Tier(*states, states=True)]
        self._tier_of = [self._tiers[-1] if g in recurrent else attention for g in range(len(manager.block_sizes))]
        self._pending: list[_PendingStore] = []
        self._reused: dict[OffloadKey, DevicePlace] = {}
        self._hash_block_size = manager.hasher.block_size
        self._strides = [bs // self._hash_block_size for bs in manager.block_sizes]
        # Block hash -> (a request's block hashes, its index there): where a reused block
        # sits in its chain. Only hashes the device holds get reused: the oldest entries go
        # beyond four per device block (a device block holds one hash).
        self._chains: OrderedDict[bytes, tuple[list[bytes], int, Sequence[int]]] = OrderedDict()
        self._host_info: dict[OffloadKey, BlockInfo] = {}  # a host key's parent and token ids, where known
        state_rows = manager.state_pool.num_blocks if manager.state_pool is not None else 0
        self._max_chains = 4 * (manager.pool.num_blocks + state_rows)
        self._device_only: OrderedDict[OffloadKey, None] = OrderedDict()
        """Write-through: keys host evicted while the device held them, stored again when their block is reused."""
        self._on_both: OrderedDict[OffloadKey, None] = OrderedDict()
        """Write-through: host keys stored from the device whose device block has not been reused
        since, in host recency order (oldest first): the host evicts these first (:meth:`_on_device`
        checks each)."""
        self.persistent = persistent
        self.peers = peers
        if peers is not None and (persistent is None or not staging_rows):
            raise ConnectorError("a host tier reads its peers' files only with a file of its own and staging rows")
        self._staging_rows = list(staging_rows)
        """Host blocks past the catalog's, where a peer's blocks are copied for one load."""
        self._keeps_block_info = persistent is not None or manager.enable_events
        """Whether a host block's parent and token ids are kept: only its KV events and the journal read them."""
        if persistent is not None:
            if recurrent:
                raise ConnectorError(f"groups {recurrent} hold recurrent state: a host tier in a file holds KV only")
            if not isinstance(offload, PolicyOffloadingManager):
                raise ConnectorError(f"a host tier in a file reloads into a PolicyOffloadingManager, got {offload!r}")
            staging = set(self._staging_rows)
            kept = {k: b for k, b in persistent.entries.items() if b not in staging}
            persistent.removed([k for k in persistent.entries if k not in kept])  # before a staging copy lands there
            offload.restore(kept)
            attention.host_blocks.update(kept)
            self._host_info.update((k, i) for k, i in persistent.infos.items() if k in kept)
        manager.add_reuse_listener(self._on_reuse)  # write-through: what host evicted while the device held it

    @classmethod
    def create(cls, manager: KVCacheManager, runner: ModelRunner, config: OffloadConfig) -> OffloadConnector:
        """A set of host buffers of ``config.host_bytes``, its block backend, catalog and transfer
        engine (and the same for state rows, out of the same bytes, for a recurrent model);
        the catalogs record events (:meth:`take_events`) when the manager does."""
        host_bytes, states = config.host_bytes, None
        if manager.recurrent_group_ids():
            state_bytes = config.state_host_bytes
            if state_bytes is None:
                device_states = runner.state_nbytes()
                state_bytes = host_bytes * device_states // (device_states + runner.kv_cache.nbytes)
            pool = runner.state_host_buffers(state_bytes, memory_kind=config.memory_kind)
            states = cls._tier_parts(pool, config, manager.enable_events)
            host_bytes -= state_bytes
        persistent = None
        if config.path is None:
            host_buffers = runner.host_buffers(host_bytes, memory_kind=config.memory_kind)
        else:
            if states is not None:
                raise ConnectorError(
                    f"groups {manager.recurrent_group_ids()} hold recurrent state: a host tier in a file holds KV only"
                )
            persistent, host_buffers, num_staging = cls._persistent_buffers(manager, runner, config, host_bytes)
        peers, staging = None, range(0)
        if persistent is not None and config.peers is not None:
            peers = PeerTiers(config.peers, persistent.path, persistent.fingerprint, persistent.shape, persistent.dtype)
            staging = range(host_buffers.num_blocks - num_staging + 1, host_buffers.num_blocks + 1)
        offload, transfers = cls._tier_parts(host_buffers, config, manager.enable_events, len(staging))
        try:
            return cls(
                manager,
                runner,
                offload,
                transfers,
                config.store,
                states=states,
                persistent=persistent,
                peers=peers,
                staging_rows=staging,
            )
        except BaseException:
            if persistent is not None:
                persistent.close()
            raise

    @staticmethod
    def _persistent_buffers(
        manager: KVCacheManager, runner: ModelRunner, config: OffloadConfig, host_bytes: int
    ) -> tuple[PersistentHostTier, HostKVBuffers, int]:
        """The files of ``config.path``, host buffers mapped onto them, and how many of their
        last rows are staging rows (with peers: beyond ``host_bytes``, see :data:`STAGING_SHARE`)."""
        assert config.path is not None
        shape, dtype = row_format(runner.kv_cache)
        num_blocks = blocks_in_budget(host_bytes, int(np.prod(shape)) * dtype.itemsize)
        num_staging = 0
        if config.peers is not None:
            prompt = sum(-(-manager.max_model_len // bs) for bs in manager.block_sizes)  # one prompt's blocks
            num_staging = min(max(1, num_blocks // STAGING_SHARE), prompt)
            num_blocks += num_staging
        hasher = manager.hasher
        fingerprint = {
            "format": 1,
            "model": config.model_id,
            "layout": runner.kv_cache.layout,
            "block_sizes": list(manager.block_sizes),
            "hash_algo": hasher.algo,
            "hash_root": hashlib.sha256(hasher.root).hexdigest(),  # the root commits to the seed (never stored)
        }
        persistent = PersistentHostTier(config.path, fingerprint, num_blocks, shape, dtype)
        try:
            buffers = HostKVBuffers(
                num_blocks, shape, dtype, sharding=row_sharding(runner.kv_cache), backing=persistent.rows
            )
        except BaseException:
            persistent.close()
            raise
        return persistent, buffers, num_staging

    @staticmethod
    def _tier_parts(
        pool: HostKVBuffers, config: OffloadConfig, enable_events: bool, num_staging: int = 0
    ) -> tuple[OffloadingManager, TransferEngine]:
        """The catalog of the pool's host blocks but its last ``num_staging`` (staging rows), and its transfers."""
        backend = HostBlockBackend(pool.num_blocks - num_staging)
        offload = PolicyOffloadingManager(backend, config.policy, enable_events=enable_events)
        return offload, TransferEngine(pool, fail_store=config.fail_store, fail_load=config.fail_load)

    def _split(self, keys: Sequence[OffloadKey]) -> list[tuple[_Tier, list[OffloadKey]]]:
        """``keys`` by tier (each tier's in the given order)."""
        return [(tier, [k for k in keys if self._tier_of[k[1]] is tier]) for tier in self._tiers]

    # ------------------------------------------------------------- lookups
    def _host_reach(self, request: Request, start: int) -> int | None:
        """The furthest token a host hit after ``start`` may end at (a multiple of the block
        sizes' lcm before the last token), or None: no hit past ``start`` (or the request
        skips reading the prefix cache)."""
        lcm = self.manager.lcm_block_size
        max_end = (request.num_tokens - 1) // lcm * lcm
        return None if max_end <= start or request.skip_reading_prefix_cache else max_end

    def _host_hit(
        self,
        request: Request,
        hashes: Sequence[Sequence[bytes]],
        start: int,
        staged: dict[OffloadKey, int] | None = None,
    ) -> _HostHit | None:
        """The longest run of tokens after ``start`` whose needed blocks are on host in
        every group (whole multiples of the block sizes' lcm), or None (always for a request
        that skips reading the prefix cache); ``staged`` keys count as held."""
        mgr = self.manager
        lcm = mgr.lcm_block_size
        max_end = self._host_reach(request, start)
        if max_end is None:
            return None
        staged = staged or {}
        ready = []  # per group: prefix counts of ready blocks from start's block on
        for g, bs in enumerate(mgr.block_sizes):
            lo, hi = start // bs, max_end // bs
            offload = self._tier_of[g].offload
            flags = [offload.lookup([(hashes[g][i], g)]) == 1 or (hashes[g][i], g) in staged for i in range(lo, hi)]
            ready.append((lo, np.concatenate([[0], np.cumsum(flags, dtype=np.int64)])))

        def covered(end: int) -> bool:
            for g, (lo, cum) in enumerate(ready):
                r = mgr.needed_blocks(g, start, end)
                if cum[r.stop - lo] - cum[r.start - lo] != len(r):
                    return False
            return True

        end = next((end for end in range(max_end, start, -lcm) if covered(end)), start)
        if end == start:
            return None
        keys = tuple((hashes[g][i], g) for g in range(len(hashes)) for i in mgr.needed_blocks(g, start, end))
        return _HostHit(start, end, keys)

    def _stage_from_peers(
        self, request: Request, hashes: Sequence[Sequence[bytes]], start: int
    ) -> dict[OffloadKey, int]:
        """Copy into the staging rows the blocks after ``start`` that the tier lacks and a peer
        holds, up to the first one no tier holds in each group (as many as there are staging
        rows); the keys staged and their rows. A copy that fails, or that the peer may have
        overwritten while it was read, is not staged (a miss)."""
        assert self.peers is not None
        mgr, tier = self.manager, self._tiers[0]
        max_end = self._host_reach(request, start)
        if max_end is None:
            return {}
        wanted: list[OffloadKey] = []
        refreshed = False
        for g, bs in enumerate(mgr.block_sizes):
            for i in range(start // bs, max_end // bs):
                key: OffloadKey = (hashes[g][i], g)
                if tier.offload.lookup([key]) == 1:
                    continue
                if not refreshed:
                    self.peers.refresh()
                    refreshed = True
                if not self.peers.holds(key):
                    break
                wanted.append(key)
        wanted = wanted[: len(self._staging_rows)]
        if not wanted:
            return {}
        copies = self.peers.read(wanted)
        staged = {k: c[0] for k, c in zip(wanted, copies, strict=True) if c is not None}
        self.stats.num_peer_blocks += len(staged)
        self.stats.num_peer_dropped += len(wanted) - len(staged)
        if not staged:
            return {}
        rows = self._staging_rows[: len(staged)]
        buffers = tier.transfers.buffers
        buffers.bump(rows)  # an older load's rows were read at its issue
        buffers.commit(np.asarray(rows, np.int64), np.stack(list(staged.values())))
        return dict(zip(staged, rows, strict=True))

    def _touch_prefix(self, request: Request, hashes: Sequence[Sequence[bytes]]) -> None:
        """Refresh the host recency of every full block of the request's prompt."""
        keys: list[OffloadKey] = []
        for g, bs in enumerate(self.manager.block_sizes):
            keys.extend((h, g) for h in hashes[g][: request.num_prompt_tokens // bs])
        for tier, tier_keys in self._split(keys):
            tier.offload.touch(tier_keys)
        if self._on_both:
            on_both = self._on_both
            for key in keys:
                if key in on_both:
                    on_both.move_to_end(key)

    # ----------------------------------------------------------- admission
    def allocate_admitted(self, request: Request, hit: KVCacheBlocks, num_hit: int, budget: int) -> int | None:
        """Allocate a waiting request after its device hit; its computed tokens, or None if it does not fit.

        Extends the hit from the host tier when it can (loading the blocks now); the
        request then has slots for ``min(num_tokens - computed, budget)`` new tokens.
        An exception leaves the request holding nothing.
        """
        self._owner.check()
        mgr = self.manager
        hashes = mgr.hashes_per_group(request)
        staged = {} if self.peers is None else self._stage_from_peers(request, hashes, num_hit)
        host = self._host_hit(request, hashes, num_hit, staged)
        if host is not None:
            pinned = []  # pinned: nothing below can evict them
            try:
                host_blocks: dict[OffloadKey, int] = {}
                for tier, keys in self._split(host.keys):
                    own = [k for k in keys if k not in staged]
                    host_blocks.update(zip(own, tier.offload.prepare_load(own), strict=True))
                    host_blocks.update((k, staged[k]) for k in keys if k in staged)
                    pinned.append((tier, own))
                num_ext = host.end - host.start
                n = mgr.chunk_limit(request, host.end, min(request.num_tokens - host.end, budget))
                if n and mgr.allocate_slots(request, n, num_hit, hit, num_external_computed_tokens=num_ext) is not None:
                    if self._load(request, host, host_blocks):
                        self._admitted(request, hashes, num_hit)
                        return host.end
                    hit, num_hit = mgr.get_computed_blocks(request)  # the allocation may have evicted the first hit
            finally:
                for tier, keys in pinned:
                    tier.offload.complete_load(keys)
        n = mgr.chunk_limit(request, num_hit, min(request.num_tokens - num_hit, budget))
        if not n or mgr.allocate_slots(request, n, num_hit, hit) is None:  # 0: no chunk may end in the budget
            return None
        self._admitted(request, hashes, num_hit)
        return num_hit

    def _admitted(self, request: Request, hashes: Sequence[Sequence[bytes]], num_hit: int) -> None:
        """Bookkeeping of an admission: host recency of its prefix, its chain, the stats."""
        self._touch_prefix(request, hashes)
        self._remember_chain(request, 0, len(request.block_hashes))
        self.stats.num_queried_tokens += request.num_tokens - num_hit

    def _load(self, request: Request, host: _HostHit, host_blocks: dict[OffloadKey, int]) -> bool:
        """Load the host hit into the request's fresh blocks (a state checkpoint into its
        running slot, which its step reads); on failure (or any exception) uncache and
        free everything past the device hit."""
        try:
            self._store_reused()  # the fresh blocks may be reused ones: read them before the load
            table = self.manager.get_block_ids(request.request_id)
            device: dict[OffloadKey, DevicePlace] = {}
            for g, blocks in enumerate(table):
                for i in self.manager.needed_blocks(g, host.start, host.end):
                    device[host.keys[len(device)]] = self._place(
                        g, blocks[-1] if self._tier_of[g].states else blocks[i]
                    )
            failed = False
            for tier, keys in self._split(host.keys):
                if keys:
                    places, hosts = [device[k] for k in keys], [host_blocks[k] for k in keys]
                    if tier.states:
                        transfer = self.runner.load_states(tier.transfers, places, hosts)
                    else:
                        transfer = self.runner.load_blocks(tier.transfers, cast(list[int], places), hosts)
                    result = tier.transfers.poll(transfer)
                    assert result is not None  # a load's result is known at issue
                    failed |= bool(result.failed)
        except BaseException:
            self._drop(request, host.start)
            raise
        if failed:
            self.stats.num_failed_loads += 1
            _log.warning("host tier load for request %r failed; recomputing its tokens", request.request_id)
            self._drop(request, host.start)
            return False
        self.stats.num_loaded_tokens += host.end - host.start
        self.stats.num_loaded_blocks += len(host.keys)
        self.stats.num_loaded_bytes += sum(self._tier_of[g].transfers.buffers.block_bytes for _, g in host.keys)
        self.stats.num_loaded_states += sum(self._tier_of[g].states for _, g in host.keys)
        return True

    def _drop(self, request: Request, start: int) -> None:
        """Uncache the request's blocks from token ``start`` on (registered before their
        KV arrived) and free the request."""
        mgr = self.manager
        table = mgr.get_block_ids(request.request_id)
        for g, blocks in enumerate(table):
            mgr.evict_group_blocks(g, [b for b in blocks[start // mgr.block_sizes[g] :] if b])
        mgr.free(request)

    # -------------------------------------------------------------- stores
    def _place(self, group: int, block_id: int) -> DevicePlace:
        """Where a group's block is on device for a transfer: the block (or state row) itself,
        or all blocks of a state's unit with shared pages (read while the unit stands)."""
        return self.runner.state_places([block_id])[0] if self._tier_of[group].states else block_id

    def _on_reuse(self, block_id: int, block_hash: bytes, group: int) -> None:
        key = (block_hash, group)
        if self.store_policy == "write_through":
            self._on_both.pop(key, None)
            if key in self._device_only:
                del self._device_only[key]
                self._reused.setdefault(key, self._place(group, block_id))
            return
        if key not in self._reused:  # the first block holds computed KV
            self._reused[key] = self._place(group, block_id)
            self._store_hit_ending_at(block_hash, group)

    def _remember_chain(self, request: Request, lo: int, hi: int) -> None:
        """Record where the request's hash blocks ``lo..hi-1`` sit in its chain, and its tokens
        (for on-eviction stores, and for host blocks' parents and token ids where they are kept)."""
        if self.store_policy != "on_eviction" and not self._keeps_block_info:
            return
        hashes, chains, tokens = request.block_hashes, self._chains, request.all_token_ids
        for i in range(lo, min(hi, len(hashes))):
            chains[hashes[i]] = (hashes, i, tokens)
            chains.move_to_end(hashes[i])
        while len(chains) > self._max_chains:
            chains.popitem(last=False)

    def _store_hit_ending_at(self, block_hash: bytes, group: int) -> None:
        """Add to the reused blocks what a host hit ending with ``group``'s reused block of
        ``block_hash`` needs in every group and host lacks (see the module doc): nothing when
        its chain is unknown, or when a needed block is neither on host nor written on device."""
        reused = (block_hash, group)
        chain = self._chains.get(block_hash)
        if chain is None:
            return
        hashes, index, _ = chain
        mgr, lcm = self.manager, self.manager.lcm_block_size
        end = (index + 1) * self._hash_block_size // lcm * lcm
        found: dict[OffloadKey, DevicePlace] = {}
        for g, stride in enumerate(self._strides):
            held = self._tier_of[g].host_blocks
            for i in reversed(mgr.needed_blocks(g, 0, end)):
                key = (hashes[(i + 1) * stride - 1], g)
                if key == reused:
                    continue
                if key in held or key in self._reused:
                    break  # stored with its prefix before
                block_id = mgr.written_block(g, key[0])
                if block_id is None:
                    return  # no hit can end here
                found[key] = self._place(g, block_id)
        self._reused.update(found)

    def before_step(self) -> None:
        """Store the blocks the schedule took back from the prefix cache (call before the step)."""
        self._owner.check()
        self._store_reused()

    def after_step(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Write-through: store the full blocks the step's chunks completed whose tokens are
        known (on eviction: note where they sit in their chains); settle done stores. With
        asynchronous scheduling it is called twice per step: once dispatched (what its known
        tokens complete, before a later step can reuse a checkpoint) and once its drawn
        tokens are read back (the blocks they complete)."""
        self._owner.check()
        for chunk in chunks:
            request = chunk.seq.request
            self.manager.hash_request(request)
            start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens
            self._remember_chain(request, start // self._hash_block_size, end // self._hash_block_size)
        if self.store_policy == "write_through":
            block_of: dict[OffloadKey, DevicePlace] = {}
            for chunk in chunks:
                hashes = self.manager.hashes_per_group(chunk.seq.request)
                start, end = chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_new_tokens
                for g, (blocks, bs) in enumerate(zip(chunk.block_ids, self.manager.block_sizes, strict=True)):
                    states = self._tier_of[g].states  # a state row holds a checkpoint only once cached
                    for i in range(start // bs, min(end // bs, len(hashes[g]))):  # hashed: tokens known
                        if blocks[i] and (not states or self.manager.is_cached_as(g, blocks[i], hashes[g][i])):
                            block_of.setdefault((hashes[g][i], g), self._place(g, blocks[i]))
            self._store(block_of)
        self.finish_stores(wait=False)

    def discard_reused(self) -> None:
        """Forget the reused blocks not stored yet (their device data was lost)."""
        self._reused = {}
        self._device_only.clear()
        self._on_both.clear()

    def _store_reused(self) -> None:
        block_of, self._reused = self._reused, {}
        self._store(block_of)

    def _store(self, block_of: dict[OffloadKey, DevicePlace]) -> None:
        """Issue one store per tier of device rows ``block_of[key]`` for the keys host lacks."""
        for tier, keys in self._split(list(block_of)):
            if keys:
                self._store_tier(tier, keys, block_of)

    def _store_tier(self, tier: _Tier, keys: list[OffloadKey], block_of: dict[OffloadKey, DevicePlace]) -> None:
        through = self.store_policy == "write_through" and not tier.states
        plan = tier.offload.prepare_store(keys, (k for k in self._on_both if self._on_device(k)) if through else ())
        if plan is None:
            self.stats.num_skipped_stores += len(keys)
            return
        self._evicted(tier, plan.evicted)
        if not plan.keys_to_store:
            return
        tier.host_blocks.update(zip(plan.keys_to_store, plan.where, strict=True))
        if through:
            self._on_both.update((k, None) for k in plan.keys_to_store)
        if not tier.states and self._keeps_block_info:
            for key in plan.keys_to_store:
                info = self._block_info(key)
                if info is not None:
                    self._host_info[key] = info
        places = [block_of[k] for k in plan.keys_to_store]
        try:
            if tier.states:
                transfer = self.runner.store_states(tier.transfers, places, plan.where)
            else:
                transfer = self.runner.store_blocks(tier.transfers, cast(list[int], places), plan.where)
        except BaseException:
            self._settle(tier, plan.keys_to_store, (), plan.keys_to_store)
            raise
        self._pending.append(_PendingStore(tier, plan.keys_to_store, transfer))

    def _on_device(self, key: OffloadKey) -> bool:
        """Whether the device holds the key's KV written: a write-through host tier evicts such
        keys first, and stores them again when the pool reuses their block (:meth:`_on_reuse`)."""
        block_hash, group = key
        return isinstance(block_hash, bytes) and self.manager.written_block(group, block_hash) is not None

    def _evicted(self, tier: _Tier, keys: Sequence[OffloadKey]) -> None:
        """Free the host blocks of keys a store plan evicted (journaled as removed first)."""
        if keys:
            if self.store_policy == "write_through" and not tier.states:
                self._device_only.update(
                    (k, None) for k in keys if self._on_both.pop(k, 1) is None and self._on_device(k)
                )
                while len(self._device_only) > self._max_chains:
                    self._device_only.popitem(last=False)
            if self.persistent is not None and not tier.states:
                self.persistent.removed(keys)  # before their host blocks are written again
            tier.transfers.release([tier.host_blocks.pop(k) for k in keys])
            for key in keys:
                self._host_info.pop(key, None)

    def finish_stores(self, wait: bool = True) -> None:
        """Settle issued stores: all of them (``wait``), or those already done."""
        pending = []
        for p in self._pending:
            result = p.tier.transfers.wait(p.transfer) if wait else p.tier.transfers.poll(p.transfer)
            if result is None:
                pending.append(p)
                continue
            self._settle(p.tier, p.keys, [p.keys[i] for i in result.ok], [p.keys[i] for i in result.failed])
        self._pending = pending

    def _settle(
        self, tier: _Tier, keys: Sequence[OffloadKey], ok: Sequence[OffloadKey], failed: Sequence[OffloadKey]
    ) -> None:
        """Mark a store's keys ready or drop them (freeing their host blocks)."""
        if ok:
            tier.offload.complete_store(ok, success=True)
            if self.persistent is not None and not tier.states:  # their bytes are in the mapping now
                self.persistent.stored(ok, [tier.host_blocks[k] for k in ok], [self._host_info.get(k) for k in ok])
                if self.persistent.wants_compaction:
                    ready = {k: b for k, b in tier.host_blocks.items() if tier.offload.lookup([k]) == 1}
                    self.persistent.compact(ready, {k: self._host_info[k] for k in ready if k in self._host_info})
        self._unstore(tier, failed)
        self.stats.num_stored_blocks += len(ok)
        self.stats.num_stored_bytes += len(ok) * tier.transfers.buffers.block_bytes
        self.stats.num_failed_stores += len(failed)
        if failed:
            _log.warning("%d host-tier store(s) failed; those blocks are not kept on host", len(failed))

    def _unstore(self, tier: _Tier, keys: Sequence[OffloadKey]) -> None:
        """Drop keys still being stored and free their host blocks."""
        if keys:
            tier.offload.complete_store(keys, success=False)
            tier.transfers.release([tier.host_blocks.pop(k) for k in keys])
            for key in keys:
                self._host_info.pop(key, None)
                self._on_both.pop(key, None)

    def take_events(self) -> list[OffloadEvent]:
        """Host-tier events (keys stored, keys removed) of every catalog since the last call."""
        self._owner.check()
        return [e for tier in self._tiers for e in tier.offload.take_events()]

    def _block_info(self, key: OffloadKey) -> BlockInfo | None:
        """A device block's parent hash and token ids, from the chain its request computed (None: unknown)."""
        block_hash, group = key
        chain = self._chains.get(block_hash) if isinstance(block_hash, bytes) else None
        if chain is None:
            return None
        hashes, index, tokens = chain
        stride, size = self._strides[group], self._hash_block_size
        parent = hashes[index - stride] if index >= stride else None
        return parent, tuple(tokens[(index + 1 - stride) * size : (index + 1) * size])

    def host_block_info(self, key: OffloadKey) -> BlockInfo | None:
        """An attention block's parent hash and token ids while it is on host, where known: what
        its host-tier KV event carries (a router indexes blocks by their tokens)."""
        return self._host_info.get(key)

    @property
    def num_host_blocks(self) -> int:
        """Host blocks of attention KV the tier keeps (vLLM's ``num_cpu_blocks``; staging rows excluded)."""
        return self._tiers[0].transfers.buffers.num_blocks - len(self._staging_rows)

    @property
    def num_held_host_blocks(self) -> int:
        """Host blocks of attention KV holding a key now (stored, being stored or pinned)."""
        return self._tiers[0].offload.num_allocated_places()

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the tier's blocks take (attention blocks and state rows)."""
        return sum(t.transfers.buffers.num_blocks * t.transfers.buffers.block_bytes for t in self._tiers)

    def close(self) -> None:
        """Settle the stores and release a host tier's files (nothing to do without a path)."""
        self._owner.check()
        self.finish_stores()
        if self.persistent is not None:
            self.persistent.close()

    # ---------------------------------------------------------------- audit
    def num_leaked_host_blocks(self) -> int:
        """Host blocks not accounted for once every store has settled: allocated but
        held by no key, or keys still pinned or storing with nothing in flight."""
        self.finish_stores()
        leaked = 0
        for tier in self._tiers:
            states = tier.offload.num_keys_by_state()
            stuck = states.get("pinned", 0) + states.get("storing", 0)
            leaked += abs(tier.offload.num_allocated_places() - len(tier.host_blocks)) + stuck
        return leaked
