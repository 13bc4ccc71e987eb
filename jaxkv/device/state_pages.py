"""Recurrent states stored in the pages of the KV cache (``state_layout="shared_pages"``).

With one memory (:class:`~jaxkv.planner.SharedStates`) a state, all layers of one
recurrent group for one request at one position, is a *unit* of ``pages_per_state``
blocks of the attention pool (:meth:`jaxkv.core.pool.BlockPool.get_new_unit`). On device
its bytes are those blocks in the unit's order, each block its pages in layer-index
order (in both cache layouts: unit page ``j`` is page ``j % L`` of block ``j // L``).
Each layer's state tensors sit at static byte ranges of the unit
(:class:`StatePages`: the group's layers in order, each tensor in order, packed).

A step reads a tensor the way attention reads KV, through a table: each sequence's
unit blocks ``(S, pages_per_state)`` (:class:`jaxkv.device.metadata.StateMetadata`); only the
pages covering a layer's byte range are gathered, flattened to bytes, sliced and
bitcast to the tensor's dtype and shape. A write is the inverse: the layer's bytes,
completed at both ends by the edge pages' other bytes (read back), are scattered into
those pages. Pages move as unsigned words, never as floats (:func:`_bits`). Padded
sequences read and write the null block 0, whose content nothing uses. Tensor-parallel meshes are refused
(:func:`check_mesh`): the KV buffers are split over heads, a state is not.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxkv.device.cache import KVCache, UnknownLayerError
from jaxkv.errors import JaxkvError
from jaxkv.ints import cdiv
from jaxkv.planner import KVCacheConfig
from jaxkv.specs import MambaSpec, canonical_dtype


class SharedPagesError(JaxkvError, ValueError):
    """States cannot live in this cache's pages: no ``shared_pages`` plan, states larger
    than their units, or a mesh splitting the pages over heads."""


@dataclass(frozen=True)
class TensorPlace:
    """Where one state tensor of one layer sits in its unit: ``offset`` bytes in, packed."""

    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * jnp.dtype(self.dtype).itemsize


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StatePages:
    """The static layout of states stored in KV pages; it holds no buffer (the states
    are in :class:`~jaxkv.device.cache.KVCache`'s), so it is a pytree without leaves."""

    layers: tuple[tuple[str, tuple[TensorPlace, ...]], ...] = dataclasses.field(metadata={"static": True})
    pages_per_state: int = dataclasses.field(metadata={"static": True})
    state_bytes: int = dataclasses.field(metadata={"static": True})

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.layers)

    def places(self, layer: str) -> tuple[TensorPlace, ...]:
        """``layer``'s tensors in its unit."""
        for name, places in self.layers:
            if name == layer:
                return places
        raise UnknownLayerError(
            f"layer {layer!r} has no recurrent state in this cache; layers: {list(self.layer_names)}"
        )


def state_pages(config: KVCacheConfig, kv: KVCache) -> StatePages:
    """The layout of ``config``'s recurrent states in the pages of ``kv`` (its allocation).

    :class:`SharedPagesError` when the plan is not ``shared_pages`` or a group's states
    do not fit ``pages_per_state`` of ``kv``'s blocks."""
    shared = config.shared_states
    if shared is None:
        raise SharedPagesError("the KV cache config keeps no states in its pages (state_layout is not 'shared_pages')")
    capacity = shared.pages_per_state * block_nbytes(kv)
    layers: list[tuple[str, tuple[TensorPlace, ...]]] = []
    for group in config.groups:
        if not isinstance(group.spec, MambaSpec):
            continue
        offset = 0
        for name in group.layer_names:
            places = []
            for shape, dtype in zip(group.spec.shapes, group.spec.dtypes, strict=True):
                place = TensorPlace(offset, tuple(shape), canonical_dtype(dtype))
                places.append(place)
                offset += place.nbytes
            layers.append((name, tuple(places)))
        if offset > capacity:
            raise SharedPagesError(
                f"the states of group {list(group.layer_names)} take {offset} B, more than "
                f"pages_per_state={shared.pages_per_state} blocks of {block_nbytes(kv)} B"
            )
    return StatePages(tuple(layers), shared.pages_per_state, shared.state_bytes)


