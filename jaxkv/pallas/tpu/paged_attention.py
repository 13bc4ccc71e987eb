"""Ragged paged attention (prefill chunks + decodes) as a Mosaic TPU Pallas kernel.

Design
------
- Grid: one step per tile of ``tq`` consecutive query tokens of the ragged batch
  (``cdiv(T, tq)`` steps, run in order: ``"arbitrary"``). A tile may hold the tail of
  one sequence, several whole decodes and the head of a prefill chunk.
- Queries are passed head-major ``(H, G, T, D)`` (G = query heads per KV head), so the
  ``G * tq`` query rows of one KV head are one aligned 2-D operand of the MXU.
- Work items: for every sequence with rows in the tile, the pages that hold kv
  positions any of those rows can see, i.e. ``[first row - W + 1, last row]`` (causal
  and sliding window), split into chunks of ``pages_per_chunk`` pages. Pages outside
  the span are never fetched; padded sequences (``i >= num_seqs``) and padding tiles
  do no work and their rows come out as zeros.
- Pages are DMA'd from the cache in HBM (``pl.ANY``; per-layer or cross-layer layout,
  page = ``kv[block]`` or ``kv[block, layer_index]``) into a double buffer in VMEM.
  While a chunk is computed the next work item's pages are already in flight; the
  look-ahead crosses sequence and tile boundaries (the grid runs in order, so the
  first fetch of tile ``t + 1`` is started by the last item of tile ``t``; its buffer
  and first sequence are carried in SMEM).
- Per KV head, an online softmax in float32 over the chunks: running max ``m``,
  normaliser ``denom`` and accumulator in VMEM scratch. Rows of other sequences in the
  tile are masked to ``-inf`` and so left exactly unchanged by the update.
- Block tables (flattened), kv lens, cu_q_lens and num_seqs are scalar-prefetched.

The page buffer is ``(2, pages_per_chunk * bs, 2H, D)`` so a page DMA lands in it
without any reshape, and one head's K (or V) is a plain load of row ``2h`` (``2h + 1``)
across it; the TPU interpreter cannot run ``ref.reshape``, so no ref is reshaped.

Reading order: the operands by name with their shapes (:class:`_Refs`), the work-item
walk (:func:`_seq_span`, :func:`_next_item`), one page DMA and a chunk's issue / wait
(:func:`_page_copies`, :func:`_start_chunk_fetch`, :func:`_wait_chunk_fetch`), the
online-softmax update (:func:`_online_softmax_update`), the final normalisation and
store (:func:`_normalize_and_store`), then :func:`_kernel` and the wrapper.
Block tables and lengths are trusted: they are checked on the host, where
:func:`jaxkv.device.metadata.build_step_metadata` builds them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.ints import cdiv, is_int
from jaxkv.pallas.reference import KVShapeError, check_paged_attention_args
from jaxkv.pallas.tpu._common import Interpret, check_int32, interpret_params, page_ref

DEFAULT_MAX_QUERIES_PER_TILE = 32
DEFAULT_KV_TOKENS_PER_CHUNK = 256


@dataclass(frozen=True)
class AttentionTuning:
    """The TPU kernel's knobs in one object, checked when built (None: derived from the batch).

    ``queries_per_tile``: rows of the ragged batch per grid step (default up to 32,
    rounded to the dtype's sublane tile; must be a multiple of it). ``pages_per_chunk``:
    pages per DMA batch and softmax step (default ~256 kv tokens). ``vmem_limit_bytes``:
    Mosaic's scoped VMEM limit (default: the compiler's).
    """

    queries_per_tile: int | None = None
    pages_per_chunk: int | None = None
    vmem_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("queries_per_tile", "pages_per_chunk", "vmem_limit_bytes"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 1):
                raise KVShapeError(f"AttentionTuning.{name} must be None or a positive int, got {value!r}")


_LANES = 128


@dataclass(frozen=True)
class _Dims:
    """Static sizes the kernel body is specialised on."""

    tq: int  # query tokens per tile
    ppc: int  # pages per chunk
    block_size: int
    num_kv_heads: int
    num_queries_per_kv: int  # query heads per KV head (GQA)
    head_dim: int
    table_width: int
    max_seqs: int
    layer_index: int | None
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None


@dataclass(frozen=True)
class _Refs:
    """The kernel's operands by name (shapes: S sequences, W table width, N blocks, L
    layers per block, bs block size, H KV heads, G queries per KV head, D head dim)."""

    # Scalar prefetch (SMEM)
    kv_lens: Any  # (S,) int32: tokens of each sequence after this step
    block_tables: Any  # (S * W,) int32: the block tables, flattened
    cu_q_lens: Any  # (S + 1,) int32: start of each sequence's query tokens
    num_seqs: Any  # (1,) int32: real sequences
    # Input
    q: Any  # (H, G, tq, D) VMEM: this tile's queries, head-major
    kv_hbm: Any  # (N, bs, 2H, D) or (N, L, bs, 2H, D) HBM: the cache, never copied whole
    # Output
    out: Any  # (H, G, tq, D) VMEM
    # Scratch
    kv_bufs: Any  # (2, ppc * bs, 2H, D) VMEM: double buffer of one chunk of pages
    sems: Any  # (2,) DMA semaphores, one per buffer
    m: Any  # (H, G * tq, 128) f32 VMEM: running row max, broadcast over lanes
    denom: Any  # (H, G * tq, 128) f32 VMEM: running softmax normaliser, same
    acc: Any  # (H, G * tq, D) f32 VMEM: running numerator
    next_tile: Any  # (2,) int32 SMEM: first sequence and buffer of the next tile


class _Span(NamedTuple):
    """What sequence s contributes to tile t: its query rows and the pages they see."""

    q_start: jax.Array  # its first query token in the batch
    q_end: jax.Array  # one past its last
    kv_len: jax.Array
    kv_lo: jax.Array | int  # first kv position any of its rows in the tile sees (0 without a window)
    kv_hi: jax.Array  # one past the last
    page_lo: jax.Array  # pages [page_lo, page_hi) of its table hold [kv_lo, kv_hi)
    page_hi: jax.Array


def _sublane_multiple(dtype: jnp.dtype) -> int:
    """Rows per (8, 128) tile for 32-bit, (16, 128) for 16-bit, ... dtypes."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


