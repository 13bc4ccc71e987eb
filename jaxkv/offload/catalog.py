"""The offloading manager: which (block hash, group) keys the host tier holds, and where.

Host metadata only; the transfer engine moves the data. A key is in one of three
states: being stored (neither loadable nor evictable), ready (loadable, evictable)
or pinned by loads (ready, ref-counted, not evictable). Every failed call raises a
typed error naming the bad key and changes nothing; a store that does not fit
returns None and changes nothing either.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from jaxkv.errors import JaxkvError
from jaxkv.offload.host_blocks import Backend, HostBlockBackend
from jaxkv.offload.policies import EvictionPolicy, make_policy

_log = logging.getLogger(__name__)

STORE_POLICIES = ("on_eviction", "write_through")
"""When device blocks are stored to host: as the pool reuses them, or once filled
(:mod:`jaxkv.serving.offload_connector`)."""

OffloadKey = tuple[Hashable, int]
"""(block hash, KV cache group)."""


class OffloadError(JaxkvError, ValueError):
    """A call named keys in a state it cannot act on; nothing was changed."""


class NotReadyError(OffloadError):
    """A load asked for a key that is not stored and ready."""


class NotPinnedError(OffloadError):
    """``complete_load`` unpinned a key more times than it was pinned."""


class NotStoredError(OffloadError):
    """``complete_store`` named a key that is neither being stored nor stored."""


@dataclass(frozen=True)
class KeysStored:
    """Keys became ready in the host tier (announced once, at store completion)."""

    keys: tuple[OffloadKey, ...]


@dataclass(frozen=True)
class KeysRemoved:
    """Ready keys were evicted from the host tier."""

    keys: tuple[OffloadKey, ...]


OffloadEvent = KeysStored | KeysRemoved


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What a store must do: keys to write, their places (same order), keys evicted."""

    keys_to_store: tuple[OffloadKey, ...]
    where: tuple[int, ...]
    evicted: tuple[OffloadKey, ...]


