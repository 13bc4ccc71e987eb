"""Plain jnp reference of the device ops: the oracle every kernel is tested against.

Works on raw arrays (no :class:`~jaxkv.device.cache.KVCache`), in either layout:

- per-layer buffer ``(num_blocks, block_size, 2*H, D)``, ``layer_index=None``;
- cross-layer buffer ``(num_blocks, num_layers_per_block, block_size, 2*H, D)``,
  ``layer_index=i`` picks the page of the block's layer ``i`` (a static int) straight
  from the buffer.

K and V are interleaved per head: index ``2*h`` is K and ``2*h + 1`` is V of KV head h.
Block 0 is the null block; padding tokens write to it and padded table entries are 0.
Everything is vectorised (no Python loop over sequences), jit-able with static shapes,
and accumulates attention in float32 at full matmul precision.

Shapes are checked here (:class:`KVShapeError`); values are trusted: block ids, slots
and lengths are checked on the host, where :func:`jaxkv.device.metadata.build_step_metadata`
builds them, never on device (a slot of -1 would wrap into the last block).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxkv.errors import JaxkvError
from jaxkv.ints import is_int

PER_LAYER_NDIM = 4
CROSS_LAYER_NDIM = 5
_HIGHEST = jax.lax.Precision.HIGHEST


class KVShapeError(JaxkvError, ValueError):
    """An op got arrays whose shapes, dtypes or layout do not fit together."""


def check_kv_buffer(kv_buffer: jax.Array, layer_index: int | None) -> None:
    """Per-layer ``(N, bs, 2H, D)`` with ``layer_index=None``, cross-layer ``(N, L, bs, 2H, D)``
    with a static layer index in range; shared by the reference and the kernels."""
    if layer_index is None:
        if kv_buffer.ndim != PER_LAYER_NDIM:
            raise KVShapeError(
                f"layer_index=None expects a per-layer buffer (num_blocks, block_size, 2*H, D), "
                f"got shape {kv_buffer.shape}"
            )
    else:
        if kv_buffer.ndim != CROSS_LAYER_NDIM:
            raise KVShapeError(
                f"layer_index={layer_index} expects a cross-layer buffer "
                f"(num_blocks, num_layers_per_block, block_size, 2*H, D), got shape {kv_buffer.shape}"
            )
        if not is_int(layer_index) or not 0 <= layer_index < kv_buffer.shape[1]:
            raise KVShapeError(f"layer_index={layer_index!r} must be a static int in [0, {kv_buffer.shape[1]})")
    if kv_buffer.shape[-2] % 2:
        raise KVShapeError(f"the K/V axis must have size 2*H, got {kv_buffer.shape[-2]}")


def page_dims(kv_buffer: jax.Array | jax.ShapeDtypeStruct) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_dim) of either layout."""
    block_size, combined, head_dim = kv_buffer.shape[-3:]
    return block_size, combined // 2, head_dim


def check_write_kv_args(
    kv_buffer: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer_index: int | None,
) -> None:
    """Raise :class:`KVShapeError` unless the arguments fit :func:`write_kv`."""
    check_kv_buffer(kv_buffer, layer_index)
    _, num_kv_heads, head_dim = page_dims(kv_buffer)
    if k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise KVShapeError(f"k {k.shape} and v {v.shape} must both be (T, {num_kv_heads}, {head_dim})")
    if slot_mapping.shape != k.shape[:1]:
        raise KVShapeError(f"slot_mapping {slot_mapping.shape} must be ({k.shape[0]},)")


