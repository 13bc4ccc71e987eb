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
  page = ``kv[block]`` or ``kv[block, layer_slot]``) into a double buffer in VMEM.
  While a chunk is computed the next work item's pages are already in flight; the
  look-ahead crosses sequence and tile boundaries (the grid runs in order, so the
  first fetch of tile ``t + 1`` is started by the last item of tile ``t``; its buffer
  and first sequence are carried in SMEM).
- Per KV head, an online softmax in float32 over the chunks: running max ``m``,
  normaliser ``l`` and accumulator in VMEM scratch. Rows of other sequences in the
  tile are masked to ``-inf`` and so left exactly unchanged by the update.
- Block tables (flattened), kv lens, cu_q_lens and num_seqs are scalar-prefetched.

The page buffer is ``(2, pages_per_chunk * bs, 2H, D)`` so a page DMA lands in it
without any reshape, and one head's K (or V) is a plain load of row ``2h`` (``2h + 1``)
across it; the TPU interpreter cannot run ``ref.reshape``, so no ref is reshaped.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.pallas.reference import KVShapeError, check_paged_attention_args
from jaxkv.pallas.tpu._common import Interpret, interpret_params, page_ref

DEFAULT_MAX_QUERIES_PER_TILE = 32
DEFAULT_KV_TOKENS_PER_CHUNK = 256
_LANES = 128


