"""EasyDeL eSurge's ``CacheManager`` seam, answered by jaxkv's manager (host side).

eSurge's scheduler (EasyDeL 0.3) drives a port of vLLM's v1 manager: ``get_computed_pages``,
``allocate_slots``, ``free``, ``free_page_hashes``, ``get_page_ids``,
``get_num_common_prefix_pages``, ``reset_prefix_cache``, ``create_empty_page_list``,
``usage`` and ``page_pool.get_num_free_pages()``. :class:`JaxkvCacheManager` has those
names, arguments and returns, over a :class:`~jaxkv.core.KVCacheManager`; page ids are
jaxkv block ids, group by group. eSurge's ``EngineRequest`` is read by attribute
(``request_id``, ``prompt_token_ids``, ``output_token_ids``, ``num_computed_tokens``,
``sampling_params``, ``status``) and mirrored into a jaxkv :class:`~jaxkv.core.Request`.

On one request stream its decisions are eSurge's but one: after a free, jaxkv hands out
freed blocks that were never cached before cached ones (as vLLM does now), where eSurge
queues every freed page at the tail (``tests/test_interop_easydel.py`` shows both). What it
refuses: data-parallel page sharding (``data_parallel_size > 1``), ``delay_cache_pages``
(eSurge's asynchronous KV loads) and EAGLE's ``use_eagle``; eSurge's cache metrics read
``page_pool.cached_page_hash_to_page``, here ``page_pool.num_cached_pages()``.
Nothing of EasyDeL is imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jaxkv.core import KVCacheManager, Request
from jaxkv.core.kv_cache_blocks import KVCacheBlocks
from jaxkv.errors import JaxkvError
from jaxkv.planner import KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

__all__ = ["EasydelAdapterError", "JaxkvCacheManager", "PagePoolView", "Pages", "spec_from_easydel"]


class EasydelAdapterError(JaxkvError, ValueError):
    """A call or configuration the EasyDeL adapter refuses (the message names it); nothing changed."""


@dataclass(frozen=True)
class Pages:
    """eSurge's ``CachePages``: block ids per group (``get_page_ids``), or a cache hit
    handed back to :meth:`JaxkvCacheManager.allocate_slots`."""

    blocks: KVCacheBlocks

    def get_page_ids(self) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self.blocks.blocks)

    def new_empty(self) -> Pages:
        return Pages(KVCacheBlocks(tuple(() for _ in self.blocks.blocks)))

    def __add__(self, other: Pages) -> Pages:
        return Pages(
            KVCacheBlocks(tuple([*a, *b] for a, b in zip(self.blocks.blocks, other.blocks.blocks, strict=True)))
        )


class PagePoolView:
    """The part of eSurge's ``PagePool`` their scheduler reads."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager

    def get_num_free_pages(self) -> int:
        return self._manager.num_free_blocks

    def get_usage(self) -> float:
        return self._manager.usage

    def num_cached_pages(self) -> int:
        return self._manager.pool.num_cached_blocks()


def spec_from_easydel(spec: Any) -> KVCacheSpec:
    """jaxkv's spec for an eSurge attention ``kv_cache_spec`` (full or sliding window);
    their ``MambaSpec`` and chunked-local specs are refused."""
    kind = type(spec).__name__
    window = getattr(spec, "sliding_window", None)
    if kind == "FullAttentionSpec" and window is None:
        return FullAttentionSpec(num_kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size))
    if kind in ("FullAttentionSpec", "SlidingWindowSpec") and window is not None:
        return SlidingWindowSpec(
            num_kv_heads=int(spec.num_kv_heads), head_size=int(spec.head_size), sliding_window=window
        )
    raise EasydelAdapterError(f"eSurge cache spec {kind} has no jaxkv counterpart here: {spec!r:.120}")