# ---------------------------------------------------------------- work items: (tile, seq, chunk)


def _seq_span(r: _Refs, d: _Dims, t, s) -> _Span:
    """Token range of sequence s, its kv_len, and its pages [lo, hi) for tile t."""
    q_start, q_end, kv_len = r.cu_q_lens[s], r.cu_q_lens[s + 1], r.kv_lens[s]
    row_lo = jnp.maximum(q_start, t * d.tq)
    row_hi = jnp.minimum(q_end, t * d.tq + d.tq)
    kv_hi = kv_len - q_end + row_hi  # one past the last row's position
    kv_lo: jax.Array | int = 0
    if d.sliding_window is not None:
        kv_lo = jnp.maximum(kv_len - q_end + row_lo - d.sliding_window + 1, 0)
    page_lo = lax.div(kv_lo, d.block_size)
    page_hi = jnp.minimum(lax.div(kv_hi + d.block_size - 1, d.block_size), d.table_width)
    page_hi = jnp.where(row_lo < row_hi, page_hi, page_lo)
    return _Span(q_start, q_end, kv_len, kv_lo, kv_hi, page_lo, page_hi)


def _num_chunks(r: _Refs, d: _Dims, t, s):
    """Chunks of ``ppc`` pages that sequence s reads for tile t."""
    span = _seq_span(r, d, t, s)
    return lax.div(span.page_hi - span.page_lo + d.ppc - 1, d.ppc)


def _skip_empty(r: _Refs, d: _Dims, s):
    """The first sequence >= s that has query tokens (or num_seqs)."""

    def empty(s):
        i = jnp.minimum(s, d.max_seqs - 1)
        return jnp.logical_and(s < r.num_seqs[0], r.cu_q_lens[i + 1] == r.cu_q_lens[i])

    return lax.while_loop(empty, lambda s: s + 1, s)


