"""Recurrent state on device: a pytree of state rows for the recurrent layers.

Every layer of a recurrent group (``MambaSpec``: Mamba-1/2, Gated DeltaNet...) gets one
buffer per state tensor, ``(num_rows, *shape)`` in the tensor's dtype. Row ``r`` holds
the state the host's block ``r`` of that group names:

- with the planner's ``state_pool`` layout, the rows are the state pool's
  (``config.state_pool.num_states``; row 0 is the null state);
- with vLLM's rule (``attention_pages``), the rows are the block ids of the attention
  pool (``config.num_blocks``), kept in buffers of their own rather than inside the
  attention pages, so the attention buffers stay one (block, 2H, D) shape.

A step reads each sequence's state from one row and writes it to another
(:class:`jaxkv.device.metadata.StateMetadata`): padding reads and writes row 0, whose content
is never used. Reads and writes are pure functions; donate the cache to update it in
place. Rows are checked on the host (:func:`jaxkv.device.metadata.build_step_metadata`).

With the ``shared_pages`` layout the states have no rows of their own: they live in the
KV pages (:mod:`jaxkv.device.state_pages`) and :class:`HybridCache` holds their layout instead.
A model reads and writes a layer's state through :func:`read_layer_state` and
:func:`write_layer_state`, which serve both places.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv.device.cache import KVCache, UnknownLayerError
from jaxkv.device.metadata import StateMetadata
from jaxkv.device.state_pages import StatePages, from_bytes, read_unit_states, to_bytes, write_unit_states
from jaxkv.errors import JaxkvError
from jaxkv.planner import KVCacheConfig
from jaxkv.specs import MambaSpec, canonical_dtype


class StateCacheError(JaxkvError, ValueError):
    """A config without recurrent layers, or states of the wrong shape or dtype."""


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StateCache:
    """Device state rows of every recurrent layer; ``buffers[i]`` are layer ``layer_names[i]``'s
    tensors, each ``(num_rows, *shape)``. The buffers are the only pytree children."""

    buffers: tuple[tuple[jax.Array, ...], ...]
    layer_names: tuple[str, ...] = dataclasses.field(metadata={"static": True})

    def _index(self, layer: str) -> int:
        try:
            return self.layer_names.index(layer)
        except ValueError:
            raise UnknownLayerError(
                f"layer {layer!r} has no recurrent state in this cache; layers: {list(self.layer_names)}"
            ) from None

    def layer_states(self, layer: str) -> tuple[jax.Array, ...]:
        """The buffers of ``layer``'s state tensors."""
        return self.buffers[self._index(layer)]

    def with_layer_states(self, layer: str, states: Sequence[jax.Array]) -> StateCache:
        """This cache with ``layer``'s buffers replaced."""
        i = self._index(layer)
        return dataclasses.replace(self, buffers=(*self.buffers[:i], tuple(states), *self.buffers[i + 1 :]))

    def replace(self, buffers: Sequence[Sequence[jax.Array]]) -> StateCache:
        """The same layers over new buffers."""
        return dataclasses.replace(self, buffers=tuple(tuple(b) for b in buffers))

    @property
    def flat_buffers(self) -> tuple[jax.Array, ...]:
        """Every buffer, layer by layer (what a row copy moves)."""
        return tuple(b for layer in self.buffers for b in layer)

    @property
    def num_rows(self) -> int:
        """State rows, the null row 0 included."""
        return self.buffers[0][0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.flat_buffers)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class HybridCache:
    """Everything a hybrid model's step reads and writes: the paged attention KV and the
    recurrent state rows (one pytree, donated into the step as a whole); with shared
    pages, the states' layout in the KV pages instead of rows."""

    kv: KVCache
    states: StateCache | StatePages


def num_state_rows(config: KVCacheConfig) -> int:
    """Rows per state buffer: the state pool's, or one per block of the attention pool."""
    return config.state_pool.num_states if config.state_pool is not None else config.num_blocks


def _recurrent_layers(config: KVCacheConfig) -> list[tuple[str, MambaSpec]]:
    layers = [(name, g.spec) for g in config.groups if isinstance(g.spec, MambaSpec) for name in g.layer_names]
    if not layers:
        raise StateCacheError("the KV cache config has no recurrent (MambaSpec) group: there is no state to hold")
    return layers


def _zeros(shapes: tuple[tuple[tuple[int, ...], jnp.dtype], ...]) -> tuple[jax.Array, ...]:
    return tuple(jnp.zeros(shape, dtype) for shape, dtype in shapes)


