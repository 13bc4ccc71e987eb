"""Eviction policies of the host offload tier: LRU and ARC, selected by name.

A policy only orders the keys resident in the host tier; the offloading manager owns
their states and asks the policy for victims among the keys it says are evictable
(ready and unpinned). Choosing victims is pure (:meth:`EvictionPolicy.choose_victims`)
so a store that cannot fit changes nothing; :meth:`EvictionPolicy.admit` then applies
one store atomically: evict the chosen victims, insert the incoming keys.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int

Key = TypeVar("Key", bound=Hashable)
Evictable = Callable[[Key], bool]
Ready = Callable[[Key], bool]
"""Whether a resident key's data is in the tier (its store completed)."""


class PolicyError(JaxkvError, ValueError):
    """A policy was built with a value it cannot use."""


class UnknownPolicyError(PolicyError):
    """A policy name that is not in :data:`POLICIES`."""


class EvictionPolicy(ABC, Generic[Key]):
    """Orders resident keys for eviction; ``capacity`` is the host tier's size in blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = check_int("capacity", capacity, error=PolicyError)

    @abstractmethod
    def touch(self, keys: Iterable[Key], ready: Ready[Key]) -> None:
        """Record an access of each resident key, in order (the last ends most recent).

        A key whose store is still in flight (not ``ready``) becomes recent too, but a
        policy with a frequency list must not count it as a second use."""

    @abstractmethod
    def choose_victims(self, n: int, evictable: Evictable[Key], incoming: Sequence[Key]) -> list[Key] | None:
        """``n`` evictable keys to make room for ``incoming``, or None; changes nothing."""

    @abstractmethod
    def admit(self, incoming: Sequence[Key], victims: Sequence[Key]) -> None:
        """Evict ``victims`` (from :meth:`choose_victims`) and insert ``incoming``."""

    @abstractmethod
    def discard(self, keys: Iterable[Key]) -> None:
        """Forget resident keys entirely (a failed store): no ghost, no history."""

    @abstractmethod
    def resident(self) -> list[Key]:
        """Resident keys, roughly in eviction order (for tests and debugging)."""


def _first_evictable(order: Iterable[Key], evictable: Evictable[Key], taken: set[Key]) -> Key | None:
    for key in order:
        if key not in taken and evictable(key):
            return key
    return None


class LRUPolicy(EvictionPolicy[Key]):
    """Least recently used first; new keys enter as most recent."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def touch(self, keys: Iterable[Key], ready: Ready[Key]) -> None:
        for key in keys:
            if key in self._order:
                self._order.move_to_end(key)

    def choose_victims(self, n: int, evictable: Evictable[Key], incoming: Sequence[Key]) -> list[Key] | None:
        victims = list(itertools.islice((key for key in self._order if evictable(key)), n))
        return victims if len(victims) == n else None

    def admit(self, incoming: Sequence[Key], victims: Sequence[Key]) -> None:
        for key in victims:
            del self._order[key]
        for key in incoming:
            self._order[key] = None

    def discard(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self._order.pop(key, None)

    def resident(self) -> list[Key]:
        return list(self._order)


class ARCPolicy(EvictionPolicy[Key]):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) over host blocks.

    ``T1`` holds keys seen once (recency), ``T2`` keys hit again (frequency); ``B1`` /
    ``B2`` remember keys recently evicted from each (ghosts, no data). A store of a key
    found in ``B1`` means T1 was too small: the target size ``p`` of T1 grows by
    ``max(|B2|/|B1|, 1)``; one found in ``B2`` shrinks it by ``max(|B1|/|B2|, 1)``; such
    keys re-enter in T2. Victims come from T1's LRU end while ``|T1| > p`` (or ``== p``
    when the incoming key is a B2 ghost), else from T2's; keys that are not evictable
    (pinned or being stored) are skipped, falling back to the other list. Ghost lists
    are trimmed to ``|T1| + |B1| <= c`` and ``|T1| + |T2| + |B1| + |B2| <= 2c``.

    Batched stores adapt ``p`` for every incoming key first, then choose all victims
    with the adapted ``p``, so a whole store is one decision.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def touch(self, keys: Iterable[Key], ready: Ready[Key]) -> None:
        """A ready key in T1 moves to T2 (its second use); one still being stored stays in
        T1, at its recent end: a scan looked up while storing is not frequent."""
        for key in keys:
            if key in self.t1:
                if ready(key):
                    del self.t1[key]
                    self.t2[key] = None
                else:
                    self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)

    def _adapted_p(self, incoming: Sequence[Key]) -> float:
        """The target T1 size after the ghost hits of ``incoming`` (pure)."""
        p, b1, b2 = self.p, len(self.b1), len(self.b2)
        for key in incoming:
            if key in self.b1:
                p = min(float(self.capacity), p + max(b2 / b1, 1.0))
                b1 -= 1
            elif key in self.b2:
                p = max(0.0, p - max(b1 / b2, 1.0))
                b2 -= 1
        return p

    def choose_victims(self, n: int, evictable: Evictable[Key], incoming: Sequence[Key]) -> list[Key] | None:
        p = self._adapted_p(incoming)
        prefer_t1_at_p = bool(incoming) and incoming[0] in self.b2
        t1_size = len(self.t1)
        taken: set[Key] = set()
        victims: list[Key] = []
        for _ in range(n):
            from_t1 = t1_size > 0 and (t1_size > p or (prefer_t1_at_p and t1_size == p))
            lists = (self.t1, self.t2) if from_t1 else (self.t2, self.t1)
            key = _first_evictable(lists[0], evictable, taken)
            if key is None:
                key = _first_evictable(lists[1], evictable, taken)
            if key is None:
                return None
            taken.add(key)
            victims.append(key)
            if key in self.t1:
                t1_size -= 1
        return victims

    def admit(self, incoming: Sequence[Key], victims: Sequence[Key]) -> None:
        self.p = self._adapted_p(incoming)
        for key in victims:
            if key in self.t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for key in incoming:
            if key in self.b1 or key in self.b2:
                self.b1.pop(key, None)
                self.b2.pop(key, None)
                self.t2[key] = None
            else:
                self.t1[key] = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def discard(self, keys: Iterable[Key]) -> None:
        for key in keys:
            self.t1.pop(key, None)
            self.t2.pop(key, None)

    def resident(self) -> list[Key]:
        return list(self.t1) + list(self.t2)


POLICIES: dict[str, type[EvictionPolicy[Any]]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy[Any]:
    """The policy registered as ``name`` (see :data:`POLICIES`) for ``capacity`` blocks."""
    if name not in POLICIES:
        raise UnknownPolicyError(f"unknown eviction policy {name!r}; valid: {', '.join(POLICIES)}")
    return POLICIES[name](capacity)
