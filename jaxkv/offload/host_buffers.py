"""Host memory of the offload tier: the buffer that holds the bytes of host blocks.

One host block holds one whole cross-layer block ``(num_layers_per_block, block_size,
2*H, D)``, the staging format of :func:`jaxkv.device.ops.gather_blocks` in either device
layout; a set of host buffers of recurrent states holds one state row per host block, as bytes
(:func:`jaxkv.device.state_cache.gather_rows`). Host block 0 is a scratch block: padded
rows of bucketed transfers read and write it, it is never handed out (the allocator is
:mod:`jaxkv.offload.host_blocks`).
The buffer lives in ``pinned_host`` memory when the backend supports the writes and
reads the transfer engine compiles (probed once per backend), else in a numpy array.
Rows move in and out of the ``pinned_host`` buffer by DMA only: one dynamic-update-slice
(store) or dynamic-slice (load) per row, never a gather or scatter over host memory
(:func:`pinned_ops`).

On a mesh (a tensor-parallel cache, its KV heads split over devices) the pool keeps one
host buffer per distinct shard of a block (:func:`row_sharding`): a store copies each
device's shard of the staged rows into its own buffer, a load reads each buffer back to
the devices holding that shard and assembles the global rows from them. Nothing is
gathered to one device, and a process only holds the shards of its own devices (so a
mesh spanning processes works the same). A replicated cache (recurrent states) has one
distinct shard: one host copy, loaded to every device. One ``pinned_host`` buffer sharded
like the rows would need no assembly, but its row writes read back wrong on the CPU
backend of jax 0.10.2, so each shard gets a single-device buffer.

Each host block has a generation counter, bumped by every store issued into it and by
:meth:`HostKVBuffers.release`; a transfer records the generations it was issued with, so
one that completes after its host block was reused is recognised as stale.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding
from jax.typing import DTypeLike

from jaxkv.device.cache import KVCache
from jaxkv.device.state_cache import StateCache, row_nbytes
from jaxkv.device.state_pages import StateUnits
from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int
from jaxkv.offload.host_blocks import SCRATCH_HOST_BLOCK

MEMORY_KINDS = ("pinned_host", "numpy")


class HostBuffersError(JaxkvError, ValueError):
    """A host block, count or budget the host tier cannot act on; nothing was changed."""


def blocks_in_budget(byte_budget: int, block_bytes: int) -> int:
    """How many whole blocks of ``block_bytes`` fit in ``byte_budget`` (at least one)."""
    if block_bytes < 1 or byte_budget < block_bytes:
        raise HostBuffersError(f"byte_budget {byte_budget!r} holds no block of {block_bytes!r} bytes")
    return byte_budget // block_bytes


def block_shape(cache: KVCache) -> tuple[int, ...]:
    """Shape of one whole block in the staging format, for either layout."""
    return (cache.num_layers_per_block, cache.block_size, 2 * cache.num_kv_heads, cache.head_dim)


def row_format(cache: KVCache | StateCache | StateUnits) -> tuple[tuple[int, ...], jnp.dtype]:
    """Shape and dtype of one host block of ``cache``: a whole KV block, or a state's bytes
    (a state row's, or a state kept in KV pages)."""
    if isinstance(cache, StateCache):
        return (row_nbytes(cache),), jnp.dtype(jnp.uint8)
    if isinstance(cache, StateUnits):
        return (cache.pages.state_bytes,), jnp.dtype(jnp.uint8)
    return block_shape(cache), cache.dtype


def block_nbytes(cache: KVCache) -> int:
    """Bytes of one whole block (all its layers)."""
    return int(np.prod(block_shape(cache))) * cache.dtype.itemsize


def row_sharding(cache: KVCache | StateCache | StateUnits) -> Sharding:
    """How staged rows of ``cache`` ``(n, *row shape)`` are split: a KV block's head axis as
    the cache's is, state rows replicated over the cache's mesh; a cache on one device
    stages on that device."""
    buffer = jax.tree.leaves(cache)[0]
    sharding = buffer.sharding
    if not isinstance(sharding, NamedSharding):
        return SingleDeviceSharding(next(iter(buffer.devices())))
    if isinstance(cache, (StateCache, StateUnits)):
        return NamedSharding(sharding.mesh, PartitionSpec())
    spec = tuple(sharding.spec) + (None,) * (buffer.ndim - len(sharding.spec))
    ndim = 1 + len(block_shape(cache))
    return NamedSharding(sharding.mesh, PartitionSpec(*([None] * (ndim - 2)), spec[-2], None))


def _host_sharding(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _device_sharding(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device)


def _host_row_starts(buf: jax.Array, host_block: jax.Array) -> tuple[jax.Array | int, ...]:
    return (host_block,) + (0,) * (buf.ndim - 1)


def _write_rows(buf: jax.Array, host_blocks: jax.Array, rows: jax.Array) -> jax.Array:
    """``buf[host_blocks[i]] = rows[i]``, one dynamic-update-slice per row of a device row moved to host.

    XLA's host offloader turns a dynamic-update-slice of a host buffer whose update is
    moved to host into a device->host DMA into that row; nothing is computed in host
    memory. Rows are written in order (padding rows all land in the scratch host block).
    """
    for i in range(rows.shape[0]):
        row = jax.device_put(rows[i : i + 1].astype(buf.dtype), jax.memory.Space.Host)
        buf = lax.dynamic_update_slice(buf, row, _host_row_starts(buf, host_blocks[i]))
    return buf


def _read_rows(buf: jax.Array, host_blocks: jax.Array) -> jax.Array:
    """``buf[host_blocks]`` on the device: one dynamic-slice per row, each moved to the device
    (a host->device DMA), joined on the device."""
    row_shape = (1, *buf.shape[1:])
    rows = [
        jax.device_put(
            lax.dynamic_slice(buf, _host_row_starts(buf, host_blocks[i]), row_shape), jax.memory.Space.Device
        )
        for i in range(host_blocks.shape[0])
    ]
    return jnp.concatenate(rows)


ROWS_PER_CALL = 64
"""Most rows one jitted pinned_host write or read moves: each row is an op of its own
(unrolled, so compile time grows with the row count); larger transfers take several
calls, which dispatch asynchronously one after the other."""


def _row_parts(num_rows: int) -> list[slice]:
    """Consecutive slices of at most :data:`ROWS_PER_CALL` rows covering ``num_rows``."""
    return [slice(start, min(start + ROWS_PER_CALL, num_rows)) for start in range(0, num_rows, ROWS_PER_CALL)]


@functools.cache
def pinned_ops(device: jax.Device) -> tuple[jax.stages.Wrapped, jax.stages.Wrapped]:
    """Jitted ``write(buf, host_blocks, rows) -> buf`` (donating ``buf``) and
    ``read(buf, host_blocks) -> rows`` of whole rows of a pinned_host buffer.

    Only dynamic-(update-)slices of the host buffer and moves between memories: a
    gather or scatter over a pinned_host buffer is computed on the host CPU (XLA warns
    "converting into host compute"), a DMA per row is not. The row count is static (the
    transfer engine buckets it); the host block indices stay on the device.
    """
    write = jax.jit(_write_rows, donate_argnums=0, out_shardings=_host_sharding(device))
    read = jax.jit(_read_rows, out_shardings=_device_sharding(device))
    return write, read


@functools.cache
def pinned_host_supported(device: jax.Device | None = None) -> bool:
    """Whether ``device`` has pinned_host memory that the pool's write/read compile for.

    Round-trips a tiny buffer through the exact jitted ops the pool uses
    (:func:`pinned_ops`): a row written, read back beside an untouched row. A backend
    without pinned_host memory (or whose compiler refuses the ops) gets the numpy buffer.
    """
    device = device or jax.devices()[0]
    try:
        if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
            return False
        write, read = pinned_ops(device)
        buf = jax.device_put(np.zeros((3, 2), np.float32), _host_sharding(device))
        data = jax.device_put(np.ones((1, 2), np.float32), _device_sharding(device))
        buf = write(buf, jnp.array([2], jnp.int32), data)
        back = np.asarray(read(buf, jnp.array([2, 0], jnp.int32)))
        return bool(back[0].all() and not back[1].any())
    except (jax.errors.JaxRuntimeError, ValueError, NotImplementedError, TypeError):
        return False


class _Shard:
    """One distinct shard of a block: where in the block it lies, the devices holding it
    (the first one owns the host buffer), and the buffer."""

    def __init__(self, index: tuple[slice, ...], devices: list[jax.Device], buffer: jax.Array | np.ndarray) -> None:
        self.index = index
        self.devices = devices
        self.buffer = buffer

    def host_rows(self, rows: jax.Array | np.ndarray) -> np.ndarray:
        """This shard of ``rows``, on the host (a device array's shard was copied there first)."""
        if isinstance(rows, np.ndarray):
            return rows[self.index]
        return np.asarray(_shard_on(rows, self.devices[0]))

    def to_devices(self, rows: jax.Array) -> list[jax.Array]:
        """``rows`` of this shard (on its first device) copied to every device holding it."""
        return [rows] + [jax.device_put(rows, d) for d in self.devices[1:]]


def array_is_ready(array: jax.Array) -> bool:
    """Whether ``array``'s computation or copy has finished, without blocking."""
    return bool(array.is_ready())  # type: ignore[attr-defined]  # jax.Array's stub omits is_ready


def _device_id(device: jax.Device) -> int:
    """A device's id: the order devices are sorted in."""
    return device.id


def _shard_on(rows: jax.Array, device: jax.Device) -> jax.Array:
    return next(s.data for s in rows.addressable_shards if s.device == device)


class HostKVBuffers:
    """Host buffers of ``num_blocks`` host blocks (+ the scratch host block 0), one per
    distinct shard of ``sharding`` (the staged rows', see :func:`row_sharding`; default:
    all on ``device``), and the host blocks' generations. ``backing(shape, dtype)`` supplies
    the numpy buffer of a one-shard pool (a file mapping: :mod:`jaxkv.offload.persistent`)."""

    def __init__(
        self,
        num_blocks: int,
        shape: tuple[int, ...],
        dtype: DTypeLike,
        *,
        memory_kind: str | None = None,
        device: jax.Device | None = None,
        sharding: Sharding | None = None,
        backing: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None,
    ) -> None:
        check_int("num_blocks", num_blocks, minimum=1, error=HostBuffersError)
        self.sharding = sharding or SingleDeviceSharding(device or jax.devices()[0])
        self.device = min(self.sharding.addressable_devices, key=_device_id)
        if backing is not None:
            if memory_kind not in (None, "numpy"):
                raise HostBuffersError(f"a backed host buffer is a numpy array, not memory_kind={memory_kind!r}")
            memory_kind = "numpy"
        if memory_kind is None:
            memory_kind = "pinned_host" if pinned_host_supported(self.device) else "numpy"
        if memory_kind not in MEMORY_KINDS:
            raise HostBuffersError(f"unknown memory_kind {memory_kind!r}; valid: {MEMORY_KINDS}")
        if memory_kind == "pinned_host" and not pinned_host_supported(self.device):
            raise HostBuffersError(f"device {self.device} does not support pinned_host buffers")
        self.memory_kind = memory_kind
        self.num_blocks = num_blocks
        self.block_shape = tuple(shape)
        self.dtype = jnp.dtype(dtype)
        full = (num_blocks + 1, *self.block_shape)
        shards: dict[tuple, list[jax.Device]] = {}
        indices = self.sharding.addressable_devices_indices_map(full)
        for device in sorted(indices, key=_device_id):
            index = indices[device]
            assert index is not None  # jax gives every addressable device an index (its typing allows None)
            shards.setdefault(tuple((i.start, i.stop) for i in index), []).append(device)
        shard_shape = self.sharding.shard_shape(full)
        if backing is not None and len(shards) != 1:
            raise HostBuffersError(f"a backed host buffer holds one shard of a block, this cache has {len(shards)}")
        self._shards = []
        for key, devices in shards.items():
            index = (slice(None), *tuple(slice(start, stop) for start, stop in key[1:]))
            if backing is not None:
                buffer = backing(shard_shape, self.dtype)
            elif memory_kind == "pinned_host":
                buffer = jax.device_put(np.zeros(shard_shape, self.dtype), _host_sharding(devices[0]))
            else:
                buffer = np.zeros(shard_shape, self.dtype)
            self._shards.append(_Shard(index, devices, buffer))
        self.generation = np.zeros(num_blocks + 1, np.int64)

    @classmethod
    def for_cache(
        cls, cache: KVCache | StateCache | StateUnits, byte_budget: int, *, memory_kind: str | None = None
    ) -> HostKVBuffers:
        """A pool of as many whole blocks (or state rows) of ``cache`` as fit in ``byte_budget``
        bytes (counting whole blocks: a process holding some of the shards uses less)."""
        shape, dtype = row_format(cache)
        num_blocks = blocks_in_budget(byte_budget, int(np.prod(shape)) * dtype.itemsize)
        return cls(num_blocks, shape, dtype, memory_kind=memory_kind, sharding=row_sharding(cache))

    @property
    def buffers(self) -> tuple[jax.Array | np.ndarray, ...]:
        """The host buffers, one per distinct shard of a block ``(num_blocks + 1, *shard)``."""
        return tuple(shard.buffer for shard in self._shards)

    def is_ready(self) -> bool:
        """Whether every write issued into the pinned_host buffers has landed."""
        return all(array_is_ready(buffer) for buffer in self.buffers if isinstance(buffer, jax.Array))

    def block_until_ready(self) -> None:
        """Wait for every write issued into the pinned_host buffers."""
        jax.block_until_ready(self.buffers)

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    def check_host_blocks(self, host_blocks: Sequence[int]) -> None:
        """Raise naming the first host block outside ``0..num_blocks``."""
        bad = [s for s in host_blocks if not 0 <= s <= self.num_blocks]
        if bad:
            raise HostBuffersError(f"host blocks out of range [0, {self.num_blocks}]: {bad}")

    def bump(self, host_blocks: Sequence[int] | np.ndarray) -> np.ndarray:
        """A new generation for each host block (a new writer owns it); returns them."""
        rows = np.asarray(host_blocks, np.int64)
        self.generation[rows] += 1
        self.generation[SCRATCH_HOST_BLOCK] = 0
        return self.generation[rows].copy()

    def release(self, host_blocks: Sequence[int]) -> None:
        """The host blocks were freed by the manager: any transfer still in flight is stale."""
        self.check_host_blocks(host_blocks)
        self.bump(host_blocks)

    def current(self, host_blocks: Sequence[int] | np.ndarray, generations: np.ndarray) -> np.ndarray:
        """Which host blocks still have the given generations (scratch rows count as current)."""
        return self.generation[np.asarray(host_blocks, np.int64)] == generations

    # ------------------------------------------------------------------ data
    def write(self, host_blocks: np.ndarray, rows: jax.Array) -> None:
        """pinned_host: write device rows (sharded as the pool) into their host blocks now
        (async DMAs, each device's shard into its buffer), at most :data:`ROWS_PER_CALL`
        rows per jitted call."""
        host_blocks = np.asarray(host_blocks, np.int32)
        for shard in self._shards:
            write, _ = pinned_ops(shard.devices[0])
            data = _shard_on(rows, shard.devices[0])
            for part in _row_parts(len(host_blocks)):
                part_rows = data if part.stop - part.start == len(host_blocks) else data[part]
                shard.buffer = write(shard.buffer, jnp.asarray(host_blocks[part]), part_rows)

    def commit(self, host_blocks: np.ndarray, rows: jax.Array | np.ndarray, take: np.ndarray | None = None) -> None:
        """numpy: copy rows that already reached the host (``rows[take]``, default all) into
        their host blocks, each shard into its buffer. ``rows``: numpy, or device rows whose
        shards were copied to the host (``copy_to_host_async``)."""
        for shard in self._shards:
            data = shard.host_rows(rows)
            shard.buffer[host_blocks] = data if take is None else data[take]

    def read(self, host_blocks: np.ndarray) -> jax.Array:
        """Rows of the host blocks as a device array sharded as the pool (the host->device
        copy of a load: each shard read to the devices that hold it)."""
        host_blocks = np.asarray(host_blocks, np.int32)
        arrays = []
        for shard in self._shards:
            if self.memory_kind == "numpy":
                rows = jax.device_put(shard.buffer[host_blocks], shard.devices[0])
            else:
                _, read = pinned_ops(shard.devices[0])
                parts = [read(shard.buffer, jnp.asarray(host_blocks[part])) for part in _row_parts(len(host_blocks))]
                rows = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            arrays.extend(shard.to_devices(rows))
        shape = (len(host_blocks), *self.block_shape)
        return jax.make_array_from_single_device_arrays(shape, self.sharding, arrays)

    def rows(self, host_blocks: Sequence[int]) -> np.ndarray:
        """A host copy of the host blocks' data (tests and debugging).

        The rows are read into a fresh numpy array: ``np.asarray`` of the whole
        ``pinned_host`` buffer would be a zero-copy view that keeps an external
        reference to it, and the next store (which donates the buffer) would fail on
        a GPU ("Donation requested for buffer with external reference")."""
        return np.array(self.read(np.asarray(host_blocks, np.int64)), copy=True)
