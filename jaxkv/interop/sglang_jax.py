"""sglang-jax's prefix-cache seam (``BasePrefixCache`` and its token allocator) over jaxkv's manager.

sglang-jax's scheduler talks to a radix tree of per-token KV slots (``match_prefix``,
``inc_lock_ref`` / ``dec_lock_ref``, ``cache_unfinished_req``, ``cache_finished_req``,
``evict``, the size counters) and takes the slots of new tokens from a separate allocator.
:class:`JaxkvPrefixCache` answers the same calls with the same names and result fields from
a :class:`~jaxkv.core.KVCacheManager`, so its blocks, hashes, LRU order and hybrid rules
(sliding window, recurrent checkpoints) decide; the allocator is :meth:`JaxkvPrefixCache.alloc`,
because a jaxkv block belongs to a request. A token's slot is
``block_id * block_size + offset`` in the primary (first full-attention) group; every
group's slots come from :meth:`JaxkvPrefixCache.group_slots`.

It imports nothing of sglang-jax: their params objects are read by attribute
(``params.key.token_ids``, ``params.key.extra_key``, ``params.num_tokens``...) and their
``Req`` by the fields their scheduler keeps (``rid``, ``origin_input_ids``, ``output_ids``,
``extra_key``; the cache writes ``prefix_indices``, ``last_node``, ``cache_protected_len``,
``last_matched_prefix_len`` back, as their radix caches do). Where the semantics differ
(whole blocks, not single tokens; a bare match refreshes no LRU; ``reset`` refused while
blocks are held), the docstrings say so and ``tests/test_interop_sglang_jax.py`` marks it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from jaxkv.core import KVCacheManager, Request
from jaxkv.core.kv_cache_blocks import KVCacheBlocks
from jaxkv.core.pool import BlockPool
from jaxkv.errors import JaxkvError
from jaxkv.specs import MambaSpec, SlidingWindowSpec

__all__ = [
    "EvictResult",
    "IncLockRefResult",
    "JaxkvPrefixCache",
    "MatchResult",
    "PrefixNode",
    "SglangJaxAdapterError",
    "token_slots",
]


class SglangJaxAdapterError(JaxkvError, ValueError):
    """A call the sglang-jax adapter refuses (the message names the value); nothing changed."""


@dataclass(eq=False)
class PrefixNode:
    """What sglang-jax calls a tree node: a cached prefix of ``length`` tokens.

    A hit's node carries its blocks and the request that found them (a lock makes that
    request adopt them, so they cannot be evicted); a request's node (``owner`` set) stands for the blocks the
    request itself holds, so its lock only counts."""

    length: int
    blocks: KVCacheBlocks | None = None
    probe: Request | None = None
    owner: str | None = None
    lock_ref: int = 0
    held: bool = False
    id: int = field(default_factory=itertools.count().__next__)


class MatchResult(NamedTuple):
    """``match_prefix``'s answer, field for field as sglang-jax's (HiCache off: all nodes alike)."""

    device_indices: np.ndarray
    last_device_node: PrefixNode
    last_host_node: PrefixNode
    best_match_node: PrefixNode
    host_hit_length: int = 0
    recurrent_branching_seqlen: int | None = None


@dataclass
class EvictResult:
    """Tokens evicted per pool (full attention, sliding window) and recurrent states evicted."""

    num_tokens_evicted: int = 0
    swa_num_tokens_evicted: int = 0
    recurrent_num_evicted: int = 0


@dataclass
class IncLockRefResult:
    """``inc_lock_ref``'s answer: ``delta`` is minus the tokens that stopped being evictable."""

    delta: int | None = None
    swa_uuid_for_lock: int | None = None
    skip_lock_node_ids: dict[int, Any] = field(default_factory=dict)


