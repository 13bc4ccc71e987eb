"""What a :class:`~jaxkv.core.manager.KVCacheManager` keeps for each request holding
blocks: the :class:`HeldRequest`, created by the request's first allocation, dropped by
its ``free``.

Most decode steps allocate nothing: the new token fits a slot the request holds, fills
no block that caching would register, and moves no block out of a sliding window. The
record keeps the token counts at which each of those events happens next, so such a
step costs the manager one dict lookup and a few integer comparisons. The request
itself keeps only what its caller owns (tokens, computed tokens, extra keys) and what
its lookups found (block hashes, the prefix reach).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxkv.core.coordinator import KVCacheCoordinator
from jaxkv.core.request import Request
from jaxkv.core.single_type import NEVER


@dataclass(slots=True, eq=False)
class HeldRequest:
    """A request holding blocks in one manager, and its next event thresholds.

    ``capacity``: tokens its slots hold (capped at ``max_model_len``); ``next_full``:
    tokens at which caching would register another block (:data:`NEVER` without
    caching); ``next_skip``: computed tokens at which a block of some group falls out of
    span; ``quiet_below``: computed tokens below which a one-token step without lookahead
    crosses none of the three.
    """

    request: Request
    capacity: int = 0
    next_full: int = 0
    next_skip: int = 0
    quiet_below: int = 0

    def set_thresholds(self, capacity: int, next_full: int, next_skip: int) -> None:
        self.capacity = capacity
        self.next_full = next_full
        self.next_skip = next_skip
        self.quiet_below = min(capacity, next_full - 1, next_skip)

    def read_thresholds(self, coordinator: KVCacheCoordinator, max_model_len: int, *, caching: bool) -> None:
        """All three thresholds from the coordinator, after an allocation that may have moved any."""
        capacity, next_full, next_skip = coordinator.thresholds(self.request.request_id)
        self.set_thresholds(min(capacity, max_model_len), next_full if caching else NEVER, next_skip)

    def update_thresholds(
        self, coordinator: KVCacheCoordinator, max_model_len: int, *, grew: bool, filled: bool, skipped: bool
    ) -> None:
        """Only the thresholds of the events that happened, after a held request grew by a few tokens."""
        rid = self.request.request_id
        self.set_thresholds(
            min(coordinator.capacity(rid), max_model_len) if grew else self.capacity,
            coordinator.next_full(rid) if filled else self.next_full,
            coordinator.next_skip(rid) if skipped else self.next_skip,
        )