def _next_item(r: _Refs, d: _Dims, tile, s, c):
    """The work item after (tile, s, c), possibly the first of the next tile."""
    tile_end = (tile + 1) * d.tq
    q_end = r.cu_q_lens[s + 1]
    s_next = _skip_empty(r, d, s + 1)
    more_chunks = c + 1 < _num_chunks(r, d, tile, s)
    next_in_tile = jnp.logical_and(
        q_end <= tile_end,
        jnp.logical_and(s_next < r.num_seqs[0], r.cu_q_lens[s_next] < tile_end),
    )
    first_of_next_tile = jnp.where(q_end > tile_end, s, s_next)
    nt = jnp.where(jnp.logical_or(more_chunks, next_in_tile), tile, tile + 1)
    ns = jnp.where(more_chunks, s, jnp.where(next_in_tile, s_next, first_of_next_tile))
    nc = jnp.where(more_chunks, c + 1, 0)
    return nt, ns, nc


# ---------------------------------------------------------------- page DMAs


def _page_copies(r: _Refs, d: _Dims, t, s, c, buf):
    """(valid, DMA) per page of chunk c of sequence s in tile t, into buffer ``buf``.

    A page past the span (the chunk's tail) is not valid: it is never fetched and its
    rows of the buffer are masked out of the softmax.
    """
    span = _seq_span(r, d, t, s)
    copies = []
    for j in range(d.ppc):
        page = span.page_lo + c * d.ppc + j
        block = r.block_tables[s * d.table_width + jnp.minimum(page, d.table_width - 1)]
        src = page_ref(r.kv_hbm, block, d.layer_index)  # (bs, 2H, D)
        dst = r.kv_bufs.at[buf, pl.ds(j * d.block_size, d.block_size)]  # (bs, 2H, D)
        copies.append((page < span.page_hi, pltpu.make_async_copy(src, dst, r.sems.at[buf])))
    return copies


def _start_chunk_fetch(r: _Refs, d: _Dims, t, s, c, buf) -> None:
    """Issue the DMAs of chunk c of sequence s in tile t into buffer ``buf``."""
    for valid, copy in _page_copies(r, d, t, s, c, buf):
        pl.when(valid)(copy.start)


def _wait_chunk_fetch(r: _Refs, d: _Dims, t, s, c, buf) -> None:
    """Wait for the DMAs :func:`_start_chunk_fetch` issued with the same arguments."""
    for valid, copy in _page_copies(r, d, t, s, c, buf):
        pl.when(valid)(copy.wait)


# ---------------------------------------------------------------- online softmax


def _chunk_masks(r: _Refs, d: _Dims, tile, s, c):
    """Which (query row, kv column) pairs of chunk c count, and which kv rows are live.

    ``mask (G * tq, ppc * bs)``: the row is sequence s's token and the column within its
    causal window. ``v_live (ppc * bs, 1)``: the column is inside the sequence's span
    (fetched and written); V elsewhere in the buffer is stale or never fetched.
    """
    span = _seq_span(r, d, tile, s)
    chunk_pos = (span.page_lo + c * d.ppc) * d.block_size
    rows, cols = d.num_queries_per_kv * d.tq, d.ppc * d.block_size
    token = tile * d.tq + lax.rem(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), d.tq)
    row_pos = token + (span.kv_len - span.q_end)
    col_pos = chunk_pos + lax.broadcasted_iota(jnp.int32, (1, cols), 1)
    mask = jnp.logical_and(jnp.logical_and(token >= span.q_start, token < span.q_end), col_pos <= row_pos)
    if d.sliding_window is not None:
        mask = jnp.logical_and(mask, col_pos > row_pos - d.sliding_window)
    v_pos = chunk_pos + lax.broadcasted_iota(jnp.int32, (cols, 1), 0)
    v_live = jnp.logical_and(v_pos >= span.kv_lo, v_pos < span.kv_hi)
    return mask, v_live


