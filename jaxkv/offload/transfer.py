"""Block transfers between the device KV cache (or the recurrent state rows) and the host buffers.

Store: one jitted gather of the blocks (:func:`jaxkv.device.ops.gather_blocks`, the cache is
read, not donated) into one contiguous staging array, then asynchronous device->host
DMAs of its rows into the host blocks (:meth:`~jaxkv.offload.host_buffers.HostKVBuffers.write`).
Load: host->device DMAs of the host blocks' rows, then one jitted scatter into the
donated cache. With the cross-layer layout a block is one contiguous region (one copy); with
the per-layer layout it is one region per layer buffer. A
:class:`~jaxkv.device.state_cache.StateCache` moves the same way, one state row per host
block (its rows as bytes: :func:`~jaxkv.device.state_cache.gather_rows`).

Block counts are padded to powers of two with the null block 0 and the scratch host
host block 0, so a handful of shapes compile once. Every transfer records the generations
of its host blocks: one that completes after its host block was released or rewritten is
reported failed (and, on the numpy path, never lands). Injected failures are reported
the same way: a failed store leaves its host blocks unwritten, a failed load leaves its
device blocks untouched, and the caller recomputes them.

A load's outcome is known when it is issued (:meth:`TransferEngine.poll`), so nobody has
to wait for its data: the rows it reads are fixed at issue (the pinned_host read is
ordered before every later write of the buffer; the numpy rows are copied at once), and
its only failures are the injected ones, decided before anything is issued. The step
that reads the loaded blocks takes the cache the load's scatter returns, so the device
runs it after the scatter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.core.pool import NULL_BLOCK
from jaxkv.device import ops
from jaxkv.device.cache import KVCache
from jaxkv.device.state_cache import StateCache, gather_rows, scatter_rows
from jaxkv.device.state_pages import StateUnits, gather_units, scatter_units
from jaxkv.errors import JaxkvError, OwnerThread
from jaxkv.ints import check_int
from jaxkv.offload.host_blocks import SCRATCH_HOST_BLOCK
from jaxkv.offload.host_buffers import HostBuffersError, HostKVBuffers, array_is_ready, row_format

DeviceCache = KVCache | StateCache | StateUnits
"""What a transfer engine moves rows of: KV blocks, state rows, or states in KV pages."""

FailureHook = Callable[[np.ndarray, np.ndarray], np.ndarray]
"""``(device_block_ids, host_blocks) -> bool mask`` of the rows to fail (injection)."""


class TransferError(JaxkvError, ValueError):
    """A transfer request the engine cannot issue; nothing was issued."""


def bucket_size(n: int) -> int:
    """The padded row count for ``n`` rows: the next power of two (at least 1)."""
    return 1 << max(n - 1, 0).bit_length()


def copies_per_block(cache: KVCache) -> int:
    """Contiguous device regions one block occupies: 1 cross-layer, one per layer buffer."""
    return 1 if cache.layout == "cross_layer" else cache.num_layers_per_block


@dataclass
class Transfer:
    """One in-flight store or load; rows are in the caller's order. A load's ``result``
    is set when it is issued; a store's once it is settled."""

    kind: str
    host_blocks: np.ndarray
    generations: np.ndarray | None
    """A store's generations of its host blocks at issue (a load needs none)."""
    injected: np.ndarray
    staged: jax.Array | None
    result: TransferResult | None = None

    def __len__(self) -> int:
        return len(self.host_blocks)


@dataclass(frozen=True)
class TransferResult:
    """Row indices (into the issued lists) that completed, and those that failed."""

    ok: tuple[int, ...]
    failed: tuple[int, ...]


def _pad(values: np.ndarray, size: int, fill: int) -> np.ndarray:
    """``values`` padded to ``size`` rows of ``fill`` (rows: ints, or a unit's blocks)."""
    out = np.full((size, *values.shape[1:]), fill, np.int32)
    out[: len(values)] = values
    return out


