"""Hand-made KV cache configs and managers shared by the host-side tests."""

from typing import Any

from jaxkv.core.manager import KVCacheManager, Request
from jaxkv.planner import InsufficientMemoryError, KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec, SlidingWindowSpec

FULL = FullAttentionSpec(num_kv_heads=1, head_size=1)


def window(w: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(num_kv_heads=1, head_size=1, sliding_window=w)


def make_config(num_blocks: int, *specs, block_size: int = 16) -> KVCacheConfig:
    """One group per spec, each with a single layer."""
    groups = tuple(
        KVCacheGroup(layer_names=(f"g{i}.layer",), spec=s, block_size=block_size) for i, s in enumerate(specs)
    )
    return KVCacheConfig(num_blocks=num_blocks, groups=groups)


def make_manager(num_blocks: int, *specs, block_size: int = 16, max_model_len: int = 8192, **kw) -> KVCacheManager:
    return KVCacheManager(make_config(num_blocks, *specs, block_size=block_size), max_model_len=max_model_len, **kw)


def admit(mgr: KVCacheManager, req: Request, num_lookahead_tokens: int = 0):
    """Look up the prefix cache and allocate the rest of the prompt, as a scheduler does."""
    hit, n = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - n, n, hit, num_lookahead_tokens=num_lookahead_tokens)
    if new is not None:
        req.num_computed_tokens = req.num_tokens
    return hit, n, new


def smallest_accepted(model: Any, *, max_model_len: int, **kwargs: Any) -> tuple[int, KVCacheConfig]:
    """The smallest ``memory_bytes`` the Engine's planning (:func:`jaxkv.serving.engine.plan_for_model`
    with ``kwargs``) accepts for ``model``, and its plan."""
    from jaxkv.serving.engine import plan_for_model

    lo, hi = 1, 1 << 32
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            plan_for_model(model, mid, max_model_len=max_model_len, **kwargs)
            hi = mid
        except InsufficientMemoryError:
            lo = mid + 1
    return lo, plan_for_model(model, lo, max_model_len=max_model_len, **kwargs)