def interleave_kv(k: jax.Array, v: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``(T, 2*H, D)`` rows in the cache's order: K of head h at ``2h``, V at ``2h + 1``."""
    num_tokens, num_kv_heads, head_dim = k.shape
    return jnp.stack([k, v], axis=2).reshape(num_tokens, 2 * num_kv_heads, head_dim).astype(dtype)


def write_kv(
    kv_buffer: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer_index: int | None = None,
) -> jax.Array:
    """Write token t's K/V (``k, v: (T, H, D)``) into global slot ``slot_mapping[t]``.

    Global slot = ``block_id * block_size + offset``. Padding tokens map into the null
    block, so duplicate padding writes only touch block 0. Donate ``kv_buffer`` to make
    the scatter in place. Slots are trusted, not checked: a -1 would wrap into the last
    block (:func:`jaxkv.device.metadata.build_step_metadata` refuses such ids).
    """
    check_write_kv_args(kv_buffer, k, v, slot_mapping, layer_index=layer_index)
    block_size = kv_buffer.shape[-3]
    kv = interleave_kv(k, v, kv_buffer.dtype)
    block, offset = slot_mapping // block_size, slot_mapping % block_size
    if layer_index is None:
        return kv_buffer.at[block, offset].set(kv)
    return kv_buffer.at[block, layer_index, offset].set(kv)


def token_sequences(
    num_tokens: int, cu_q_lens: jax.Array, kv_lens: jax.Array, num_seqs: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token of a ragged batch: its sequence, its kv position, and whether it is real.

    Padding tokens (past ``cu_q_lens[num_seqs]``) get ``valid = False``.
    """
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], token, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, kv_lens.shape[0] - 1)
    valid = token < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    position = kv_lens[seq] - q_len + (token - cu_q_lens[seq])
    return seq, position, valid


def attention_mask(kv_pos: jax.Array, position: jax.Array, valid: jax.Array, sliding_window: int | None) -> jax.Array:
    """bool ``(T, L)``: whether token t (at ``position[t]``, real if ``valid[t]``) sees ``kv_pos[l]``.

    Causal (``kv_pos <= position``) and, with a window, ``kv_pos > position - sliding_window``.
    Attention selects with it (``jnp.where``) on both the logits and V, never multiplies
    by it: a masked position may hold anything, NaN included (``0 * NaN`` is NaN).
    """
    mask = (kv_pos[None, :] <= position[:, None]) & valid[:, None]
    if sliding_window is not None:
        mask &= kv_pos[None, :] > position[:, None] - sliding_window
    return mask


def check_paged_attention_args(
    q: jax.Array,
    kv_buffer: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    layer_index: int | None,
    sliding_window: int | None,
    soft_cap: float | None,
) -> None:
    """Raise :class:`KVShapeError` unless the arguments fit :func:`paged_attention`."""
    check_kv_buffer(kv_buffer, layer_index)
    _, num_kv_heads, head_dim = page_dims(kv_buffer)
    max_seqs = block_tables.shape[0]
    if q.ndim != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise KVShapeError(f"q {q.shape} must be (T, QH, {head_dim}) with QH a multiple of {num_kv_heads}")
    if block_tables.ndim != 2 or kv_lens.shape != (max_seqs,):
        raise KVShapeError(f"kv_lens {kv_lens.shape} does not fit block_tables {block_tables.shape}")
    if cu_q_lens.shape != (max_seqs + 1,):
        raise KVShapeError(f"cu_q_lens {cu_q_lens.shape} must be ({max_seqs + 1},)")
    if num_seqs.shape != (1,):
        raise KVShapeError(f"num_seqs must have shape (1,), got {num_seqs.shape}")
    if sliding_window is not None and sliding_window <= 0:
        raise KVShapeError(f"sliding_window must be positive, got {sliding_window}")
    if soft_cap is not None and soft_cap <= 0:
        raise KVShapeError(f"soft_cap must be positive, got {soft_cap}")


def paged_attention(
    q: jax.Array,
    kv_buffer: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    layer_index: int | None = None,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Causal paged attention over a ragged batch (decodes first, then prefills).

    ``q: (T, QH, D)``, query head ``qh`` reads KV head ``qh // (QH // H)``. Sequence i
    owns query tokens ``cu_q_lens[i]:cu_q_lens[i+1]`` and its pages are
    ``block_tables[i]``; query j sits at position ``kv_lens[i] - q_len + j`` and sees kv
    positions ``p - sliding_window < kv_pos <= p``. Logits are ``sm_scale * q.k``, then
    ``soft_cap * tanh(x / soft_cap)``. Rows of padding tokens (past
    ``cu_q_lens[num_seqs]``) are zeros. Cache positions no query sees (past a kv
    length, outside the window, padding pages) may hold anything, NaN included.
    Block tables, lengths and ``num_seqs`` are trusted (see the module docstring).

    Token-major: every token gathers its own sequence's pages, so memory is
    O(T * W * block_size); it is the oracle, not the fast path.
    """
    check_paged_attention_args(
        q,
        kv_buffer,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        layer_index=layer_index,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    block_size, num_kv_heads, head_dim = page_dims(kv_buffer)
    num_tokens, num_q_heads, _ = q.shape
    width = block_tables.shape[1]
    seq, position, valid = token_sequences(num_tokens, cu_q_lens, kv_lens, num_seqs)
    pages = block_tables[seq]  # (T, W)
    kv = kv_buffer[pages] if layer_index is None else kv_buffer[pages, layer_index]
    kv = kv.reshape(num_tokens, width * block_size, 2 * num_kv_heads, head_dim)  # (T, L, 2H, D)
    kv_pos = jnp.arange(width * block_size, dtype=jnp.int32)
    mask = attention_mask(kv_pos, position, valid, sliding_window)  # (T, L)
    k = kv[:, :, 0::2].astype(jnp.float32)  # (T, L, H, D)
    v = jnp.where(mask[:, :, None, None], kv[:, :, 1::2].astype(jnp.float32), 0.0)

    num_queries_per_kv = num_q_heads // num_kv_heads
    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, num_queries_per_kv, head_dim)
    logits = jnp.einsum("thgd,tlhd->thgl", qg, k, precision=_HIGHEST) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    mask = mask[:, None, None, :]  # (T, 1, 1, L) against logits (T, H, G, L)
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.where(mask, jnp.exp(logits - jnp.where(mask, row_max, 0.0)), 0.0)
    denom = jnp.sum(probs, axis=-1, keepdims=True)
    out = jnp.einsum("thgl,tlhd->thgd", probs, v, precision=_HIGHEST)
    out = out / jnp.where(denom > 0, denom, 1.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def check_block_buffers(buffers: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """Either one cross-layer buffer or per-layer buffers of one shape and dtype; shared
    by the reference and the kernels."""
    buffers = tuple(buffers)
    if not buffers:
        raise KVShapeError("no buffers given")
    first = buffers[0]
    if first.ndim == CROSS_LAYER_NDIM and len(buffers) == 1:
        return buffers
    if first.ndim == PER_LAYER_NDIM and all(b.shape == first.shape and b.dtype == first.dtype for b in buffers):
        return buffers
    raise KVShapeError(
        f"expected one cross-layer buffer or per-layer buffers of one shape, got shapes {[b.shape for b in buffers]}"
    )


def check_copy_blocks_args(buffers: Sequence[jax.Array], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """The buffers (see :func:`check_block_buffers`) once ``src`` and ``dst`` are equal 1-D
    shapes; shared by the reference and the XLA copy."""
    buffers = check_block_buffers(buffers)
    if src.shape != dst.shape or src.ndim != 1:
        raise KVShapeError(f"src {src.shape} and dst {dst.shape} must be equal 1-D shapes")
    return buffers


def copy_blocks(buffers: Sequence[jax.Array], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """Copy whole blocks (every layer's page): block ``dst[i]`` := block ``src[i]``.

    All sources are read before any write. Pad with ``src = dst = 0`` (null onto
    itself); distinct real ``dst`` ids are the caller's contract.
    """
    buffers = check_copy_blocks_args(buffers, src, dst)
    return tuple(b.at[dst].set(b[src]) for b in buffers)


def check_copy_states_args(buffers: Sequence[jax.Array], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """State buffers (any shapes and dtypes, one leading row count) and equal 1-D
    ``src``/``dst``; shared by the reference, the XLA copy and the TPU kernel."""
    buffers = tuple(buffers)
    if not buffers or any(b.ndim < 1 or b.shape[0] != buffers[0].shape[0] for b in buffers):
        raise KVShapeError(f"expected state buffers of one row count, got shapes {[b.shape for b in buffers]}")
    if src.shape != dst.shape or src.ndim != 1:
        raise KVShapeError(f"src {src.shape} and dst {dst.shape} must be equal 1-D shapes")
    return buffers


def copy_states(buffers: Sequence[jax.Array], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """Copy state rows in every buffer: row ``dst[i]`` := row ``src[i]`` (all sources read
    before any write; pad with ``0 -> 0``; real ``dst`` rows distinct by contract)."""
    buffers = check_copy_states_args(buffers, src, dst)
    return tuple(b.at[dst].set(b[src]) for b in buffers)


def gather_blocks(buffers: Sequence[jax.Array], ids: jax.Array) -> jax.Array:
    """Whole blocks ``(n, num_layers_per_block, block_size, 2*H, D)``, the same in both layouts.

    Cross-layer: ``buffer[ids]``, one contiguous region per block.
    """
    buffers = check_block_buffers(buffers)
    if len(buffers) == 1 and buffers[0].ndim == CROSS_LAYER_NDIM:
        return buffers[0][ids]
    return jnp.stack([b[ids] for b in buffers], axis=1)


def scatter_blocks(buffers: Sequence[jax.Array], ids: jax.Array, data: jax.Array) -> tuple[jax.Array, ...]:
    """Inverse of :func:`gather_blocks`: block ``ids[i]`` := ``data[i]`` (all layers)."""
    buffers = check_block_buffers(buffers)
    cross = buffers[0].ndim == CROSS_LAYER_NDIM
    expected = ids.shape + (buffers[0].shape[1:] if cross else (len(buffers), *buffers[0].shape[1:]))
    if data.shape != expected:
        raise KVShapeError(f"data {data.shape} must be {expected} for ids {ids.shape}")
    data = data.astype(buffers[0].dtype)
    if cross:
        return (buffers[0].at[ids].set(data),)
    return tuple(b.at[ids].set(data[:, i]) for i, b in enumerate(buffers))
