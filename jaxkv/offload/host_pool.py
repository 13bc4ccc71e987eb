"""Host memory of the offload tier: the slot allocator (metadata) and the buffer (data).

One host slot holds one whole cross-layer block ``(num_slots, block_size, 2*H, D)``,
the staging format of :func:`jaxkv.ops.gather_blocks` in either device layout. Slot 0
is a scratch slot: padded rows of bucketed transfers read and write it, it is never
handed out. The buffer lives in ``pinned_host`` memory when the backend supports the
writes and reads the transfer engine compiles (probed once per backend), else in a
numpy array.

Each slot has a generation counter, bumped by every store issued into it and by
:meth:`HostKVPool.release`; a transfer records the generations it was issued with, so
one that completes after its slot was reused is recognised as stale.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache import KVCache

SCRATCH_SLOT = 0
MEMORY_KINDS = ("pinned_host", "numpy")


class HostPoolError(ValueError):
    """A host slot, count or budget the host tier cannot act on; nothing was changed."""


class Backend(ABC):
    """Hands out the places offloaded blocks live in (host slots, disk pages...)."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Blocks the medium holds in all."""

    @property
    @abstractmethod
    def num_free(self) -> int:
        """Blocks that can be allocated now."""

    @abstractmethod
    def allocate(self, n: int) -> list[int]:
        """``n`` free places; raises when fewer are free."""

    @abstractmethod
    def free(self, places: Sequence[int]) -> None:
        """Return allocated places; raises (changing nothing) on one not allocated."""