def check_mesh(config: KVCacheConfig, mesh: Mesh | None, model_axis: str) -> None:
    """:class:`SharedPagesError` for a ``shared_pages`` plan on a mesh splitting ``model_axis``:
    its KV pages are sharded over heads while a state must be whole on every device."""
    if config.shared_states is None or mesh is None:
        return
    devices = mesh.shape.get(model_axis, 1)
    if devices > 1 or config.tensor_parallel > 1:
        raise SharedPagesError(
            f"state_layout='shared_pages' keeps states in the KV pages, which a mesh axis {model_axis!r} of "
            f"{devices} devices splits over heads; plan with state_layout='state_pool' for tensor parallel"
        )


def block_nbytes(kv: KVCache) -> int:
    """Bytes of one block of ``kv``, all its pages (one device's, without a mesh the whole)."""
    return sum(b.nbytes for b in kv.buffers) // kv.num_blocks


def to_bytes(x: jax.Array) -> jax.Array:
    """``(n, ...)`` of any dtype -> ``(n, bytes)`` uint8, the same bits."""
    flat = x.reshape(x.shape[0], -1)
    if flat.dtype.itemsize > 1:
        flat = jax.lax.bitcast_convert_type(flat, jnp.uint8)
    return flat.reshape(x.shape[0], -1)


def from_bytes(data: jax.Array, shape: Sequence[int], dtype: jnp.dtype) -> jax.Array:
    """Inverse of :func:`to_bytes`: ``(n, bytes)`` uint8 -> ``(n, *shape)`` of ``dtype``."""
    itemsize = jnp.dtype(dtype).itemsize
    rows = data.reshape(data.shape[0], -1, itemsize) if itemsize > 1 else data
    return jax.lax.bitcast_convert_type(rows, dtype).reshape((data.shape[0], *shape))


def _bits(buffer: jax.Array) -> jax.Array:
    """``buffer`` viewed as unsigned ints of its width: a state's bytes in a float buffer
    are arbitrary bits (NaNs, subnormals), which float copies may canonicalise or flush
    (XLA:CPU computes bf16 through float32); integer copies keep every bit."""
    return jax.lax.bitcast_convert_type(buffer, jnp.dtype(f"uint{8 * buffer.dtype.itemsize}"))


def _page_nbytes(kv: KVCache) -> int:
    return block_nbytes(kv) // kv.num_layers_per_block


