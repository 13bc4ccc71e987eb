"""Where offloaded blocks live: the places a backend hands out (host blocks, disk pages...).

Host-only bookkeeping (no JAX): the offloading catalog allocates places here, the
host buffers (:mod:`jaxkv.offload.host_buffers`) hold the bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int

SCRATCH_HOST_BLOCK = 0
"""Host block 0: padded rows of bucketed transfers read and write it; never handed out."""


class HostBlocksError(JaxkvError, ValueError):
    """A host block, count or capacity the backend cannot act on; nothing was changed."""


class Backend(ABC):
    """Hands out the places offloaded blocks live in (host blocks, disk pages...)."""

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

    @property
    @abstractmethod
    def num_allocated(self) -> int:
        """Places handed out and not yet freed."""


class HostBlockBackend(Backend):
    """Host blocks ``1..capacity`` from a free list (host block 0 is the scratch block)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = check_int("capacity", capacity, error=HostBlocksError)
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
            raise HostBlocksError(f"cannot allocate {n} host blocks: {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._allocated.update(out)
        return out

    def claim(self, places: Sequence[int]) -> None:
        """Allocate these free places (a reloaded tier's); raises, changing nothing, on one not free."""
        places = list(places)
        free, taken = set(self._free), set(places)
        bad = [s for s in places if s not in free]
        if bad or len(taken) != len(places):
            raise HostBlocksError(f"host blocks not free (or repeated): {bad or places}")
        self._free = [s for s in self._free if s not in taken]
        self._allocated.update(places)

    def free(self, places: Sequence[int]) -> None:
        places = list(places)
        bad = [s for s in places if s not in self._allocated]
        if bad or len(set(places)) != len(places):
            raise HostBlocksError(f"host blocks not allocated (or repeated): {bad or places}")
        self._allocated.difference_update(places)
        self._free.extend(reversed(places))

    @property
    def num_allocated(self) -> int:
        return len(self._allocated)
