"""The KV cache on device: a pytree of buffers allocated in their final layout.

Two layouts (``BlockPages.layout``):

- ``per_layer``: one buffer per layer index, ``(num_blocks, block_size, 2*H, D)``;
- ``cross_layer``: one block-major buffer
  ``(num_blocks, num_layers_per_block, block_size, 2*H, D)``: all layers' pages of a
  block are one contiguous region, so a block moves in one copy.

Layer index i (the page at position i of a block) holds the i-th layer of every group,
so a block id means the same bytes in every group and blocks are interchangeable
between groups, as the host buffers assumes. K and V
are interleaved per KV head on the ``2*H`` axis (``2*h`` = K, ``2*h + 1`` = V).

Tile alignment: ``D`` is the planned head size, rounded up to ``head_dim_multiple``
(128 lanes on TPU; :func:`jaxkv.planner.plan_kv_cache`), and :mod:`jaxkv.device.ops` zero-pads
q/k/v to it. Only ``D`` is padded. The second-minor ``2*H`` axis needs no padding for
packing: interleaving makes it always even, so where 16-bit rows are packed in pairs of
adjacent rows (bf16, two per 32-bit sublane) a pair is the K and the V of one head,
never rows of two heads. (Reasoned from the layout, not checked on a real TPU.)

Sharding: with a mesh, the ``2*H`` axis is split over ``kv_axis``. Each device must hold
whole heads, so ``num_kv_heads`` must be a multiple of the axis size; then K and V of a
head (adjacent) stay on one device and attention needs no communication. Replicating
heads (fewer KV heads than devices) is not supported here. With a mesh of explicit
axes (``jax.make_mesh``'s default), run the ops under ``jax.jit`` (or inside
``jax.set_mesh(mesh)`` when eager).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxkv.device.jax_support  # noqa: F401 - refuses a jax outside the tested range
from jaxkv.errors import JaxkvError
from jaxkv.planner import LAYOUTS, KVCacheConfig, KVCacheGroup
from jaxkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    canonical_dtype,
)

SUPPORTED_SPECS = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)
"""Spec classes the device cache can hold (exact classes: MLA and Mamba are not)."""


class UnsupportedLayoutError(JaxkvError, ValueError):
    """The config holds a spec (or mix of specs) the device cache cannot lay out."""


class KVCacheShardingError(JaxkvError, ValueError):
    """The mesh cannot shard the cache's KV heads."""