def _online_softmax_update(r: _Refs, d: _Dims, h: int, buf, mask, v_live) -> None:
    """Fold KV head h's part of the chunk in buffer ``buf`` into its running m, denom, acc.

    Masked logits are -inf and masked V rows are selected to 0, so rows of other
    sequences stay exactly unchanged and stale buffer contents (NaN too) never leak.
    """
    rows = d.num_queries_per_kv * d.tq
    q = r.q[h].reshape(rows, d.head_dim)  # (G * tq, D)
    k = r.kv_bufs[buf, :, 2 * h, :]  # (ppc * bs, D)
    v = r.kv_bufs[buf, :, 2 * h + 1, :]  # (ppc * bs, D)
    if q.dtype != k.dtype:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
    logits = lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # (G * tq, ppc * bs)
    logits = logits * d.sm_scale
    if d.soft_cap is not None:
        logits = d.soft_cap * jnp.tanh(logits / d.soft_cap)
    logits = jnp.where(mask, logits, -jnp.inf)
    m_prev = r.m[h][:, :1]  # (G * tq, 1)
    m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
    m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    p = jnp.exp(logits - m_safe)
    alpha = jnp.exp(m_prev - m_safe)
    v = jnp.where(v_live, v, jnp.zeros_like(v))
    pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
    denom_next = alpha * r.denom[h][:, :1] + jnp.sum(p, axis=1, keepdims=True)
    r.acc[h] = alpha * r.acc[h] + pv
    r.m[h] = jnp.broadcast_to(m_next, (rows, _LANES))
    r.denom[h] = jnp.broadcast_to(denom_next, (rows, _LANES))


def _reset_accumulators(r: _Refs) -> None:
    """m = -inf, denom = 0, acc = 0 for every row of the tile."""
    r.m[...] = jnp.full(r.m.shape, -jnp.inf, jnp.float32)
    r.denom[...] = jnp.zeros(r.denom.shape, jnp.float32)
    r.acc[...] = jnp.zeros(r.acc.shape, jnp.float32)


def _normalize_and_store(r: _Refs, d: _Dims) -> None:
    """out = acc / denom per KV head; rows that saw nothing (denom == 0) stay zeros."""
    for h in range(d.num_kv_heads):
        denom = r.denom[h][:, :1]
        out = r.acc[h] / jnp.where(denom == 0.0, 1.0, denom)
        r.out[h] = out.reshape(d.num_queries_per_kv, d.tq, d.head_dim).astype(r.out.dtype)


# ---------------------------------------------------------------- the kernel


def _process_tile(r: _Refs, d: _Dims, tile) -> None:
    """Every work item of ``tile``, each one prefetching the next item's pages first."""

    def body(carry):
        s, c, buf, _ = carry
        nt, ns, nc = _next_item(r, d, tile, s, c)
        nbuf = 1 - buf
        has_next = jnp.logical_and(nt < pl.num_programs(0), nt * d.tq < r.cu_q_lens[r.num_seqs[0]])

        @pl.when(has_next)
        def _prefetch_next() -> None:
            _start_chunk_fetch(r, d, nt, ns, nc, nbuf)

        _wait_chunk_fetch(r, d, tile, s, c, buf)
        mask, v_live = _chunk_masks(r, d, tile, s, c)
        for h in range(d.num_kv_heads):
            _online_softmax_update(r, d, h, buf, mask, v_live)
        return ns, nc, nbuf, (nt != tile).astype(jnp.int32)

    s, _, buf, _ = lax.while_loop(
        lambda carry: carry[3] == 0,
        body,
        (r.next_tile[0], jnp.int32(0), r.next_tile[1], jnp.int32(0)),
    )
    r.next_tile[0] = s
    r.next_tile[1] = buf


