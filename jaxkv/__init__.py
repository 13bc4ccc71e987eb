"""jaxkv: KV cache management for hybrid LLMs in JAX serving loops.

The names a serving loop needs, importable from here (:data:`__all__`). Each is
imported on first use, so ``import jaxkv`` loads nothing, and the host-side names
(specs, planner, manager) never load JAX: a router or a planning process carries none.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_HOME = {
    # host core (no JAX)
    "JaxkvError": "jaxkv.errors",
    "KVCacheSpec": "jaxkv.specs",
    "AttentionSpec": "jaxkv.specs",
    "FullAttentionSpec": "jaxkv.specs",
    "SlidingWindowSpec": "jaxkv.specs",
    "ChunkedLocalAttentionSpec": "jaxkv.specs",
    "MLASpec": "jaxkv.specs",
    "MambaSpec": "jaxkv.specs",
    "get_preset": "jaxkv.presets",
    "list_presets": "jaxkv.presets",
    "plan_kv_cache": "jaxkv.planner",
    "KVCacheConfig": "jaxkv.planner",
    "KVCacheGroup": "jaxkv.planner",
    "StatePoolOptions": "jaxkv.planner",
    "KVCacheManager": "jaxkv.core.manager",
    "Request": "jaxkv.core.request",
    # device side, models, serving (JAX)
    "KVCache": "jaxkv.device.cache",
    "UnknownLayerError": "jaxkv.device.cache",
    "allocate_kv_cache": "jaxkv.device.cache",
    "HybridCache": "jaxkv.device.state_cache",
    "StepMetadata": "jaxkv.device.metadata",
    "Buckets": "jaxkv.device.metadata",
    "ScheduledSeq": "jaxkv.device.metadata",
    "build_step_metadata": "jaxkv.device.metadata",
    "ServedModel": "jaxkv.models.protocol",
    "Engine": "jaxkv.serving.engine",
    "OffloadConfig": "jaxkv.serving.offload_connector",
}
_MODULES = {"ops": "jaxkv.device.ops"}
"""Submodules exported by name (``jaxkv.ops.paged_attention``)."""

__all__ = [
    "AttentionSpec",
    "Buckets",
    "ChunkedLocalAttentionSpec",
    "Engine",
    "FullAttentionSpec",
    "HybridCache",
    "JaxkvError",
    "KVCache",
    "KVCacheConfig",
    "KVCacheGroup",
    "KVCacheManager",
    "KVCacheSpec",
    "MLASpec",
    "MambaSpec",
    "OffloadConfig",
    "Request",
    "ScheduledSeq",
    "ServedModel",
    "SlidingWindowSpec",
    "StatePoolOptions",
    "StepMetadata",
    "UnknownLayerError",
    "allocate_kv_cache",
    "build_step_metadata",
    "get_preset",
    "list_presets",
    "ops",
    "plan_kv_cache",
]

if TYPE_CHECKING:
    from jaxkv.core.manager import KVCacheManager
    from jaxkv.core.request import Request
    from jaxkv.device import ops
    from jaxkv.device.cache import KVCache, UnknownLayerError, allocate_kv_cache
    from jaxkv.device.metadata import Buckets, ScheduledSeq, StepMetadata, build_step_metadata
    from jaxkv.device.state_cache import HybridCache
    from jaxkv.errors import JaxkvError
    from jaxkv.models.protocol import ServedModel
    from jaxkv.planner import KVCacheConfig, KVCacheGroup, StatePoolOptions, plan_kv_cache
    from jaxkv.presets import get_preset, list_presets
    from jaxkv.serving.engine import Engine
    from jaxkv.serving.offload_connector import OffloadConfig
    from jaxkv.specs import (
        AttentionSpec,
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheSpec,
        MambaSpec,
        MLASpec,
        SlidingWindowSpec,
    )


def _import(module: str, name: str) -> Any:
    """``module``, where a missing jax or safetensors is one typed error naming the extra."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        from jaxkv.errors import raise_missing_extra

        raise_missing_extra(err, ("jax", "jaxlib", "safetensors"), f"jaxkv.{name} needs pip install 'jaxkv[serving]'")


def __getattr__(name: str) -> Any:
    """Import an exported name from its module on first use."""
    if name in _MODULES:
        return _import(_MODULES[name], name)
    if name not in _HOME:
        raise AttributeError(f"module 'jaxkv' has no attribute {name!r}")
    value = getattr(_import(_HOME[name], name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