class UnknownLayerError(JaxkvError, KeyError):
    """A layer name that has no page in this cache's blocks."""

    def __str__(self) -> str:
        return str(self.args[0])


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Device buffers for a :class:`~jaxkv.planner.KVCacheConfig`.

    ``buffers`` are the only pytree children (donate the cache into step functions);
    everything else is static metadata, hashable, part of the jit cache key.
    ``layer_specs`` is each layer's planned spec (its group's): what the ops read a
    layer's attention window from, so no caller passes it.
    """

    buffers: tuple[jax.Array, ...]
    layout: str = dataclasses.field(metadata={"static": True})
    layer_indices: tuple[tuple[str, int], ...] = dataclasses.field(metadata={"static": True})
    layer_specs: tuple[tuple[str, KVCacheSpec], ...] = dataclasses.field(metadata={"static": True})
    block_size: int = dataclasses.field(metadata={"static": True})
    num_kv_heads: int = dataclasses.field(metadata={"static": True})
    head_dim: int = dataclasses.field(metadata={"static": True})

    def layer_index(self, layer: str) -> int:
        """The position of ``layer``'s page inside every block."""
        for name, index in self.layer_indices:
            if name == layer:
                return index
        raise UnknownLayerError(
            f"layer {layer!r} has no page in this cache; layers: {[n for n, _ in self.layer_indices]}"
        )

    def spec(self, layer: str) -> KVCacheSpec:
        """The spec ``layer``'s group was planned with (its window, head size, dtype)."""
        for name, spec in self.layer_specs:
            if name == layer:
                return spec
        raise UnknownLayerError(
            f"layer {layer!r} has no spec in this cache; layers: {[n for n, _ in self.layer_specs]}"
        )

    def layer_buffer(self, layer: str) -> tuple[jax.Array, int | None]:
        """``(buffer, layer_index)`` to pass to a kernel for ``layer``.

        Per-layer: the layer's own buffer and ``None``; cross-layer: the shared buffer
        and the layer index (the kernel reads the page in place, no copy).
        """
        index = self.layer_index(layer)
        if self.layout == "per_layer":
            return self.buffers[index], None
        return self.buffers[0], index

    def with_layer_buffer(self, layer: str, buffer: jax.Array) -> KVCache:
        """This cache with ``layer``'s buffer (per-layer) or the shared buffer replaced."""
        index = self.layer_index(layer) if self.layout == "per_layer" else 0
        buffers = (*self.buffers[:index], buffer, *self.buffers[index + 1 :])
        return self.replace(buffers)

    def replace(self, buffers: tuple[jax.Array, ...]) -> KVCache:
        """The same cache metadata over new buffers."""
        return dataclasses.replace(self, buffers=tuple(buffers))

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block 0 included."""
        return self.buffers[0].shape[0]

    @property
    def num_layers_per_block(self) -> int:
        """Pages per block, one per layer index."""
        return len(self.buffers) if self.layout == "per_layer" else self.buffers[0].shape[1]

    @property
    def dtype(self) -> jnp.dtype:
        """Element dtype of the buffers."""
        return self.buffers[0].dtype

    @property
    def nbytes(self) -> int:
        """Total bytes of all buffers."""
        return sum(b.nbytes for b in self.buffers)


def _device_spec(config: KVCacheConfig) -> AttentionSpec:
    """The one attention spec shape every group shares; raise naming the odd one out.

    Recurrent groups are skipped: their state lives in a :class:`~jaxkv.device.state_cache.StateCache`
    (under vLLM's rule their pages still take their place in each block, unused here).
    """
    groups = [g for g in config.attention_groups if not isinstance(g.spec, MambaSpec)]
    if not groups:
        raise UnsupportedLayoutError(
            f"all {len(config.groups)} group(s) are recurrent "
            f"(first layer {config.groups[0].layer_names[0]!r}): no attention pages to allocate"
        )
    first = groups[0]
    first_spec = _attention_spec(first)
    for group in groups:
        spec = _attention_spec(group)
        shape = (spec.num_kv_heads, spec.head_size, spec.dtype)
        head = (first_spec.num_kv_heads, first_spec.head_size, first_spec.dtype)
        if shape != head:
            raise UnsupportedLayoutError(
                f"group of {group.layer_names[0]!r} has spec {spec!r} with (num_kv_heads, "
                f"head_size, dtype) {shape}, but group of {first.layer_names[0]!r} has {head}; "
                "all device groups must share them"
            )
        if group.block_size != first.block_size:
            raise UnsupportedLayoutError(
                f"group of {group.layer_names[0]!r} ({spec!r}) has block_size "
                f"{group.block_size}, but group of {first.layer_names[0]!r} has "
                f"{first.block_size}; all device groups must share one block size"
            )
    return first_spec


def _attention_spec(group: KVCacheGroup) -> AttentionSpec:
    """``group``'s spec when the device cache holds its kind; raise naming it otherwise."""
    spec = group.spec
    if type(spec) not in SUPPORTED_SPECS or not isinstance(spec, AttentionSpec):
        raise UnsupportedLayoutError(
            f"group of {group.layer_names[0]!r} has spec {spec!r}; the device cache holds "
            f"only {', '.join(c.__name__ for c in SUPPORTED_SPECS)}"
        )
    return spec


def _layer_indices(config: KVCacheConfig) -> tuple[tuple[str, int], ...]:
    """(layer, index) pairs: the layout's rows, or the i-th layer of each group -> i."""
    if config.pages is not None:
        rows = config.pages.layers
    else:
        groups = config.attention_groups
        width = max(len(g.layer_names) for g in groups)
        rows = tuple(tuple(g.layer_names[i] if i < len(g.layer_names) else None for g in groups) for i in range(width))
    return tuple((name, i) for i, row in enumerate(rows) for name in row if name is not None)


def _sharding(mesh: Mesh | None, kv_axis: str, ndim: int, num_kv_heads: int) -> NamedSharding | None:
    """Shard the 2*H axis (second to last) on ``kv_axis``, whole heads per device."""
    if mesh is None:
        return None
    if kv_axis not in mesh.shape:
        raise KVCacheShardingError(f"kv_axis {kv_axis!r} is not a mesh axis: {dict(mesh.shape)}")
    devices = mesh.shape[kv_axis]
    if num_kv_heads % devices:
        raise KVCacheShardingError(
            f"num_kv_heads={num_kv_heads} is not a multiple of mesh axis {kv_axis!r} of size "
            f"{devices}; every device must hold whole KV heads"
        )
    axes: list[str | None] = [None] * ndim
    axes[-2] = kv_axis
    return NamedSharding(mesh, PartitionSpec(*axes))


def _zeros(shape: tuple[int, ...], dtype: np.dtype, count: int) -> tuple[jax.Array, ...]:
    return tuple(jnp.zeros(shape, dtype) for _ in range(count))


def allocate_kv_cache(
    config: KVCacheConfig,
    *,
    dtype: object = None,
    layout: str | None = None,
    mesh: Mesh | None = None,
    kv_axis: str = "model",
) -> KVCache:
    """Zero-filled device buffers for ``config``, directly in their final layout.

    ``layout`` overrides ``config.pages.layout`` (default ``cross_layer`` for configs
    without a layout); ``dtype`` overrides the spec dtype. Buffers are created on device
    (sharded when ``mesh`` is given), never materialised on the host. Raises
    :class:`UnsupportedLayoutError` for specs other than full / sliding-window /
    chunked-local attention with one (num_kv_heads, head_size, dtype) and block size.
    """
    spec = _device_spec(config)
    kind = layout or (config.pages.layout if config.pages is not None else "cross_layer")
    if kind not in LAYOUTS:
        raise UnsupportedLayoutError(f"unknown layout {kind!r}; valid layouts: {LAYOUTS}")
    layer_indices = _layer_indices(config)
    num_layers_per_block = max(index for _, index in layer_indices) + 1
    block_size = config.groups[0].block_size
    dtype = jnp.dtype(canonical_dtype(spec.dtype if dtype is None else dtype))
    page = (block_size, 2 * spec.num_kv_heads, spec.head_size)
    shape: tuple[int, ...]
    if kind == "per_layer":
        shape, count = (config.num_blocks, *page), num_layers_per_block
    else:
        shape, count = (config.num_blocks, num_layers_per_block, *page), 1
    sharding = _sharding(mesh, kv_axis, len(shape), spec.num_kv_heads)
    zeros = jax.jit(_zeros, static_argnums=(0, 1, 2), out_shardings=sharding)
    buffers = zeros(shape, dtype, count)
    return KVCache(
        buffers=tuple(buffers),
        layout=kind,
        layer_indices=layer_indices,
        layer_specs=tuple((name, group.spec) for group in config.groups for name in group.layer_names),
        block_size=block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_size,
    )