def _gather(kv: KVCache, blocks: jax.Array, pages: np.ndarray) -> jax.Array:
    """Unit pages ``pages`` (static, ascending) of every sequence's unit ``blocks (S, k)``,
    as bytes ``(S, len(pages) * page bytes)``."""
    width = kv.num_layers_per_block
    rows = blocks[:, pages // width]
    if kv.layout == "cross_layer":
        return to_bytes(_bits(kv.buffers[0])[rows, pages % width])
    parts = [(np.flatnonzero(pages % width == i), b) for i, b in enumerate(kv.buffers)]
    parts = [(where, b) for where, b in parts if where.size]
    gathered = jnp.concatenate([_bits(b)[rows[:, where]] for where, b in parts], axis=1)
    return to_bytes(gathered[:, np.argsort(np.concatenate([where for where, _ in parts]))])


def _scatter(kv: KVCache, blocks: jax.Array, pages: np.ndarray, data: jax.Array) -> KVCache:
    """Inverse of :func:`_gather`: unit pages ``pages`` := ``data`` (padding may repeat the null block)."""
    width = kv.num_layers_per_block
    words = jnp.dtype(f"uint{8 * kv.dtype.itemsize}")
    values = from_bytes(data, (len(pages), *kv.buffers[0].shape[-3:]), words)
    rows = blocks[:, pages // width]

    def put(buffer: jax.Array, index: tuple[jax.Array | np.ndarray, ...], update: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(_bits(buffer).at[index].set(update), buffer.dtype)

    if kv.layout == "cross_layer":
        return kv.replace((put(kv.buffers[0], (rows, pages % width), values),))
    buffers = list(kv.buffers)
    for i in range(width):
        where = np.flatnonzero(pages % width == i)
        if where.size:
            buffers[i] = put(buffers[i], (rows[:, where],), values[:, where])
    return kv.replace(tuple(buffers))


def _read_bytes(kv: KVCache, blocks: jax.Array, start: int, end: int) -> jax.Array:
    """Bytes ``[start, end)`` of every sequence's unit: only the pages holding them are read."""
    size = _page_nbytes(kv)
    pages = np.arange(start // size, cdiv(end, size))
    base = int(pages[0]) * size
    return _gather(kv, blocks, pages)[:, start - base : end - base]


def _write_bytes(kv: KVCache, blocks: jax.Array, start: int, data: jax.Array) -> KVCache:
    """``kv`` with bytes ``[start, start + width)`` of every sequence's unit set to ``data``
    ``(S, width)``: the pages holding them are written, the edge pages' other bytes kept."""
    size = _page_nbytes(kv)
    end = start + data.shape[1]
    pages = np.arange(start // size, cdiv(end, size))
    head, tail = start - int(pages[0]) * size, int(pages[-1] + 1) * size - end
    if head or tail:
        edges = _gather(kv, blocks, np.unique(pages[[0, -1]]))
        data = jnp.concatenate([edges[:, :head], data, edges[:, edges.shape[1] - tail :]], axis=1)
    return _scatter(kv, blocks, pages, data)


def read_unit_states(kv: KVCache, pages: StatePages, layer: str, blocks: jax.Array) -> tuple[jax.Array, ...]:
    """``layer``'s state tensors of the units whose blocks are ``blocks (S, pages_per_state)``:
    one ``(S, *shape)`` array per tensor."""
    places = pages.places(layer)
    start = places[0].offset
    data = _read_bytes(kv, blocks, start, places[-1].offset + places[-1].nbytes)
    return tuple(
        from_bytes(data[:, p.offset - start : p.offset - start + p.nbytes], p.shape, jnp.dtype(p.dtype)) for p in places
    )


def write_unit_states(
    kv: KVCache, pages: StatePages, layer: str, blocks: jax.Array, values: Sequence[jax.Array]
) -> KVCache:
    """``kv`` with ``layer``'s state tensors of units ``blocks (S, pages_per_state)`` set to
    ``values`` (one ``(S, *shape)`` per tensor, in its dtype); the unit's other bytes kept."""
    places = pages.places(layer)
    values = tuple(values)
    if len(values) != len(places):
        raise SharedPagesError(f"layer {layer!r} holds {len(places)} state tensors, got {len(values)} values")
    for p, v in zip(places, values, strict=True):
        if v.shape != (blocks.shape[0], *p.shape) or v.dtype != jnp.dtype(p.dtype):
            raise SharedPagesError(
                f"layer {layer!r}: values {v.shape} {v.dtype} do not match {blocks.shape[0]} states of "
                f"{p.shape} {p.dtype}"
            )
    data = jnp.concatenate([to_bytes(v) for v in values], axis=1)  # the places are packed in order
    return _write_bytes(kv, blocks, places[0].offset, data)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StateUnits:
    """The KV cache seen as whole states, what the host tier moves: one state per host
    block, ``state_bytes`` of bytes, addressed by its unit's blocks ``(pages_per_state,)``."""

    kv: KVCache
    pages: StatePages

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks


def gather_units(units: StateUnits, blocks: jax.Array) -> jax.Array:
    """Whole states of units ``blocks (n, pages_per_state)`` as bytes ``(n, state_bytes)``:
    the host tier's row of a state checkpoint (the bytes on device, the unit's padding dropped)."""
    return _read_bytes(units.kv, blocks, 0, units.pages.state_bytes)


def scatter_units(units: StateUnits, blocks: jax.Array, data: jax.Array) -> StateUnits:
    """Inverse of :func:`gather_units`: units ``blocks (n, pages_per_state)`` := ``data``
    ``(n, state_bytes)`` (trusted ids; the units' padding bytes are left as they were)."""
    return dataclasses.replace(units, kv=_write_bytes(units.kv, blocks, 0, data))