class OffloadingManager(ABC):
    """The scheduler-side interface of an offload tier (any medium, any policy)."""

    @abstractmethod
    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        """How many leading keys are stored and ready."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey]) -> list[int]:
        """Where the (ready) keys are; pins them against eviction until ``complete_load``."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark the keys used; the first key of a prefix ends most recent."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Unpin keys pinned by ``prepare_load``."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey], prefer: Iterable[OffloadKey] = ()) -> PrepareStoreOutput | None:
        """Make room for the keys not stored yet; None (changing nothing) if it cannot.

        ``prefer``: resident keys to evict first, in this order, where evictable (a
        write-through tier's keys whose KV its device still holds: evicting them loses
        nothing); read only as far as the victims it gives."""

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Mark stored keys ready; on failure drop the keys still being stored."""

    @abstractmethod
    def take_events(self) -> list[OffloadEvent]:
        """Return and clear the events since the last call."""

    @abstractmethod
    def num_keys_by_state(self) -> dict[str, int]:
        """How many keys are ``storing``, ``ready`` and ``pinned`` (for leak checks)."""

    @abstractmethod
    def num_allocated_places(self) -> int:
        """Places the backend has handed out; equals ``len(self)`` unless one leaked."""


@dataclass
class _Entry:
    place: int
    ready: bool = False
    pins: int = 0


class PolicyOffloadingManager(OffloadingManager):
    """An offloading manager over a :class:`Backend` with an eviction policy by name."""

    def __init__(
        self, backend: Backend, policy: str | EvictionPolicy[OffloadKey] = "lru", *, enable_events: bool = True
    ) -> None:
        self.backend = backend
        self.policy: EvictionPolicy[OffloadKey] = (
            make_policy(policy, backend.capacity) if isinstance(policy, str) else policy
        )
        self.enable_events = enable_events
        self._entries: dict[OffloadKey, _Entry] = {}
        self._events: list[OffloadEvent] = []

    def restore(self, entries: dict[OffloadKey, int]) -> None:
        """Hold ``entries`` (key -> place) ready, as a tier reloaded at start does (an empty
        catalog over a :class:`~jaxkv.offload.host_blocks.HostBlockBackend`); announced as stored."""
        if self._entries:
            raise OffloadError(f"restore needs an empty catalog; it holds {len(self._entries)} keys")
        if not isinstance(self.backend, HostBlockBackend):
            raise OffloadError(f"restore needs a HostBlockBackend, got {type(self.backend).__name__}")
        self.backend.claim(list(entries.values()))
        self.policy.admit(list(entries), [])
        for key, place in entries.items():
            self._entries[key] = _Entry(place, ready=True)
        if entries and self.enable_events:
            self._events.append(KeysStored(tuple(entries)))

    # -------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._entries)

    def state(self, key: OffloadKey) -> str:
        """``absent``, ``storing``, ``ready`` or ``pinned``."""
        entry = self._entries.get(key)
        if entry is None:
            return "absent"
        if not entry.ready:
            return "storing"
        return "pinned" if entry.pins else "ready"

    def _evictable(self, key: OffloadKey) -> bool:
        entry = self._entries[key]
        return entry.ready and not entry.pins

    def lookup(self, keys: Sequence[OffloadKey]) -> int:
        for i, key in enumerate(keys):
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                return i
        return len(keys)

    # ---------------------------------------------------------------- loads
    def prepare_load(self, keys: Sequence[OffloadKey]) -> list[int]:
        for key in keys:
            if self.state(key) not in ("ready", "pinned"):
                raise NotReadyError(f"key {key!r} is {self.state(key)}, not ready to load")
        for key in keys:
            self._entries[key].pins += 1
        return [self._entries[key].place for key in keys]

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Every held key becomes recent, ready or still being stored (as vLLM's LRU and
        ARC managers do); only a ready key counts as a second use for ARC, so a one-shot
        scan touched while storing does not evict the hot set."""
        entries = self._entries
        self.policy.touch((key for key in reversed(keys) if key in entries), lambda key: entries[key].ready)

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        for key, count in Counter(keys).items():
            entry = self._entries.get(key)
            pins = entry.pins if entry is not None else 0
            if pins < count:
                raise NotPinnedError(f"key {key!r} is pinned {pins} times, cannot unpin {count}")
        for key in keys:
            self._entries[key].pins -= 1

    # --------------------------------------------------------------- stores
    def prepare_store(self, keys: Sequence[OffloadKey], prefer: Iterable[OffloadKey] = ()) -> PrepareStoreOutput | None:
        incoming = [key for key in dict.fromkeys(keys) if key not in self._entries]
        if len(incoming) > self.backend.capacity:
            return None
        victims: list[OffloadKey] = []
        need = len(incoming) - self.backend.num_free
        if need > 0:
            protected = set(keys)

            def evictable(key: OffloadKey) -> bool:
                return key not in protected and self._evictable(key)

            victims = list(itertools.islice((k for k in prefer if k in self._entries and evictable(k)), need))
            protected.update(victims)
            chosen = self.policy.choose_victims(need - len(victims), evictable, incoming) if need > len(victims) else []
            if chosen is None:
                return None
            victims += chosen
        self.policy.admit(incoming, victims)
        if victims:
            _log.debug("host tier evicts %d key(s) to store %d", len(victims), len(incoming))
            self.backend.free([self._entries.pop(key).place for key in victims])
            if self.enable_events:
                self._events.append(KeysRemoved(tuple(victims)))
        places = self.backend.allocate(len(incoming))
        for key, place in zip(incoming, places, strict=True):
            self._entries[key] = _Entry(place)
        return PrepareStoreOutput(tuple(incoming), tuple(places), tuple(victims))

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        missing = [key for key in keys if key not in self._entries]
        if missing:
            raise NotStoredError(f"keys neither being stored nor stored: {missing}")
        pending = [key for key in dict.fromkeys(keys) if not self._entries[key].ready]
        if success:
            for key in pending:
                self._entries[key].ready = True
            if pending and self.enable_events:
                self._events.append(KeysStored(tuple(pending)))
            return
        self.policy.discard(pending)
        self.backend.free([self._entries.pop(key).place for key in pending])

    def take_events(self) -> list[OffloadEvent]:
        events, self._events = self._events, []
        return events

    # ---------------------------------------------------------------- audit
    def num_keys_by_state(self) -> dict[str, int]:
        """How many keys are ``storing``, ``ready`` and ``pinned`` (for leak checks)."""
        counts = {"storing": 0, "ready": 0, "pinned": 0}
        for entry in self._entries.values():
            counts["pinned" if entry.pins else "ready" if entry.ready else "storing"] += 1
        return counts

    def num_allocated_places(self) -> int:
        """Places the backend has handed out; equals ``len(self)`` unless one leaked."""
        return self.backend.num_allocated