@dataclass(frozen=True)
class _Dims:
    """Static sizes the kernel body is specialised on."""

    tq: int  # query tokens per tile
    ppc: int  # pages per chunk
    block_size: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    table_width: int
    max_seqs: int
    layer_slot: int | None
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _sublane_multiple(dtype: jnp.dtype) -> int:
    """Rows per (8, 128) tile for 32-bit, (16, 128) for 16-bit, ... dtypes."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _kernel(
    kv_lens_ref,
    tables_ref,
    cu_ref,
    num_seqs_ref,
    q_ref,
    kv_hbm,
    o_ref,
    kv_vmem,
    sems,
    m_ref,
    l_ref,
    acc_ref,
    state_ref,
    *,
    d: _Dims,
):
    tq, ppc, bs = d.tq, d.ppc, d.block_size
    tile = pl.program_id(0)
    num_tiles = pl.num_programs(0)
    num_seqs = num_seqs_ref[0]
    total_tokens = cu_ref[num_seqs]
    tile_start = tile * tq
    tile_end = tile_start + tq

    def seq_span(t, s):
        """Token range of sequence s, its kv_len, and its pages [lo, hi) for tile t."""
        q_start, q_end, kv_len = cu_ref[s], cu_ref[s + 1], kv_lens_ref[s]
        row_lo = jnp.maximum(q_start, t * tq)
        row_hi = jnp.minimum(q_end, t * tq + tq)
        kv_hi = kv_len - q_end + row_hi  # one past the last row's position
        kv_lo = 0
        if d.sliding_window is not None:
            kv_lo = jnp.maximum(kv_len - q_end + row_lo - d.sliding_window + 1, 0)
        page_lo = lax.div(kv_lo, bs)
        page_hi = jnp.minimum(lax.div(kv_hi + bs - 1, bs), d.table_width)
        page_hi = jnp.where(row_lo < row_hi, page_hi, page_lo)
        return q_start, q_end, kv_len, kv_lo, kv_hi, page_lo, page_hi

    def num_chunks(t, s):
        *_, page_lo, page_hi = seq_span(t, s)
        return lax.div(page_hi - page_lo + ppc - 1, ppc)

    def skip_empty(s):
        """The first sequence >= s that has query tokens (or num_seqs)."""

        def empty(s):
            i = jnp.minimum(s, d.max_seqs - 1)
            return jnp.logical_and(s < num_seqs, cu_ref[i + 1] == cu_ref[i])

        return lax.while_loop(
            empty,
            lambda s: s + 1,
            s,
        )

    def page_copies(t, s, c, buf):
        """(valid, descriptor) per page slot of chunk c of sequence s in tile t."""
        *_, page_lo, page_hi = seq_span(t, s)
        copies = []
        for j in range(ppc):
            page = page_lo + c * ppc + j
            block = tables_ref[s * d.table_width + jnp.minimum(page, d.table_width - 1)]
            src = page_ref(kv_hbm, block, d.layer_slot)
            dst = kv_vmem.at[buf, pl.ds(j * bs, bs)]
            copies.append((page < page_hi, pltpu.make_async_copy(src, dst, sems.at[buf])))
        return copies

    def start_fetch(t, s, c, buf):
        for valid, copy in page_copies(t, s, c, buf):
            pl.when(valid)(copy.start)

    def wait_fetch(t, s, c, buf):
        for valid, copy in page_copies(t, s, c, buf):
            pl.when(valid)(copy.wait)

    def next_item(s, c):
        """The work item after (tile, s, c), possibly the first of the next tile."""
        q_end = cu_ref[s + 1]
        s_next = skip_empty(s + 1)
        more_chunks = c + 1 < num_chunks(tile, s)
        next_in_tile = jnp.logical_and(
            q_end <= tile_end, jnp.logical_and(s_next < num_seqs, cu_ref[s_next] < tile_end)
        )
        first_of_next_tile = jnp.where(q_end > tile_end, s, s_next)
        nt = jnp.where(jnp.logical_or(more_chunks, next_in_tile), tile, tile + 1)
        ns = jnp.where(more_chunks, s, jnp.where(next_in_tile, s_next, first_of_next_tile))
        nc = jnp.where(more_chunks, c + 1, 0)
        return nt, ns, nc

    def compute(s, c, buf):
        q_start, q_end, kv_len, kv_lo, kv_hi, page_lo, _ = seq_span(tile, s)
        chunk_pos = (page_lo + c * ppc) * bs
        rows, cols = d.group * tq, ppc * bs
        token = tile_start + lax.rem(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), tq)
        row_pos = token + (kv_len - q_end)
        col_pos = chunk_pos + lax.broadcasted_iota(jnp.int32, (1, cols), 1)
        mask = jnp.logical_and(jnp.logical_and(token >= q_start, token < q_end), col_pos <= row_pos)
        if d.sliding_window is not None:
            mask = jnp.logical_and(mask, col_pos > row_pos - d.sliding_window)
        v_pos = chunk_pos + lax.broadcasted_iota(jnp.int32, (cols, 1), 0)
        v_live = jnp.logical_and(v_pos >= kv_lo, v_pos < kv_hi)
        for h in range(d.num_kv_heads):
            q = q_ref[h].reshape(rows, d.head_dim)
            k, v = kv_vmem[buf, :, 2 * h, :], kv_vmem[buf, :, 2 * h + 1, :]
            if q.dtype != k.dtype:
                q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
            precision = lax.Precision.HIGHEST if k.dtype == jnp.float32 else None
            logits = lax.dot_general(
                q,
                k,
                (((1,), (1,)), ((), ())),
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            logits = logits * d.sm_scale
            if d.soft_cap is not None:
                logits = d.soft_cap * jnp.tanh(logits / d.soft_cap)
            logits = jnp.where(mask, logits, -jnp.inf)
            m_prev = m_ref[h][:, :1]
            m_next = jnp.maximum(m_prev, jnp.max(logits, axis=1, keepdims=True))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            p = jnp.exp(logits - m_safe)
            alpha = jnp.exp(m_prev - m_safe)
            v = jnp.where(v_live, v, jnp.zeros_like(v))
            pv = jnp.dot(
                p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32
            )
            l_next = alpha * l_ref[h][:, :1] + jnp.sum(p, axis=1, keepdims=True)
            acc_ref[h] = alpha * acc_ref[h] + pv
            m_ref[h] = jnp.broadcast_to(m_next, (rows, _LANES))
            l_ref[h] = jnp.broadcast_to(l_next, (rows, _LANES))

    @pl.when(tile == 0)
    def _prologue():
        first = skip_empty(0)
        state_ref[0] = first
        state_ref[1] = 0

        @pl.when(total_tokens > 0)
        def _():
            start_fetch(0, first, 0, 0)

    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(tile_start < total_tokens)
    def _work():
        def body(carry):
            s, c, buf, _ = carry
            nt, ns, nc = next_item(s, c)
            nbuf = 1 - buf
            has_next = jnp.logical_and(nt < num_tiles, nt * tq < total_tokens)

            @pl.when(has_next)
            def _():
                start_fetch(nt, ns, nc, nbuf)

            wait_fetch(tile, s, c, buf)
            compute(s, c, buf)
            return ns, nc, nbuf, (nt != tile).astype(jnp.int32)

        s, _, buf, _ = lax.while_loop(
            lambda carry: carry[3] == 0,
            body,
            (state_ref[0], jnp.int32(0), state_ref[1], jnp.int32(0)),
        )
        state_ref[0] = s
        state_ref[1] = buf

    for h in range(d.num_kv_heads):
        l = l_ref[h][:, :1]
        out = acc_ref[h] / jnp.where(l == 0.0, 1.0, l)
        o_ref[h] = out.reshape(d.group, tq, d.head_dim).astype(o_ref.dtype)


def _check_inputs(
    q: jax.Array,
    kv_buffer: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    layer_slot: int | None,
    sliding_window: int | None,
    soft_cap: float | None,
) -> None:
    """The reference's argument rules, plus int32 metadata (scalar prefetch needs it)."""
    check_paged_attention_args(
        q, kv_buffer, kv_lens, block_tables, cu_q_lens, num_seqs,
        layer_slot=layer_slot, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    for name, x in (
        ("kv_lens", kv_lens),
        ("block_tables", block_tables),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        if x.dtype != jnp.int32:
            raise KVShapeError(f"{name} must be int32, got {x.dtype}")


def paged_attention(
    q: jax.Array,
    kv_buffer: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    layer_slot: int | None = None,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    queries_per_tile: int | None = None,
    pages_per_chunk: int | None = None,
    vmem_limit_bytes: int | None = None,
    interpret: Interpret = False,
) -> jax.Array:
    """Causal paged attention over a ragged batch, reading pages straight from the cache.

    Same contract as :func:`jaxkv.pallas.reference.paged_attention`: ``q (T, QH, D)``,
    sequence i owns tokens ``cu_q_lens[i]:cu_q_lens[i+1]`` at positions ending at
    ``kv_lens[i] - 1`` and pages ``block_tables[i]``; rows past ``cu_q_lens[num_seqs]``
    are zeros. ``kv_buffer`` is per-layer ``(N, bs, 2H, D)`` or cross-layer
    ``(N, S, bs, 2H, D)`` read at ``layer_slot``.

    Tuning: ``queries_per_tile`` (rows of the ragged batch per grid step, default up to
    32, rounded to the dtype's sublane tile) and ``pages_per_chunk`` (pages per DMA
    batch / softmax step, default ~256 kv tokens). ``interpret`` runs the kernel in the
    TPU interpreter (``True`` or a :class:`pltpu.InterpretParams`).
    """
    _check_inputs(
        q,
        kv_buffer,
        kv_lens,
        block_tables,
        cu_q_lens,
        num_seqs,
        layer_slot,
        sliding_window,
        soft_cap,
    )
    num_tokens, num_q_heads, head_dim = q.shape
    block_size = kv_buffer.shape[-3]
    num_kv_heads = kv_buffer.shape[-2] // 2
    group = num_q_heads // num_kv_heads
    table_width = block_tables.shape[1]

    sub = max(_sublane_multiple(q.dtype), _sublane_multiple(kv_buffer.dtype))
    tq = queries_per_tile or min(DEFAULT_MAX_QUERIES_PER_TILE, _round_up(num_tokens, sub))
    ppc = pages_per_chunk or max(1, min(table_width, DEFAULT_KV_TOKENS_PER_CHUNK // block_size))
    if tq <= 0 or tq % sub or ppc <= 0:
        raise KVShapeError(
            f"queries_per_tile={tq} must be a positive multiple of {sub} and "
            f"pages_per_chunk={ppc} positive"
        )
    num_tiles = -(-num_tokens // tq)
    padded = num_tiles * tq

    qt = q.reshape(num_tokens, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    qt = jnp.pad(qt, ((0, 0), (0, 0), (0, padded - num_tokens), (0, 0)))
    dims = _Dims(
        tq=tq,
        ppc=ppc,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        table_width=table_width,
        max_seqs=block_tables.shape[0],
        layer_slot=layer_slot,
        sm_scale=float(sm_scale),
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    q_spec = pl.BlockSpec((num_kv_heads, group, tq, head_dim), lambda t, *_: (0, 0, t, 0))
    rows = group * tq
    out = pl.pallas_call(
        functools.partial(_kernel, d=dims),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(num_tiles,),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((2, ppc * block_size, 2 * num_kv_heads, head_dim), kv_buffer.dtype),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((num_kv_heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, _LANES), jnp.float32),
                pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),
                pltpu.SMEM((2,), jnp.int32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit_bytes
        ),
        interpret=interpret_params(interpret),
        name="jaxkv_paged_attention",
    )(kv_lens, block_tables.reshape(-1), cu_q_lens, num_seqs, qt, kv_buffer)
    return out[:, :, :num_tokens].transpose(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim)