class TransferEngine:
    """Issues stores and loads between one device cache (KV blocks or state rows) and one set of host buffers."""

    def __init__(
        self,
        buffers: HostKVBuffers,
        *,
        fail_store: FailureHook | None = None,
        fail_load: FailureHook | None = None,
    ) -> None:
        self.buffers = buffers
        self.fail_store = fail_store
        self.fail_load = fail_load
        self.num_traces = 0
        self._owner = OwnerThread("TransferEngine")
        self._gather = jax.jit(self._gather_fn, out_shardings=buffers.sharding)
        self._scatters: dict[object, jax.stages.Wrapped] = {}

    def _gather_fn(self, cache: DeviceCache, ids: jax.Array) -> jax.Array:
        self.num_traces += 1
        if isinstance(cache, StateUnits):
            return gather_units(cache, ids)
        return gather_rows(cache, ids) if isinstance(cache, StateCache) else ops.gather_blocks(cache, ids)

    def _scatter_fn(self, cache: DeviceCache, ids: jax.Array, data: jax.Array) -> DeviceCache:
        self.num_traces += 1
        if isinstance(cache, StateUnits):
            return scatter_units(cache, ids, data)
        if isinstance(cache, StateCache):
            return scatter_rows(cache, ids, data)
        return ops.scatter_blocks(cache, ids, data)

    def _scatter(self, cache: DeviceCache, ids: jax.Array, data: jax.Array) -> DeviceCache:
        """The jitted scatter, its output sharded as ``cache`` is (a tensor-parallel step
        takes the cache with exactly the shardings it was compiled for)."""
        shardings = jax.tree.map(lambda buffer: buffer.sharding, cache)
        leaves, treedef = jax.tree.flatten(shardings)
        key = (tuple(leaves), treedef)
        if key not in self._scatters:
            self._scatters[key] = jax.jit(self._scatter_fn, donate_argnums=0, out_shardings=shardings)
        return self._scatters[key](cache, ids, data)

    # -------------------------------------------------------------- checks
    def _check(
        self, cache: DeviceCache, block_ids: Sequence[int | Sequence[int]], host_blocks: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        self._owner.check()
        shape, dtype = row_format(cache)
        if shape != self.buffers.block_shape or dtype != self.buffers.dtype:
            raise TransferError(
                f"cache blocks {shape} {dtype} do not match the host buffers' "
                f"{self.buffers.block_shape} {self.buffers.dtype}"
            )
        width = cache.pages.pages_per_state if isinstance(cache, StateUnits) else None
        ids = np.asarray(block_ids, np.int64).reshape(-1) if width is None else np.asarray(block_ids, np.int64)
        if width is not None and (ids.ndim != 2 or ids.shape[1] != width) and ids.size:
            raise TransferError(f"a state in KV pages is addressed by its unit's {width} blocks, got {block_ids!r}")
        ids = ids.reshape(-1) if width is None else ids.reshape(-1, width)
        hosts = np.asarray(host_blocks, np.int64).reshape(-1)
        if len(ids) != len(hosts):
            raise TransferError(f"{len(ids)} block ids but {len(hosts)} host blocks")
        num_rows = cache.num_rows if isinstance(cache, StateCache) else cache.num_blocks
        bad = ids[(ids <= NULL_BLOCK) | (ids >= num_rows)]
        if bad.size:
            raise TransferError(f"device block ids out of range [1, {num_rows}): {bad.tolist()}")
        try:
            self.buffers.check_host_blocks(hosts.tolist())
        except HostBuffersError as err:
            raise TransferError(str(err)) from None
        if (hosts == SCRATCH_HOST_BLOCK).any():
            raise TransferError(f"host block {SCRATCH_HOST_BLOCK} is the scratch host block: {hosts.tolist()}")
        if len(set(hosts.tolist())) != len(hosts):
            raise TransferError(f"host blocks repeat: {hosts.tolist()}")
        return ids, hosts

    @staticmethod
    def _injected(hook: FailureHook | None, ids: np.ndarray, host_blocks: np.ndarray) -> np.ndarray:
        """The hook's mask; it sees one id per row (a unit's head block for states in KV pages)."""
        if hook is None or not len(ids):
            return np.zeros(len(ids), bool)
        return np.asarray(hook(ids.reshape(len(ids), -1)[:, 0], host_blocks), bool).reshape(len(ids))

    def warm_up(self, cache: DeviceCache, max_blocks: int) -> DeviceCache:
        """Compile every bucket up to ``max_blocks`` rows now, not during serving; returns the cache.

        Each bucket moves the null block through the scratch host block and back: only
        those two, which hold nothing anyone reads, are written.
        """
        check_int("max_blocks", max_blocks, minimum=1, error=TransferError)
        size = 1
        while True:
            ids = jnp.zeros((size, cache.pages.pages_per_state) if isinstance(cache, StateUnits) else size, jnp.int32)
            staged = self._gather(cache, ids)
            if self.buffers.memory_kind == "pinned_host":
                self.buffers.write(np.zeros(size, np.int32), staged)
            staged = self.buffers.read(np.zeros(size, np.int32))
            cache = self._scatter(cache, ids, staged)
            if size >= max_blocks:
                return cache
            size *= 2

    # ------------------------------------------------------------ transfers
    def store(
        self, cache: DeviceCache, block_ids: Sequence[int | Sequence[int]], host_blocks: Sequence[int]
    ) -> Transfer:
        """Copy device blocks ``block_ids[i]`` into host blocks ``host_blocks[i]``.

        The cache is only read. Reuse a source device block only once
        :meth:`is_done` (or :meth:`wait`) says so.
        """
        ids, hosts = self._check(cache, block_ids, host_blocks)
        injected = self._injected(self.fail_store, ids, hosts)
        targets = np.where(injected, SCRATCH_HOST_BLOCK, hosts)
        generations = self.buffers.bump(targets)
        size = bucket_size(len(ids))
        staged = None
        if len(ids):
            staged = self._gather(cache, jnp.asarray(_pad(ids, size, NULL_BLOCK)))
            if self.buffers.memory_kind == "pinned_host":
                self.buffers.write(_pad(targets, size, SCRATCH_HOST_BLOCK), staged)
                staged = None
            else:
                staged.copy_to_host_async()
        return Transfer("store", targets, generations, injected, staged)

    def load(
        self, cache: DeviceCache, block_ids: Sequence[int | Sequence[int]], host_blocks: Sequence[int]
    ) -> tuple[DeviceCache, Transfer]:
        """Copy host blocks ``host_blocks[i]`` into device blocks ``block_ids[i]``.

        The cache is donated; use the returned one. Rows that fail (injected) are not
        written: their device blocks keep what they held, and the caller recomputes.
        The result is known at once (:meth:`poll`): a caller need not wait for the data
        before dispatching the step that reads it.
        """
        ids, hosts = self._check(cache, block_ids, host_blocks)
        injected = self._injected(self.fail_load, ids, hosts)
        ids = np.where(injected.reshape(-1, *(1,) * (ids.ndim - 1)), NULL_BLOCK, ids)
        hosts = np.where(injected, SCRATCH_HOST_BLOCK, hosts)
        staged = None
        if len(ids):
            size = bucket_size(len(ids))
            staged = self.buffers.read(_pad(hosts, size, SCRATCH_HOST_BLOCK))
            cache = self._scatter(cache, jnp.asarray(_pad(ids, size, NULL_BLOCK)), staged)
        transfer = Transfer("load", hosts, None, injected, staged)
        transfer.result = _result(~injected)
        return cache, transfer

    def release(self, host_blocks: Sequence[int]) -> None:
        """The caller freed these host blocks: a transfer still in flight into them is stale."""
        self._owner.check()
        self.buffers.release(host_blocks)

    def is_done(self, transfer: Transfer) -> bool:
        """Whether the transfer's data arrived (for a store: left its source, so a stored
        device block may be reused)."""
        if transfer.staged is not None:
            return array_is_ready(transfer.staged)
        return transfer.result is not None or not len(transfer) or self.buffers.is_ready()

    def poll(self, transfer: Transfer) -> TransferResult | None:
        """Which rows succeeded, without blocking: a load's from its issue on, a store's
        once it is done; None while a store is in flight."""
        if transfer.result is None and self.is_done(transfer):
            return self.wait(transfer)
        return transfer.result

    def wait(self, transfer: Transfer) -> TransferResult:
        """Block until the transfer's data arrived; which rows succeeded (idempotent)."""
        if transfer.staged is not None:
            transfer.staged.block_until_ready()
        elif transfer.result is None and len(transfer):
            self.buffers.block_until_ready()
        if transfer.result is None:
            ok = ~transfer.injected
            if len(transfer):
                assert transfer.generations is not None  # a store: a load's result is set at issue
                ok &= self.buffers.current(transfer.host_blocks, transfer.generations)
                if transfer.staged is not None:  # a numpy store: its rows land now
                    self.buffers.commit(transfer.host_blocks[ok], transfer.staged, np.flatnonzero(ok))
            transfer.result = _result(ok)
        transfer.staged = None
        return transfer.result


def _result(ok: np.ndarray) -> TransferResult:
    rows = np.arange(len(ok))
    return TransferResult(tuple(rows[ok].tolist()), tuple(rows[~ok].tolist()))