def allocate_state_cache(config: KVCacheConfig, *, mesh: Mesh | None = None) -> StateCache:
    """Zero-filled state rows for every recurrent layer of ``config``, created on device.

    With a ``mesh`` the buffers are replicated over it (state is small next to the
    attention KV; sharding it over heads is not done here). A ``shared_pages`` plan has
    no rows and is refused: its states live in the KV pages (:func:`jaxkv.device.state_pages.state_pages`).
    """
    if config.shared_states is not None:
        raise StateCacheError(
            "state_layout='shared_pages' keeps states in the KV pages, not in state rows: "
            "lay them out with jaxkv.device.state_pages.state_pages"
        )
    layers = _recurrent_layers(config)
    rows = num_state_rows(config)
    shapes = tuple(
        ((rows, *shape), jnp.dtype(canonical_dtype(dtype)))
        for _, spec in layers
        for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True)
    )
    sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    flat = iter(jax.jit(_zeros, static_argnums=0, out_shardings=sharding)(shapes))
    buffers = tuple(tuple(next(flat) for _ in spec.shapes) for _, spec in layers)
    return StateCache(buffers=buffers, layer_names=tuple(name for name, _ in layers))


def read_states(cache: StateCache, layer: str, rows: jax.Array) -> tuple[jax.Array, ...]:
    """``layer``'s state tensors at ``rows (S,)``: one ``(S, *shape)`` array per tensor."""
    return tuple(b[rows] for b in cache.layer_states(layer))


def write_states(cache: StateCache, layer: str, rows: jax.Array, values: Sequence[jax.Array]) -> StateCache:
    """``cache`` with ``layer``'s rows ``rows (S,)`` set to ``values`` (one ``(S, *shape)``
    per tensor, in the buffer's dtype). Padding may repeat the null row 0; other rows
    must be distinct (which of two writes to one row lands is unspecified)."""
    buffers = cache.layer_states(layer)
    values = tuple(values)
    if len(values) != len(buffers):
        raise StateCacheError(f"layer {layer!r} holds {len(buffers)} state tensors, got {len(values)} values")
    for b, v in zip(buffers, values, strict=True):
        if v.shape != rows.shape + b.shape[1:] or v.dtype != b.dtype:
            raise StateCacheError(
                f"layer {layer!r}: values {v.shape} {v.dtype} do not match rows {rows.shape} of a "
                f"{b.shape[1:]} {b.dtype} state"
            )
    return cache.with_layer_states(layer, [b.at[rows].set(v) for b, v in zip(buffers, values, strict=True)])


def row_nbytes(cache: StateCache) -> int:
    """Bytes of one state row across every layer and tensor (one host block of the host tier)."""
    return sum(b.nbytes // b.shape[0] for b in cache.flat_buffers)


def gather_rows(cache: StateCache, ids: jax.Array) -> jax.Array:
    """State rows ``ids`` of every layer as bytes, ``(n, row_nbytes)`` uint8: the staging
    format of the host tier (one row per host block, whatever the tensors' shapes and dtypes)."""
    return jnp.concatenate([to_bytes(b[ids]) for b in cache.flat_buffers], axis=1)


def scatter_rows(cache: StateCache, ids: jax.Array, data: jax.Array) -> StateCache:
    """Inverse of :func:`gather_rows`: rows ``ids`` := ``data`` (trusted ids; donate the cache)."""
    flat = []
    start = 0
    for b in cache.flat_buffers:
        width = b.nbytes // b.shape[0]
        flat.append(b.at[ids].set(from_bytes(data[:, start : start + width], b.shape[1:], b.dtype)))
        start += width
    rows = iter(flat)
    return cache.replace([[next(rows) for _ in layer] for layer in cache.buffers])


def read_layer_state(cache: HybridCache, layer: str, meta: StateMetadata) -> tuple[jax.Array, ...]:
    """``layer``'s state tensors each sequence of a step resumes from, ``(S, *shape)`` per
    tensor: from its read row, or from the KV pages of its read unit with shared pages.
    Fresh sequences (and padding) get zeros, whatever the row or unit holds."""
    if isinstance(cache.states, StatePages):
        values = read_unit_states(cache.kv, cache.states, layer, meta.read_blocks)
    else:
        values = read_states(cache.states, layer, meta.read_rows)
    fresh = meta.fresh.astype(bool)
    return tuple(jnp.where(fresh.reshape((-1,) + (1,) * (v.ndim - 1)), jnp.zeros((), v.dtype), v) for v in values)


def write_layer_state(cache: HybridCache, layer: str, meta: StateMetadata, values: Sequence[jax.Array]) -> HybridCache:
    """``cache`` with ``layer``'s state after the step, ``values`` (one ``(S, *shape)`` per
    tensor), written to each sequence's write row, or its write unit's KV pages."""
    if isinstance(cache.states, StatePages):
        kv = write_unit_states(cache.kv, cache.states, layer, meta.write_blocks, values)
        return dataclasses.replace(cache, kv=kv)
    return dataclasses.replace(cache, states=write_states(cache.states, layer, meta.write_rows, values))