class JaxkvCacheManager:
    """eSurge's ``CacheManager`` interface over ``manager`` (which it owns from here on)."""

    def __init__(self, manager: KVCacheManager) -> None:
        if not isinstance(manager, KVCacheManager):
            raise EasydelAdapterError(f"manager must be a KVCacheManager, got {manager!r:.80}")
        self.manager = manager
        self.num_pages = manager.config.num_blocks
        self.max_model_len = manager.max_model_len
        self.enable_caching = manager.enable_caching
        self.page_size = manager.lcm_block_size
        self.num_kv_cache_groups = len(manager.config.groups)
        self.page_pool = PagePoolView(manager)
        self._mirrors: dict[str, Request] = {}

    @classmethod
    def from_easydel(
        cls,
        num_pages: int,
        kv_cache_groups: Sequence[Any],
        max_model_len: int,
        enable_caching: bool = True,
        use_eagle: bool = False,
    ) -> JaxkvCacheManager:
        """Built from the arguments eSurge's scheduler gives its ``CacheManager``
        (``kv_cache_groups``: their ``CacheGroupSpec`` list, each with ``layer_names`` and
        ``kv_cache_spec``)."""
        if use_eagle:
            raise EasydelAdapterError("use_eagle=True: EAGLE's shifted prefix hits are not mapped onto jaxkv")
        groups = tuple(
            KVCacheGroup(
                layer_names=tuple(g.layer_names),
                spec=spec_from_easydel(g.kv_cache_spec),
                block_size=g.kv_cache_spec.page_size,
            )
            for g in kv_cache_groups
        )
        config = KVCacheConfig(num_blocks=num_pages, groups=groups)
        return cls(KVCacheManager(config, max_model_len=max_model_len, enable_caching=enable_caching))

    @property
    def usage(self) -> float:
        return self.manager.usage

    def _mirror(self, request: Any) -> Request:
        """The jaxkv request standing for ``request``: created on first sight, then kept
        in step with its generated tokens and ``num_computed_tokens``."""
        mirror = self._mirrors.get(request.request_id)
        if mirror is None:
            mirror = Request(request.request_id, [int(t) for t in request.prompt_token_ids])
            self._mirrors[request.request_id] = mirror
        outputs = request.output_token_ids
        known = len(mirror.output_token_ids)
        if len(outputs) > known:
            mirror.append_output_token_ids([int(t) for t in outputs[known:]])
        mirror.num_computed_tokens = request.num_computed_tokens
        return mirror

    def create_empty_page_list(self) -> Pages:
        return Pages(KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups))))

    def get_computed_pages(
        self, request: Any, *, dp_shard_hint: int | None = None, data_parallel_size: int | None = None
    ) -> tuple[Pages, int]:
        """The longest cached prefix (full pages, at most ``num_tokens - 1`` tokens); none
        for a request asking for prompt logprobs, as in eSurge."""
        _single_shard(data_parallel_size)
        params = getattr(request, "sampling_params", None)
        if not self.enable_caching or getattr(params, "prompt_logprobs", None) is not None:
            return self.create_empty_page_list(), 0
        blocks, n = self.manager.get_computed_blocks(self._mirror(request))
        return Pages(blocks), n

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_pages: Pages | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_pages: bool = False,
        dp_shard_hint: int | None = None,
        data_parallel_size: int | None = None,
    ) -> Pages | None:
        """Slots for ``num_new_tokens`` more tokens after the hit; the new pages, or None
        (changing nothing) when the pool cannot serve them: eSurge preempts then."""
        _single_shard(data_parallel_size)
        if delay_cache_pages:
            raise EasydelAdapterError(
                f"request {request.request_id!r}: delay_cache_pages (async KV loads) is not mapped"
            )
        if num_new_tokens == 0:
            raise EasydelAdapterError(f"request {request.request_id!r}: num_new_tokens must be greater than 0")
        hit = new_computed_pages.blocks if new_computed_pages is not None and any(new_computed_pages.blocks) else None
        new = self.manager.allocate_slots(
            self._mirror(request),
            num_new_tokens,
            num_new_computed_tokens if hit is not None else 0,
            hit,
            num_lookahead_tokens=num_lookahead_tokens,
        )
        return None if new is None else Pages(new)

    def free(self, request: Any) -> None:
        """Free the request's pages (finished or preempted); eSurge resets its
        ``num_computed_tokens`` on preemption, and the mirror follows on its next call."""
        if self.manager.has_request(request.request_id):
            self.manager.free(request.request_id)

    def free_page_hashes(self, request: Any) -> None:
        """Forget a finished request (its mirror and the block hashes it carries)."""
        self._mirrors.pop(request.request_id, None)

    def get_page_ids(self, request_id: str) -> tuple[list[int], ...]:
        if not self.manager.has_request(request_id):
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return self.manager.get_block_ids(request_id)

    def get_num_common_prefix_pages(self, request: Any, num_scheduled_requests: int) -> list[int]:
        """Per group, the request's leading pages held by exactly ``num_scheduled_requests``
        requests (pages every running request shares, for cascade attention); 0 for a
        window or recurrent group, as in eSurge."""
        pool = self.manager.pool
        out = []
        for group, ids in zip(self.manager.config.groups, self.get_page_ids(request.request_id), strict=True):
            n = 0
            while (
                type(group.spec) is FullAttentionSpec
                and n < len(ids)
                and pool.ref_count(ids[n]) == num_scheduled_requests
            ):
                n += 1
            out.append(n)
        return out

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()


def _single_shard(data_parallel_size: int | None) -> None:
    if data_parallel_size is not None and int(data_parallel_size) > 1:
        raise EasydelAdapterError(
            f"data_parallel_size={data_parallel_size}: eSurge's DP page sharding is not mapped (one manager per rank)"
        )
