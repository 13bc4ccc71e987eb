"""Where a recurrent request's prefill caches its state, and how a chunk ends on one.

With state groups (the planner's ``state_pool`` layout or shared pages), a recurrent
state exists only where a step ends, so it can be cached only there: at *checkpoint
positions* of the prompt (a block boundary each), where a scheduler ends its prefill
chunks. Pure integer arithmetic: the manager passes each request's numbers in.
"""

from __future__ import annotations

from jaxkv.ints import is_int
from jaxkv.manager_errors import KVCacheManagerError
from jaxkv.planner import KVCacheConfig


class CheckpointPolicy:
    """The checkpoint positions of a request's prompt, for one manager's config.

    A prompt of ``num_prompt_tokens`` tokens, found cached by full attention alone up
    to ``reach`` tokens (further than the whole hit when a state was missing there and
    a cached chain branches there: :class:`~jaxkv.coordinator.PrefixHit`), checkpoints
    its last block boundary, the boundary at ``reach`` (so the next request sharing
    that prefix finds a state there) and every ``interval`` tokens if set.
    """

    __slots__ = ("block_size", "enable_caching", "interval")

    def __init__(self, config: KVCacheConfig, interval: int | None, *, enable_caching: bool) -> None:
        """Refuse an ``interval`` that is not a positive multiple of the hash block size."""
        if interval is not None and (not is_int(interval) or interval <= 0 or interval % config.hash_block_size):
            raise KVCacheManagerError(
                f"checkpoint_interval must be a positive multiple of the hash block size "
                f"{config.hash_block_size}, got {interval!r}"
            )
        # Block size of the state groups (the hash block size), 0 without: no checkpoints.
        self.block_size = config.hash_block_size if config.state_group_ids else 0
        self.interval = interval
        self.enable_caching = enable_caching

    def shared(self, num_prompt_tokens: int, reach: int, num_computed_tokens: int) -> set[int]:
        """The positions past ``num_computed_tokens`` that other requests are expected to
        hit: ``reach``'s block boundary and every ``interval`` (not the prompt's end)."""
        bs = self.block_size
        prompt_end = num_prompt_tokens // bs * bs
        positions = {reach // bs * bs}
        if self.interval:
            positions.update(range(self.interval, prompt_end, self.interval))
        return {p for p in positions if num_computed_tokens < p <= prompt_end}

    def positions(self, num_prompt_tokens: int, reach: int, num_computed_tokens: int) -> tuple[int, ...]:
        """Every checkpoint position past ``num_computed_tokens``, in order (none without
        state groups or without caching)."""
        bs = self.block_size
        if not bs or not self.enable_caching:
            return ()
        positions = self.shared(num_prompt_tokens, reach, num_computed_tokens)
        prompt_end = num_prompt_tokens // bs * bs
        if prompt_end > num_computed_tokens:
            positions.add(prompt_end)
        return tuple(sorted(positions))

    def chunk_limit(self, num_prompt_tokens: int, reach: int, start: int, num_new_tokens: int) -> int:
        """``num_new_tokens`` cut so a chunk starting at ``start`` ends at the next
        checkpoint position, if one falls inside it; unchanged without state groups."""
        if num_new_tokens > 1:
            positions = self.positions(num_prompt_tokens, reach, start)
            if positions and positions[0] < start + num_new_tokens:
                return positions[0] - start
        return num_new_tokens