class HostSlotBackend(Backend):
    """Host slots ``1..capacity`` from a free list (slot 0 is the scratch slot)."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise HostPoolError(f"capacity must be an int >= 1, got {capacity!r}")
        self._capacity = capacity
        self._free = list(range(capacity, 0, -1))  # pop() hands out 1, 2, ...
        self._allocated: set[int] = set()

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n < 0 or n > len(self._free):
            raise HostPoolError(f"cannot allocate {n} host slots: {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._allocated.update(out)
        return out

    def free(self, places: Sequence[int]) -> None:
        places = list(places)
        bad = [s for s in places if s not in self._allocated]
        if bad or len(set(places)) != len(places):
            raise HostPoolError(f"host slots not allocated (or repeated): {bad or places}")
        self._allocated.difference_update(places)
        self._free.extend(reversed(places))


def blocks_in_budget(byte_budget: int, block_bytes: int) -> int:
    """How many whole blocks of ``block_bytes`` fit in ``byte_budget`` (at least one)."""
    if block_bytes < 1 or byte_budget < block_bytes:
        raise HostPoolError(f"byte_budget {byte_budget!r} holds no block of {block_bytes!r} bytes")
    return byte_budget // block_bytes


def block_shape(cache: KVCache) -> tuple[int, ...]:
    """Shape of one whole block in the staging format, for either layout."""
    return (cache.num_slots, cache.block_size, 2 * cache.num_kv_heads, cache.head_dim)


def block_nbytes(cache: KVCache) -> int:
    """Bytes of one whole block (all layer slots)."""
    return int(np.prod(block_shape(cache))) * cache.dtype.itemsize


def _host_sharding(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def _device_sharding(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device)


def _to_host(x: jax.Array) -> jax.Array:
    return jax.device_put(x, jax.memory.Space.Host)


@functools.cache
def _pinned_ops(device: jax.Device) -> tuple:
    """Jitted (write, read) of rows of a pinned_host buffer, indexed on the host side.

    jax 0.10 types memory spaces: the slot indices (and written rows) move to host
    memory inside the jit, the indexing runs there, and read rows move to the device.
    """
    host, dev = _host_sharding(device), _device_sharding(device)
    write = jax.jit(
        lambda buf, slots, data: buf.at[_to_host(slots)].set(_to_host(data.astype(buf.dtype))),
        donate_argnums=0,
        out_shardings=host,
    )
    read = jax.jit(
        lambda buf, slots: jax.device_put(buf[_to_host(slots)], jax.memory.Space.Device),
        out_shardings=dev,
    )
    return write, read


@functools.cache
def pinned_host_supported(device: jax.Device | None = None) -> bool:
    """Whether ``device`` has pinned_host memory that the pool's write/read compile for.

    Round-trips a tiny buffer through the exact jitted ops the pool uses. CPU jax 0.10
    has pinned_host (and computes on it); a backend without it gets the numpy buffer.
    """
    device = device or jax.devices()[0]
    try:
        if "pinned_host" not in {m.kind for m in device.addressable_memories()}:
            return False
        write, read = _pinned_ops(device)
        buf = jax.device_put(np.zeros((3, 2), np.float32), _host_sharding(device))
        data = jax.device_put(np.ones((1, 2), np.float32), _device_sharding(device))
        buf = write(buf, jnp.array([2], jnp.int32), data)
        back = np.asarray(read(buf, jnp.array([2, 0], jnp.int32)))
        return bool(back[0].all() and not back[1].any())
    except (jax.errors.JaxRuntimeError, ValueError, NotImplementedError, TypeError):
        return False


class HostKVPool:
    """Host buffer of ``num_blocks`` slots (+ the scratch slot 0) and their generations."""

    def __init__(
        self,
        num_blocks: int,
        shape: tuple[int, ...],
        dtype: object,
        *,
        memory_kind: str | None = None,
        device: jax.Device | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise HostPoolError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.device = device or jax.devices()[0]
        if memory_kind is None:
            memory_kind = "pinned_host" if pinned_host_supported(self.device) else "numpy"
        if memory_kind not in MEMORY_KINDS:
            raise HostPoolError(f"unknown memory_kind {memory_kind!r}; valid: {MEMORY_KINDS}")
        if memory_kind == "pinned_host" and not pinned_host_supported(self.device):
            raise HostPoolError(f"device {self.device} does not support pinned_host buffers")
        self.memory_kind = memory_kind
        self.num_blocks = num_blocks
        self.block_shape = tuple(shape)
        self.dtype = jnp.dtype(dtype)
        full = (num_blocks + 1,) + self.block_shape
        if memory_kind == "pinned_host":
            self.buffer: jax.Array | np.ndarray = jax.device_put(
                np.zeros(full, self.dtype), _host_sharding(self.device)
            )
        else:
            self.buffer = np.zeros(full, self.dtype)
        self.generation = np.zeros(num_blocks + 1, np.int64)

    @classmethod
    def for_cache(
        cls, cache: KVCache, byte_budget: int, *, memory_kind: str | None = None
    ) -> HostKVPool:
        """A pool of as many whole blocks of ``cache`` as fit in ``byte_budget`` bytes."""
        num_blocks = blocks_in_budget(byte_budget, block_nbytes(cache))
        device = next(iter(cache.buffers[0].devices()))
        return cls(num_blocks, block_shape(cache), cache.dtype, memory_kind=memory_kind, device=device)

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    def check_slots(self, slots: Sequence[int]) -> None:
        """Raise naming the first slot outside ``0..num_blocks``."""
        bad = [s for s in slots if not 0 <= s <= self.num_blocks]
        if bad:
            raise HostPoolError(f"host slots out of range [0, {self.num_blocks}]: {bad}")

    def bump(self, slots: Sequence[int]) -> np.ndarray:
        """A new generation for each slot (a new writer owns it); returns them."""
        slots = np.asarray(slots, np.int64)
        self.generation[slots] += 1
        self.generation[SCRATCH_SLOT] = 0
        return self.generation[slots].copy()

    def release(self, slots: Sequence[int]) -> None:
        """The slots were freed by the manager: any transfer still in flight is stale."""
        self.check_slots(slots)
        self.bump(slots)

    def current(self, slots: Sequence[int], generations: np.ndarray) -> np.ndarray:
        """Which slots still have the given generations (scratch rows count as current)."""
        return self.generation[np.asarray(slots, np.int64)] == generations

    # ------------------------------------------------------------------ data
    def write(self, slots: jax.Array, data: jax.Array) -> None:
        """pinned_host: scatter device rows into the buffer now (async D2H copy)."""
        write, _ = _pinned_ops(self.device)
        self.buffer = write(self.buffer, slots, data)

    def commit(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """numpy: copy rows that already reached the host into their slots."""
        self.buffer[slots] = rows

    def read(self, slots: np.ndarray) -> jax.Array:
        """Rows of the slots as a device array (the host->device copy of a load)."""
        if self.memory_kind == "pinned_host":
            _, read = _pinned_ops(self.device)
            return read(self.buffer, jnp.asarray(slots, jnp.int32))
        return jax.device_put(self.buffer[slots], _device_sharding(self.device))

    def rows(self, slots: Sequence[int]) -> np.ndarray:
        """A host copy of the slots' data (tests and debugging)."""
        return np.asarray(self.buffer)[np.asarray(slots, np.int64)]
