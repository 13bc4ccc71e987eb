"""Coordinates the per-group managers of one model: the hybrid cache-hit fixed point.

Groups with the same layer type, spec and block size form one *attention type* and
are searched together. A prefix hit is usable only if every type can serve it, so the
coordinator shrinks a candidate length until every type agrees: each search returns
at most the length it was offered, hence the loop only shrinks and ends. The length
is kept a multiple of the lcm of the groups' block sizes.

Prefix hashes are computed once per request at the smallest block size; a group whose
block is ``k`` times larger uses every ``k``-th hash (a chained hash names the whole
prefix up to its block's end): :meth:`KVCacheCoordinator.typed_hashes`.

The coordinator owns the :class:`~jaxkv.core.pool.BlockPool` (and, with the planner's
``state_pool`` layout, a second one whose blocks are recurrent state rows: block ids
of the two pools are separate namespaces); the façade
(:class:`~jaxkv.core.manager.KVCacheManager`) talks to it only.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from jaxkv.core.evicted_hashes import EvictedHashes
from jaxkv.core.pool import NULL_BLOCK, AllBlocksCleared, BlockPool, KVCacheEvent, ReuseListener
from jaxkv.core.single_type import (
    NEVER,
    CacheHit,
    FullAttentionManager,
    MambaManager,
    SingleTypeManager,
    StatePoolManager,
    manager_class_for,
)
from jaxkv.core.state_checkpoints import num_states
from jaxkv.core.state_retention import CheckpointRetention
from jaxkv.errors import JaxkvError
from jaxkv.planner import KVCacheConfig, KVCacheGroup, SharedStates
from jaxkv.specs import KVCacheSpec

RETENTION_RULES = ("vllm", "group_aware")
"""How a hybrid model's unreferenced blocks queue for eviction.