def token_slots(block_ids: Sequence[int], block_size: int, start: int, end: int) -> np.ndarray:
    """The KV slots (``block_id * block_size + offset``) of tokens ``[start, end)`` as int32."""
    if end - start <= 8:  # a decode step: plain Python beats numpy's per-call overhead
        return np.array([block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)], np.int32)
    pos = np.arange(start, end, dtype=np.int64)
    ids = np.asarray(block_ids, dtype=np.int64)
    return (ids[pos // block_size] * block_size + pos % block_size).astype(np.int32)


def _salt(holder: Any) -> str | None:
    """The cache salt of a ``RadixKey`` or ``Req``: its ``extra_key`` and ``dp_rank`` both
    separate namespaces, as in sglang-jax's tree keys."""
    extra, rank = getattr(holder, "extra_key", None), getattr(holder, "dp_rank", None)
    return None if extra is None and rank is None else repr((extra, rank))


def _key(key: Any) -> tuple[list[int], str | None]:
    """Token ids and cache salt of a ``RadixKey`` (or a plain token list)."""
    return list(getattr(key, "token_ids", key)), _salt(key)


class JaxkvPrefixCache:
    """``BasePrefixCache``-shaped prefix cache (and token allocator) backed by ``manager``.

    ``page_size`` is the manager's hit granularity (its lcm block size): jaxkv caches
    and matches whole blocks, so with ``page_size`` 1 it matches token by token as
    sglang-jax's ``RadixCache`` does, and above it as their paged tree does."""

    def __init__(self, manager: KVCacheManager, *, disable: bool = False) -> None:
        if not isinstance(manager, KVCacheManager):
            raise SglangJaxAdapterError(f"manager must be a KVCacheManager, got {manager!r:.80}")
        self.manager = manager
        self.disable = disable or not manager.enable_caching
        self.page_size = manager.lcm_block_size
        specs = [g.spec for g in manager.config.groups]
        self._primary = next(i for i, s in enumerate(specs) if not isinstance(s, (SlidingWindowSpec, MambaSpec)))
        self._swa = [i for i, s in enumerate(specs) if isinstance(s, SlidingWindowSpec)]
        self._recurrent = manager.recurrent_group_ids()
        self._requests: dict[str, Request] = {}
        self._pending: dict[str, Request] = {}
        self._ids = itertools.count()
        self.root_node = PrefixNode(0, lock_ref=1)

    # ------------------------------------------------------------------ lookups
    def match_prefix(self, params: Any) -> MatchResult:
        """The longest cached prefix of ``params.key`` (up to all of it, page aligned):
        its primary-group slots and its node. Unlike a radix tree, a lookup refreshes no
        LRU position (jaxkv's order changes when a request takes or frees blocks)."""
        tokens, salt = _key(params.key)
        node = self.root_node
        if not self.disable and tokens:
            # One token past the key, so the manager's "leave the last token" cap allows all of
            # it; the probe holds the hit if the node is locked (hashed once, trusted in O(1)).
            probe = Request(f"sglang-jax-match-{next(self._ids)}", [*tokens, tokens[-1]], cache_salt=salt)
            blocks, n = self.manager.get_computed_blocks(probe)
            if n:
                node = PrefixNode(n, blocks, probe)
        return MatchResult(self._node_slots(node), node, node, node)

    def _node_slots(self, node: PrefixNode, group: int | None = None) -> np.ndarray:
        g = self._primary if group is None else group
        if node.owner is not None:
            ids: Sequence[int] = self.manager.get_block_ids(node.owner)[g]
        elif node.blocks is not None:
            ids = node.blocks.blocks[g]
        else:
            return np.empty((0,), dtype=np.int32)
        return token_slots(ids, self.manager.block_sizes[g], 0, node.length)

    def group_slots(self, req: Any, group: int, start: int = 0, end: int | None = None) -> np.ndarray:
        """A running request's slots of tokens ``[start, end)`` in ``group`` (default: all it
        has computed); 0 (the null block's first slot) where a window no longer keeps a block."""
        jreq = self._request(req)
        stop = jreq.num_computed_tokens if end is None else end
        return token_slots(
            self.manager.get_block_ids(jreq.request_id)[group], self.manager.block_sizes[group], start, stop
        )

    # -------------------------------------------------------------- lock refs
    def inc_lock_ref(self, node: PrefixNode) -> IncLockRefResult:
        """Protect ``node``'s blocks from eviction (on the first lock, the request that
        found a hit adopts its blocks); ``delta`` is minus the tokens that stop being evictable."""
        if self.disable or node is self.root_node or node.length == 0:
            return IncLockRefResult(delta=0)
        delta = 0
        if node.lock_ref == 0 and node.probe is not None:
            assert node.blocks is not None
            pool = self.manager.pool
            delta = -self.page_size * sum(1 for b in node.blocks.blocks[self._primary] if b and pool.ref_count(b) == 0)
            if self.manager.allocate_slots(node.probe, 0, node.length, node.blocks) is None:
                raise SglangJaxAdapterError(f"no room to lock the {node.length}-token prefix of node {node.id}")
            node.held = True
        node.lock_ref += 1
        return IncLockRefResult(delta=delta)

    def dec_lock_ref(self, node: PrefixNode, params: Any = None) -> int:
        """Undo one :meth:`inc_lock_ref`; the last one frees that request, so the blocks
        become evictable again. Returns the tokens that did."""
        if self.disable or node is self.root_node or node.length == 0:
            return 0
        if node.lock_ref <= 0:
            raise SglangJaxAdapterError(f"node {node.id} is not locked (lock_ref={node.lock_ref})")
        node.lock_ref -= 1
        if node.lock_ref or not node.held:
            return 0
        node.held = False
        assert node.probe is not None
        self.manager.free(node.probe.request_id)
        pool = self.manager.pool
        assert node.blocks is not None
        return self.page_size * sum(1 for b in node.blocks.blocks[self._primary] if b and pool.ref_count(b) == 0)

    # ------------------------------------------------------- the request path
    def _request(self, req: Any) -> Request:
        jreq = self._requests.get(req.rid)
        if jreq is None:
            raise SglangJaxAdapterError(f"request {req.rid!r} holds no slots here")
        return jreq

    def _admission(self, req: Any) -> Request:
        """The jaxkv request of a ``req`` that holds nothing yet, kept until it is admitted;
        with recurrent groups looked up in the prefix cache (which sets where its
        checkpoints fall)."""
        jreq = self._pending.get(req.rid)
        if jreq is None:
            jreq = Request(req.rid, list(req.origin_input_ids), cache_salt=_salt(req))
            if self._recurrent:
                self.manager.get_computed_blocks(jreq)
            self._pending[req.rid] = jreq
        return jreq

    def alloc(self, req: Any, num_tokens: int) -> np.ndarray | None:
        """The slots of ``req``'s next ``num_tokens`` tokens (a prefill chunk, or 1 for a
        decode token): what sglang-jax's ``alloc_for_extend`` / ``alloc_for_decode`` take
        from their allocator. A new request adopts the hit of its ``last_node`` (from
        :meth:`match_prefix`). Output tokens appended to ``req.output_ids`` since the last
        call join first. Returns None, changing nothing, when the pool cannot serve it
        (jaxkv has evicted what it could already: the caller retracts a request)."""
        jreq = self._requests.get(req.rid)
        if jreq is None:
            jreq = self._admission(req)
            node = getattr(req, "last_node", None)
            hit = node.blocks if isinstance(node, PrefixNode) and node.owner is None else None
            n = node.length if isinstance(node, PrefixNode) and hit is not None else 0
            if self.manager.allocate_slots(jreq, num_tokens, n, hit) is None:
                return None
            del self._pending[req.rid]
            self._requests[req.rid] = jreq
            jreq.num_computed_tokens = n
        else:
            outputs = req.output_ids
            known = len(jreq.output_token_ids)
            if len(outputs) > known:
                jreq.append_output_token_ids(list(outputs[known:]))
            if self.manager.allocate_slots(jreq, num_tokens) is None:
                return None
        start = jreq.num_computed_tokens
        jreq.num_computed_tokens += num_tokens
        ids = self.manager.get_block_ids(req.rid)[self._primary]
        return token_slots(ids, self.manager.block_sizes[self._primary], start, start + num_tokens)

    def chunk_limit(self, req: Any, num_tokens: int) -> int:
        """``num_tokens`` cut so a prefill chunk ends where the recurrent state must be
        cached (jaxkv's :meth:`~jaxkv.core.KVCacheManager.chunk_limit`; unchanged
        without recurrent groups). The first chunk starts after ``req.last_node``'s hit."""
        jreq = self._requests.get(req.rid)
        if jreq is not None:
            start = jreq.num_computed_tokens
        else:
            jreq = self._admission(req)
            node = getattr(req, "last_node", None)
            start = node.length if isinstance(node, PrefixNode) and node.owner is None else 0
        return self.manager.chunk_limit(jreq, start, num_tokens)

    def cache_unfinished_req(self, req: Any, **kwargs: Any) -> None:
        """After a prefill chunk: the computed full blocks are in the prefix cache already
        (jaxkv caches them when it hands them out), so this moves the request's lock onto
        its own node and writes ``prefix_indices`` (all computed slots), ``last_node`` and
        the protected length back, as sglang-jax's radix cache does."""
        if self.disable:
            return
        jreq = self._request(req)
        computed = jreq.num_computed_tokens
        aligned = computed // self.page_size * self.page_size
        node = PrefixNode(aligned, owner=req.rid)
        self.inc_lock_ref(node)
        old = getattr(req, "last_node", None)
        if isinstance(old, PrefixNode):
            self.dec_lock_ref(old)
        req.prefix_indices = self.group_slots(req, self._primary, 0, computed)
        req.last_node = node
        req.cache_protected_len = req.last_matched_prefix_len = aligned

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """A finished (or, ``is_insert=False``, retracted) request frees its blocks; its
        full blocks stay cached (LRU), except on retract, where the blocks it alone held
        past its matched prefix leave the cache too. Releases its lock."""
        self._pending.pop(req.rid, None)
        jreq = self._requests.pop(req.rid, None)
        if jreq is not None:
            drop: list[int] = []
            if not is_insert:
                pool = self.manager.pool
                protected = getattr(req, "cache_protected_len", 0) // self.page_size
                for ids in self.manager.get_block_ids(req.rid):
                    drop.extend(b for b in ids[protected:] if b and pool.ref_count(b) == 1)
            self.manager.free(jreq)
            self.manager.evict_blocks(drop)
        node = getattr(req, "last_node", None)
        if isinstance(node, PrefixNode) and node.lock_ref:
            self.dec_lock_ref(node)

    def insert(self, params: Any) -> int:
        """Cache ``params.key``'s whole blocks (a request computed and finished at once;
        jaxkv picks the slots, so ``params.value`` must be None). Returns the length of the
        part that was cached already."""
        if getattr(params, "value", None) is not None:
            raise SglangJaxAdapterError("insert with a value: jaxkv allocates the slots itself (pass value=None)")
        tokens, salt = _key(params.key)
        if self.disable or not tokens:
            return 0
        jreq = Request(f"sglang-jax-insert-{next(self._ids)}", [*tokens, 0], cache_salt=salt)
        blocks, n = self.manager.get_computed_blocks(jreq)
        if n < len(tokens) and self.manager.allocate_slots(jreq, len(tokens) - n, n, blocks) is None:
            raise SglangJaxAdapterError(f"no room to insert a {len(tokens)}-token key")
        if n < len(tokens):
            self.manager.free(jreq)
        return n

    # ----------------------------------------------------------- eviction, sizes
    def evict(self, params: Any) -> EvictResult:
        """Drop cached, unreferenced blocks in jaxkv's eviction order (the free queue's
        head first) until ``params.num_tokens`` full-attention tokens,
        ``swa_num_tokens`` window tokens and ``recurrent_num`` states are gone."""
        want = {
            "full": getattr(params, "num_tokens", 0),
            "swa": getattr(params, "swa_num_tokens", 0),
            "rec": getattr(params, "recurrent_num", 0),
        }
        got = dict.fromkeys(want, 0)
        for group_of, pool in self._pools():
            drop: dict[int, list[int]] = {}
            for b in pool.free_block_ids():
                g = group_of(b)
                kind = self._kind(g)
                if kind and pool.is_cached(b) and got[kind] < want[kind]:
                    drop.setdefault(g, []).append(b)
                    got[kind] += 1 if kind == "rec" else self.page_size
            for g, ids in drop.items():
                self.manager.evict_group_blocks(g, ids)
        return EvictResult(got["full"], got["swa"], got["rec"])

    def _pools(self) -> list[tuple[Any, BlockPool]]:
        """The manager's pools, each with how to tell a block's group."""
        pool, states = self.manager.pool, self.manager.state_pool
        pools: list[tuple[Any, BlockPool]] = [(pool.block_group.__getitem__, pool)]
        if states is not None:
            pools.append((states.block_group.__getitem__, states))
        return pools

    def _kind(self, group: int) -> str | None:
        if group == self._primary:
            return "full"
        if self._swa and group == self._swa[0]:
            return "swa"
        return "rec" if group in self._recurrent else None

    def _sizes(self) -> dict[tuple[str, bool], int]:
        """Cached tokens per (pool kind, referenced) of the primary and first window group."""
        out = dict.fromkeys(itertools.product(("full", "swa", "rec"), (False, True)), 0)
        for group_of, pool in self._pools():
            for b in range(1, pool.num_blocks):
                kind = self._kind(group_of(b))
                if kind and pool.is_cached(b):
                    out[kind, pool.ref_count(b) > 0] += 1 if kind == "rec" else self.page_size
        return out

    def evictable_size(self, dp_rank: int = 0) -> int:
        return self._sizes()["full", False]

    def protected_size(self, dp_rank: int = 0) -> int:
        return self._sizes()["full", True]

    full_evictable_size = evictable_size

    def full_protected_size(self) -> int:
        return self.protected_size()

    def swa_evictable_size(self, dp_rank: int = 0) -> int:
        return self._sizes()["swa", False]

    def swa_protected_size(self) -> int:
        return self._sizes()["swa", True]

    def total_size(self) -> int:
        """Cached tokens of the primary group (sglang-jax's SWA tree answers a (full, swa) pair)."""
        sizes = self._sizes()
        return sizes["full", False] + sizes["full", True]

    def supports_recurrent(self) -> bool:
        return bool(self._recurrent)

    def reset(self) -> bool:
        """Forget the prefix cache; refused (False) while any request or lock holds blocks."""
        return self.manager.reset_prefix_cache()

    def take_events(self) -> list[Any]:
        """jaxkv's cache events (``BlockStored`` ...), not sglang-jax's event classes."""
        return self.manager.take_events()