def _kernel(*refs, d: _Dims):
    r = _Refs(*refs)
    tile = pl.program_id(0)
    total_tokens = r.cu_q_lens[r.num_seqs[0]]

    @pl.when(tile == 0)
    def _prologue():
        first = _skip_empty(r, d, 0)
        r.next_tile[0] = first
        r.next_tile[1] = 0

        @pl.when(total_tokens > 0)
        def _():
            _start_chunk_fetch(r, d, 0, first, 0, 0)

    _reset_accumulators(r)

    @pl.when(tile * d.tq < total_tokens)
    def _work():
        _process_tile(r, d, tile)

    _normalize_and_store(r, d)


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
    tuning: AttentionTuning = AttentionTuning(),
    interpret: Interpret = False,
) -> jax.Array:
    """Causal paged attention over a ragged batch, reading pages straight from the cache.

    Same contract as :func:`jaxkv.pallas.reference.paged_attention`: ``q (T, QH, D)``,
    sequence i owns tokens ``cu_q_lens[i]:cu_q_lens[i+1]`` at positions ending at
    ``kv_lens[i] - 1`` and pages ``block_tables[i]``; rows past ``cu_q_lens[num_seqs]``
    are zeros. ``kv_buffer`` is per-layer ``(N, bs, 2H, D)`` or cross-layer
    ``(N, L, bs, 2H, D)`` read at ``layer_index``. Block tables and lengths are trusted
    (checked where the metadata is built): the kernel DMAs whatever block ids it gets.

    ``tuning`` holds the kernel's knobs (:class:`AttentionTuning`). ``interpret`` runs the
    kernel in the TPU interpreter (``True`` or a :class:`pltpu.InterpretParams`).
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
    check_int32(kv_lens=kv_lens, block_tables=block_tables, cu_q_lens=cu_q_lens, num_seqs=num_seqs)
    num_tokens, num_q_heads, head_dim = q.shape
    block_size = kv_buffer.shape[-3]
    num_kv_heads = kv_buffer.shape[-2] // 2
    num_queries_per_kv = num_q_heads // num_kv_heads
    table_width = block_tables.shape[1]

    sub = max(_sublane_multiple(q.dtype), _sublane_multiple(kv_buffer.dtype))
    tq = tuning.queries_per_tile or min(DEFAULT_MAX_QUERIES_PER_TILE, cdiv(num_tokens, sub) * sub)
    ppc = tuning.pages_per_chunk or max(1, min(table_width, DEFAULT_KV_TOKENS_PER_CHUNK // block_size))
    if tq % sub:
        raise KVShapeError(f"queries_per_tile={tq} must be a multiple of {sub} (the sublane tile of {q.dtype})")
    num_tiles = cdiv(num_tokens, tq)
    padded = num_tiles * tq

    # (T, QH, D) -> (H, G, T_padded, D): a tile's G * tq rows of one KV head are one operand.
    qt = q.reshape(num_tokens, num_kv_heads, num_queries_per_kv, head_dim).transpose(1, 2, 0, 3)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, padded - num_tokens), (0, 0)))
    dims = _Dims(
        tq=tq,
        ppc=ppc,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        num_queries_per_kv=num_queries_per_kv,
        head_dim=head_dim,
        table_width=table_width,
        max_seqs=block_tables.shape[0],
        layer_index=layer_index,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    rows = num_queries_per_kv * tq
    # The operand lists, in the order of _Refs.
    scalar_prefetches = (kv_lens, block_tables.reshape(-1), cu_q_lens, num_seqs)
    q_spec = pl.BlockSpec((num_kv_heads, num_queries_per_kv, tq, head_dim), lambda t, *_: (0, 0, t, 0))
    in_specs = [
        q_spec,  # q: this tile's rows
        pl.BlockSpec(memory_space=pl.ANY),  # kv_hbm: the cache stays in HBM
    ]
    scratch_shapes = [
        pltpu.VMEM((2, ppc * block_size, 2 * num_kv_heads, head_dim), kv_buffer.dtype),  # kv_bufs
        pltpu.SemaphoreType.DMA((2,)),  # sems
        pltpu.VMEM((num_kv_heads, rows, _LANES), jnp.float32),  # m
        pltpu.VMEM((num_kv_heads, rows, _LANES), jnp.float32),  # denom
        pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),  # acc
        pltpu.SMEM((2,), jnp.int32),  # next_tile
    ]
    out = pl.pallas_call(
        functools.partial(_kernel, d=dims),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_prefetches),
            grid=(num_tiles,),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=scratch_shapes,
        ),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=tuning.vmem_limit_bytes
        ),
        interpret=interpret_params(interpret),
        name="jaxkv_paged_attention",
    )(*scalar_prefetches, qt, kv_buffer)
    return out[:, :, :num_tokens].transpose(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim)