``vllm``: as vLLM v1 (the default; same decisions): blocks join the free queue when
their request frees them, group by group, and window blocks that slide out of span
join it at once, so under memory pressure they go first and take with them the hits
they would have completed. ``group_aware``: the window blocks a hit at one of the
request's *anchors* needs (where its own hit ended, and how far full attention alone
matched: the points a later request sharing the prefix is likely to hit) are retained
while the request runs, evicted only once nothing else is free; when the request ends,
all its blocks of every group queue position by position, last position first, so a
prefix keeps the window blocks that make it a hit."""

RETAINED_SHARE = 0.125
"""The share of the states memory holds that retained junction checkpoints may take
(:meth:`~jaxkv.core.single_type.StatePoolManager.remove_skipped_blocks`)."""


class CoordinatorError(JaxkvError, ValueError):
    """A coordinator option it does not know."""


class PrefixHit(NamedTuple):
    """A prefix-cache lookup: blocks per group, the hit length in tokens, and ``reach``:
    how many tokens full attention alone matched (at least ``length``). With state
    checkpoints, ``reach`` counts past ``length`` only at a *branch point*: where a cached
    chain goes on with other tokens, so later requests are expected to share the prefix
    up to there. A request that extends a cached chain at its end (a chat turn whose
    previous turn's state was evicted) gets ``reach == length``. ``matched``: how many
    tokens full attention alone matched, branch or not (where a hit's misses begin);
    ``diverged``: whether the prompt leaves a cached chain that goes on with other tokens
    (at ``reach``, or at the hit's end), rather than extending one at its end."""

    blocks: tuple[list[int], ...]
    length: int
    reach: int
    matched: int
    diverged: bool


@dataclass(frozen=True)
class AttentionType:
    """Groups searched together: same manager rules, spec and block size."""

    manager_cls: type[SingleTypeManager]
    spec: KVCacheSpec
    block_size: int
    group_ids: tuple[int, ...]
    hash_stride: int


def _hashes_of_type(t: AttentionType, block_hashes: Sequence[bytes]) -> Sequence[bytes]:
    """The chained hashes at ``t``'s block granularity. The one place that knows a group
    whose block is ``k`` hash blocks long uses every ``k``-th hash (a chained hash names
    the whole prefix up to its end)."""
    stride = t.hash_stride
    return block_hashes if stride == 1 else block_hashes[stride - 1 :: stride]


def _take_runs(managers: Sequence[SingleTypeManager]) -> list[tuple[BlockPool | None, list[SingleTypeManager]]]:
    """The managers in group order, cut into runs that take fresh blocks from one pool
    the plain way (one take serves the whole run, handing each group its blocks in the
    order separate takes would): ``(pool, run)``, or ``(None, [manager])`` for a manager
    with an allocation rule of its own (a recurrent state)."""
    runs: list[tuple[BlockPool | None, list[SingleTypeManager]]] = []
    for m in managers:
        if type(m).allocate_new_blocks is not SingleTypeManager.allocate_new_blocks:
            runs.append((None, [m]))
        elif runs and runs[-1][0] is m.pool:
            runs[-1][1].append(m)
        else:
            runs.append((m.pool, [m]))
    return runs


def _split_at_resets(events: list[KVCacheEvent]) -> list[list[KVCacheEvent]]:
    """One pool's events cut at its :class:`AllBlocksCleared` markers (dropped): the runs
    before, between and after its resets."""
    runs: list[list[KVCacheEvent]] = [[]]
    for e in events:
        if isinstance(e, AllBlocksCleared):
            runs.append([])
        else:
            runs[-1].append(e)
    return runs


class KVCacheCoordinator:
    """Runs each operation over every group of a config, on the block pool(s) it owns:
    ``pool`` for attention blocks and ``state_pool`` (None without the state-pool
    layout) for the recurrent groups' state rows."""

    def __init__(self, config: KVCacheConfig, *, enable_events: bool = False, retention: str = "vllm") -> None:
        if retention not in RETENTION_RULES:
            raise CoordinatorError(f"unknown retention {retention!r}; valid: {', '.join(RETENTION_RULES)}")
        self.retention = retention
        groups = config.groups
        self.pool = BlockPool(config.num_blocks, len(groups), enable_events=enable_events)
        self.state_pool = (
            None
            if config.state_pool is None
            else BlockPool(config.state_pool.num_states, len(groups), enable_events=enable_events)
        )
        self.pools = (self.pool,) if self.state_pool is None else (self.pool, self.state_pool)
        state_groups = set(config.state_group_ids)
        shared = config.shared_states
        self.managers: list[SingleTypeManager] = [
            self._state_manager(i, g, shared)
            if i in state_groups
            else manager_class_for(g.spec)(self.pool, i, g.block_size, g.spec)
            for i, g in enumerate(groups)
        ]
        self._take_runs = _take_runs(self.managers)
        self._skipping_managers = [m for m in self.managers if m.skips_blocks]
        self._state_managers = [m for m in self.managers if isinstance(m, StatePoolManager)]
        self._state_pool_indices = [self.pools.index(m.pool) for m in self._state_managers]
        self._attention_managers = [m for m in self.managers if not isinstance(m, StatePoolManager)]
        self._retention: CheckpointRetention | None = None
        if self._state_managers:
            self._retention = CheckpointRetention(
                self.pool,
                self._state_managers[0].pool,
                [m.group_id for m in self._attention_managers if m.block_size == config.hash_block_size],
                [m.group_id for m in self._state_managers],
            )
            self.pool.add_reuse_listener(self._retention.on_evict)
            # Junction checkpoints that served many hits, held back from eviction while the free queue lasts.
            for state_manager in self._state_managers:
                state_manager.max_retained = int(RETAINED_SHARE * num_states(config))
        # The config guarantees every block size is a multiple of the smallest.
        self.hash_block_size = config.hash_block_size
        self.lcm_block_size = math.lcm(*(g.block_size for g in groups))
        for m in self.managers:
            m.hit_alignment = self.lcm_block_size
        by_key: dict[tuple[type[SingleTypeManager], KVCacheSpec, int], list[int]] = {}
        for i, (g, m) in enumerate(zip(groups, self.managers, strict=True)):
            by_key.setdefault((type(m), g.spec, g.block_size), []).append(i)
        types = [
            AttentionType(cls, spec, bs, tuple(ids), bs // self.hash_block_size)
            for (cls, spec, bs), ids in by_key.items()
        ]
        # Full attention first: its hits are prefix-closed, so it bounds the rest early.
        types.sort(key=lambda t: t.manager_cls is not FullAttentionManager)
        self.types = types
        self._typed_managers = [[self.managers[g] for g in t.group_ids] for t in types]
        # (manager, the groups its counts answer for, its pool's index): one per type where
        # the groups of a type hold alike counts, else one per group.
        self._counting: list[tuple[SingleTypeManager, list[SingleTypeManager], int]] = []
        for ms in self._typed_managers:
            for alike in [ms] if ms[0].counts_alike_within_type else [[m] for m in ms]:
                self._counting.append((alike[0], alike, self.pools.index(alike[0].pool)))
        self._counting_managers = [m for m, _, _ in self._counting]
        self._maps = [self.managers[t.group_ids[0]].pool.hash_maps(t.group_ids) for t in types]
        self._has_state_types = any(issubclass(t.manager_cls, MambaManager) for t in types)
        # Full attention's evicted hashes (its hits bound every other group's), to count evicted misses.
        self._evicted: EvictedHashes | None = None
        if types[0].manager_cls is FullAttentionManager:
            self._evicted = EvictedHashes(types[0].group_ids[0], config.num_blocks)
            self.pool.track_evictions(self._evicted)

    def _state_manager(self, group_id: int, group: KVCacheGroup, shared: SharedStates | None) -> StatePoolManager:
        """The manager of a state group: its states are pages of the shared pool, or rows of the state pool."""
        if shared is not None:
            return StatePoolManager(self.pool, group_id, group.block_size, group.spec, shared.pages_per_state)
        assert self.state_pool is not None  # a plan's state groups without shared states have a state pool
        return StatePoolManager(self.state_pool, group_id, group.block_size, group.spec)

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    # ------------------------------------------------------------- the pool
    @property
    def num_free_blocks(self) -> int:
        """Free attention blocks (state rows: :attr:`num_free_states`)."""
        return self.pool.num_free_blocks

    @property
    def num_free_states(self) -> int | None:
        """Free state rows of the state pool (None without one)."""
        return None if self.state_pool is None else self.state_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_evictions(self) -> int:
        """The pools' eviction count: a hit found at count N is intact while it is N."""
        if self.state_pool is None:
            return self.pool.num_evictions
        return self.pool.num_evictions + self.state_pool.num_evictions

    def take_events(self) -> list[KVCacheEvent]:
        """Events of every pool (each names its group), in order around resets: a reset
        clears all pools at once, so each pool's events before it come first, then one
        :class:`AllBlocksCleared`, then what each pool did after it."""
        runs = [_split_at_resets(p.take_events()) for p in self.pools]
        events: list[KVCacheEvent] = []
        for i, parts in enumerate(zip(*runs, strict=True)):
            if i:
                events.append(AllBlocksCleared())
            events.extend(e for part in parts for e in part)
        return events

    def evict_blocks(self, block_ids: Sequence[int], group: int | None = None) -> int:
        """Drop the cached hashes of these blocks: attention blocks, or ``group``'s (state rows
        for a state-pool group)."""
        pool = self.pool if group is None else self.managers[group].pool
        return pool.evict_blocks(block_ids)

    def is_cached_as(self, group: int, block_id: int, block_hash: bytes) -> bool:
        """Whether ``group``'s block (or state row) is cached under ``block_hash``."""
        return self.managers[group].pool.is_cached_as(block_id, group, block_hash)

    def written_block(self, group: int, block_hash: bytes) -> int | None:
        """``group``'s block (a state row for a state-pool group) cached as ``block_hash``, its data written."""
        return self.managers[group].pool.written_block(group, block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every pool's cache; refused (False, nothing changed) while any block is in use."""
        if any(p.num_free_blocks != p.num_blocks - 1 for p in self.pools):
            return False
        return all([p.reset_prefix_cache() for p in self.pools])

    def add_reuse_listener(self, listener: ReuseListener) -> None:
        """Listen to cached blocks and state checkpoints about to be reused (the group says which)."""
        for p in self.pools:
            p.add_reuse_listener(listener)

    def remove_reuse_listener(self, listener: ReuseListener) -> None:
        for p in self.pools:
            p.remove_reuse_listener(listener)

    @contextlib.contextmanager
    def journal(self) -> Iterator[None]:
        """Blocks cached inside the scope, in every pool, lose their hashes if it exits by an exception."""
        for p in self.pools:
            p.begin_journal()
        try:
            yield
        except BaseException:
            for p in self.pools:
                p.rollback_journal()
            raise
        for p in self.pools:
            p.commit_journal()

    def group_ids_of(self, manager_cls: type[SingleTypeManager]) -> list[int]:
        """Groups whose cache rules are ``manager_cls``'s (or a subclass's)."""
        return [m.group_id for m in self.managers if isinstance(m, manager_cls)]

    def typed_hashes(self, block_hashes: Sequence[bytes]) -> Iterator[tuple[AttentionType, Sequence[bytes]]]:
        """Each attention type with the chained hashes at its block granularity."""
        for t in self.types:
            yield t, _hashes_of_type(t, block_hashes)

    def hashes_per_group(self, block_hashes: Sequence[bytes]) -> list[Sequence[bytes]]:
        """The chained hashes at each group's block granularity, indexed by group id."""
        out: list[Sequence[bytes]] = [()] * self.num_groups
        for t, hashes in self.typed_hashes(block_hashes):
            for g in t.group_ids:
                out[g] = hashes
        return out

    def needed_blocks(self, group: int, start: int, end: int) -> range:
        """Block indices of ``group`` covering tokens ``[start, end)`` that later tokens
        still need once ``end`` tokens are computed (a window group drops older ones)."""
        m = self.managers[group]
        bs = m.block_size
        return range(max(start // bs, m.num_skipped_tokens(end) // bs), end // bs)

    # ------------------------------------------------------------------ hits
    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int) -> PrefixHit:
        """The longest prefix (tokens) every group can serve, and its blocks per group.

        A state checkpoint cached in the step still open (a journaled block) does not
        count: the step writes it at the end of each recurrent layer, after a request
        admitted in the same step would read it (attention blocks do count: every layer
        writes the step's KV before it attends)."""
        lcm = self.lcm_block_size
        length = max_length // lcm * lcm
        typed = [_hashes_of_type(t, block_hashes) for t in self.types]
        found: list[CacheHit] = [CacheHit(0, 0, [])] * len(typed)
        reach = None
        first_pass = changed = True
        while changed:
            changed = False
            for t_idx, t in enumerate(self.types):
                hashes = typed[t_idx]
                num_blocks = length // t.block_size
                last = found[t_idx]
                if not first_pass and last.num_blocks == num_blocks:  # still exact: a search would repeat it
                    hit = last
                elif not first_pass and t.manager_cls.hits_are_prefixes:  # length only shrinks
                    hit = CacheHit(num_blocks, 0, [ids[:num_blocks] for ids in last.block_ids])
                else:
                    hit = t.manager_cls.find_longest_cache_hit(
                        self._maps[t_idx], hashes, num_blocks, t.spec, t.block_size
                    )
                found[t_idx] = hit
                if reach is None and t.manager_cls is FullAttentionManager:
                    reach = hit.num_blocks * t.block_size
                if hit.num_blocks * t.block_size < length:
                    length = hit.num_blocks * t.block_size // lcm * lcm
                    changed = len(typed) > 1
            first_pass = False
            if not changed and length and self._has_state_types and self._unwritten_state(found):
                length -= lcm
                changed = True
        # The last pass ran every search at the final length, so each hit is exact.
        blocks: list[list[int]] = [[] for _ in self.managers]
        if length:
            for t, hit in zip(self.types, found, strict=True):
                for g, ids in zip(t.group_ids, hit.block_ids, strict=True):
                    blocks[g] = [0] * hit.first_real + ids if hit.first_real else ids
        matched = length if reach is None else reach
        retention = self._retention
        if reach is None or (
            reach > length
            and retention is not None
            and not retention.branches_after(block_hashes[reach // self.hash_block_size - 1])
        ):
            reach = length
        diverged = reach > length or bool(
            length
            and retention is not None
            and retention.branches_after(block_hashes[length // self.hash_block_size - 1])
        )
        return PrefixHit(tuple(blocks), length, reach, matched, diverged)

    def evicted_tokens(self, block_hashes: Sequence[bytes], matched: int, limit: int) -> int:
        """Of the tokens from ``matched`` (where full attention's hit ended) to ``limit``, how
        many lead on from it through blocks that were cached and evicted (0 without full attention)."""
        evicted = self._evicted
        if evicted is None or matched >= limit:
            return 0
        t = self.types[0]
        bs = t.block_size
        return min(evicted.run(_hashes_of_type(t, block_hashes), matched // bs, limit // bs) * bs, limit - matched)

    def extends_chain(self, block_hashes: Sequence[bytes], matched: int) -> bool | None:
        """Whether a prompt whose full attention matched ``matched`` tokens of ``block_hashes``
        extends a cached chain at its end (no cached attention block goes on past there, as a
        chat turn resumes its previous turn) rather than leaving it; None when it matched
        nothing or the model has no state checkpoints. Full attention's match alone decides,
        so whether states were kept does not feed back into it."""
        retention = self._retention
        if not matched or retention is None:
            return None
        return not retention.branches_after(block_hashes[matched // self.hash_block_size - 1])

    def full_attention_hit(self, block_hashes: Sequence[bytes], limit: int) -> int:
        """Tokens full attention alone has cached from the start of the chain ``block_hashes``,
        at most ``limit`` (0 without full attention)."""
        t = self.types[0]
        if t.manager_cls is not FullAttentionManager:
            return 0
        hashes = _hashes_of_type(t, block_hashes)
        hit = FullAttentionManager.find_longest_cache_hit(
            self._maps[0], hashes, limit // t.block_size, t.spec, t.block_size
        )
        return hit.num_blocks * t.block_size

    def _unwritten_state(self, found: Sequence[CacheHit]) -> bool:
        """Whether a recurrent group's hit ends on a state the open step has yet to write."""
        return any(
            ids and self.managers[g].pool.is_journaled(ids[-1])
            for t, hit in zip(self.types, found, strict=True)
            if issubclass(t.manager_cls, MambaManager)
            for g, ids in zip(t.group_ids, hit.block_ids, strict=True)
        )

    def invalid_hit_block(
        self, block_hashes: Sequence[bytes], hit_blocks: Sequence[Sequence[int]]
    ) -> tuple[int, object] | None:
        """The first ``(group, block)`` of a hit that this request cannot use, or None.

        A usable hit has, in each group, null blocks where the group's span no longer
        reaches and, from there on, in-range blocks cached under the request's own
        chained hash at their position (so another request's or tenant's hit, an
        uncached or evicted block and a repeated block all fail)."""
        for t, hashes in self.typed_hashes(block_hashes):
            for g in t.group_ids:
                is_cached = self.managers[g].pool.is_cached_as
                blocks = hit_blocks[g]
                if len(blocks) > len(hashes):
                    return g, blocks[len(hashes)]
                first = self.needed_blocks(g, 0, len(blocks) * t.block_size).start
                for i, b in enumerate(blocks):
                    if (b != NULL_BLOCK) if i < first else not is_cached(b, g, hashes[i]):
                        return g, b
        return None

    # ------------------------------------------------------------ allocation
    def can_allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[Sequence[int]] | None,
        num_computed_tokens: int,
    ) -> bool:
        """Whether every pool has the net free blocks the allocation consumes: new
        blocks, plus hits on free (evictable) blocks, minus blocks that skipping
        out-of-span ones returns, minus the fresh states a short pool spares by writing
        over checkpoints only this request holds (see :meth:`allocate`)."""
        needed = [0] * len(self.pools)
        hit_lists: list[tuple[SingleTypeManager, Sequence[int], int]] = []
        for m, alike, k in self._counting:
            num_hits = 0
            hits: Sequence[int] = ()
            if hit_blocks and hit_blocks[m.group_id]:
                hits = hit_blocks[m.group_id]
                num_hits = len(hits)
                hit_lists.extend((a, hit_blocks[a.group_id], k) for a in alike)
            n = m.num_new_blocks(request_id, num_tokens, num_hits) * len(alike)
            if n and isinstance(m, StatePoolManager) and m.can_overwrite_checkpoint(request_id, hits):
                n = 0  # the bound with every such checkpoint overwritten; allocate overwrites only what it must
            if m.skips_blocks:
                skippable = m.skippable_blocks(request_id, num_computed_tokens)
                if skippable:  # then as many fell out of span in each alike group
                    pool = m.pool
                    n -= pool.count_newly_freed(skippable) + sum(
                        pool.count_newly_freed(a.skippable_blocks(request_id, num_computed_tokens)) for a in alike[1:]
                    )
            needed[k] += n * m.pages_per_block
        free = [p.num_free_blocks for p in self.pools]
        if any(map(operator.gt, needed, free)):
            return False
        if not hit_lists:
            return True
        # Hits on free blocks use them up too: count those only when the bounds (none or
        # all of them free) leave the answer open.
        most = needed.copy()
        for m, hits, k in hit_lists:
            most[k] += len(hits) * m.pages_per_block
        if not any(map(operator.gt, most, free)):
            return True
        for m, hits, k in hit_lists:
            needed[k] += m.pool.count_evictable(hits) * m.pages_per_block
        return not any(map(operator.gt, needed, free))

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        hit_blocks: Sequence[Sequence[int]] | None,
        num_computed_tokens: int,
    ) -> tuple[list[int], ...]:
        """Skip out-of-span blocks, adopt hit blocks, then take fresh ones; return the fresh ones.

        A recurrent group whose next state needs a fresh unit takes one while its pool
        has enough free blocks (a free block may be a cached one, evicted in LRU order);
        when the pool is short, the request's own checkpoint goes first: the state is
        written over it (it leaves the prefix cache), so a running request needs no more
        than its live state per group (the count the planner plans with)."""
        self.remove_skipped_blocks(request_id, num_computed_tokens)
        if hit_blocks:
            for m, hits in zip(self.managers, hit_blocks, strict=True):
                m.pool.touch(hits)
                m.add_hit_blocks(request_id, hits)
        if self._state_managers:
            self._overwrite_checkpoints_if_short(request_id, num_tokens)
        new: list[list[int]] = []
        for pool, run in self._take_runs:
            if pool is None or len(run) == 1:
                new.extend(m.allocate_new_blocks(request_id, num_tokens) for m in run)
                continue
            counts = [m.num_new_blocks(request_id, num_tokens, 0) for m in run]
            total = sum(counts)
            taken = pool.get_new_blocks(total) if total else []
            start = 0
            for m, n in zip(run, counts, strict=True):
                blocks = taken[start : start + n]
                start += n
                m.add_new_blocks(request_id, blocks)
                new.append(blocks)
        return tuple(new)

    def _overwrite_checkpoints_if_short(self, request_id: str, num_tokens: int) -> None:
        """Where a pool lacks the free blocks this allocation takes, write the request's
        next states over the checkpoints only it holds, group by group, until it has them;
        a checkpoint at its prompt's resend position or end is written over already where
        keeping it would evict a cached block (its next continuation supersedes it)."""
        need = [0] * len(self.pools)
        for m, alike, k in self._counting:
            need[k] += m.num_new_blocks(request_id, num_tokens, 0) * len(alike) * m.pages_per_block
        for m, k in zip(self._state_managers, self._state_pool_indices, strict=True):
            room = m.pool.num_empty_free_blocks if m.holds_prompt_checkpoint(request_id) else m.pool.num_free_blocks
            if (
                need[k] > room
                and m.num_new_blocks(request_id, num_tokens, 0)
                and m.can_overwrite_checkpoint(request_id, ())
            ):
                m.overwrite_checkpoint(request_id)
                need[k] -= m.pages_per_block

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free the request's blocks that fell out of span in every group (an allocation
        that needs no fresh block does only this)."""
        for m in self._skipping_managers:
            m.remove_skipped_blocks(request_id, num_computed_tokens)

    def cache_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        token_ids: Sequence[int],
        lora_name: str | None,
    ) -> None:
        """Offer every group's newly full blocks to the prefix cache (with a state pool,
        recording the attention chains that its retention follows). With groups of
        different block sizes only blocks up to the last lcm boundary are offered (as
        vLLM does): a hit ends on one, so a block past it would serve none yet."""
        num_tokens = num_tokens // self.lcm_block_size * self.lcm_block_size
        retention = self._retention
        for t, typed in zip(self.types, self._typed_managers, strict=True):
            first = typed[0]
            if first.counts_alike_within_type and num_tokens // t.block_size <= first.num_cached.get(request_id, 0):
                continue  # no group of this type has a newly full block
            hashes = _hashes_of_type(t, block_hashes)
            for m in typed:
                start = m.num_cached.get(request_id, 0)
                m.cache_blocks(request_id, hashes, num_tokens, token_ids, lora_name)
                if retention is not None:
                    end = m.num_cached.get(request_id, 0)
                    retention.record(m.group_id, m.req_blocks[request_id], hashes, start, end)

    @contextlib.contextmanager
    def caching_late(self) -> Iterator[None]:
        """Blocks cached inside the scope were computed by steps dispatched before the open
        one and their hashes became known only now (the overlapped loop reads a drawn token
        back one step after the step that fed it): cached as written in an open journal,
        dropped if it rolls back (see :meth:`~jaxkv.core.pool.BlockPool.caching_late`)."""
        with contextlib.ExitStack() as scope:
            for p in self.pools:
                scope.enter_context(p.caching_late())
            yield

    def thresholds(self, request_id: str) -> tuple[int, int, int]:
        """The request's next event thresholds (after a real allocation): its slot
        capacity, the tokens at which a block becomes full, the computed tokens at which
        a block falls out of span. Below all three an allocation changes nothing, which
        is what most decode steps are."""
        return self.capacity(request_id), self.next_full(request_id), self.next_skip(request_id)

    def capacity(self, request_id: str) -> int:
        """Tokens the request's blocks have slots for (the fewest over the groups)."""
        return min(len(m.req_blocks[request_id]) * m.block_size for m in self._counting_managers)

    def next_skip(self, request_id: str) -> int:
        """Computed tokens at which a block of some group falls out of span."""
        return min((m.next_skip_computed(request_id) for m in self._counting_managers if m.skips_blocks), default=NEVER)

    def next_full(self, request_id: str) -> int:
        """Tokens at which caching would offer another block (an lcm multiple)."""
        lcm = self.lcm_block_size
        return -(-min(m.next_cache_tokens(request_id) for m in self._counting_managers) // lcm) * lcm

    def set_anchors(self, request_id: str, anchors: Sequence[int]) -> None:
        """Under ``group_aware`` retention, the request's anchors (token positions) in
        every group that drops blocks out of span; a no-op under ``vllm``."""
        if self.retention == "group_aware":
            for m in self.managers:
                if m.skips_blocks:
                    m.set_anchors(request_id, anchors)

    def set_checkpoints(
        self,
        request_id: str,
        shared: Iterable[int],
        num_prompt_tokens: int,
        *,
        warm_continuation: bool = True,
        guesses: Iterable[int] = (),
    ) -> None:
        """The request's state checkpoint positions (``guesses``: those only hits ending on
        them keep warm), and whether its newest continuation stays warm while it runs (see
        :meth:`~jaxkv.core.single_type.StatePoolManager.set_checkpoints`); a no-op without a
        state pool."""
        for m in self._state_managers:
            m.set_checkpoints(
                request_id, shared, num_prompt_tokens, warm_continuation=warm_continuation, guesses=guesses
            )

    def free(self, request_id: str) -> None:
        """Release the request's blocks in every group, in one pass over each pool; the
        shared state checkpoints it cached are requeued as recently used, a cold request's
        last continuation (see :meth:`StatePoolManager.cold_continuation`) is demoted."""
        managers = self._attention_managers
        if self.retention == "group_aware":
            entries = [e for m in managers for e in m.release_by_position(request_id)]
            entries.sort(key=lambda e: -e[0])  # last position first; stable: group order within one
            self.pool.free_in_order((b, retained) for _, b, retained in entries)
        elif len(managers) == 1:
            self.pool.free_blocks(managers[0].release(request_id))
        else:
            self.pool.free_block_lists([m.release(request_id) for m in managers])
        if self._state_managers:
            states = self._state_managers
            shared = [b for m in states for b in m.shared_checkpoints(request_id)]
            cold = [b for m in states for b in m.cold_continuation(request_id)]
            pool = states[0].pool
            pool.free_block_lists([m.release(request_id) for m in states])
            if shared:
                pool.promote(shared)
            if cold:
                pool.demote(cold)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Copies of the request's block lists, one per group."""
        return tuple(list(m.req_blocks.get(request_id, ())) for m in self.managers)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.managers[0].req_blocks
