"""Ragged paged attention (prefill chunks + decodes) as a Mosaic GPU (Hopper) Pallas kernel.

Design
------
- Queries are regrouped head-major (G = query heads per KV head): the G query heads of
  one token are consecutive rows, so one KV head's queries of ``64 / G`` tokens fill one
  64-row tile, the M dimension of a warpgroup matmul (wgmma). The wrapper lays each work
  item's tile out whole, ``(H, items * 64, D)`` (:func:`_item_query_rows`): Mosaic GPU
  only copies by TMA from a dynamic row offset it can prove a multiple of the 8-row
  shared-memory tile, and ``item * 64`` is one.
- Work items: a tile of up to ``64 / G`` consecutive query tokens of one sequence.
  A ragged batch of T tokens over S sequences has at most ``cdiv(T, 64 / G) + S``
  items; the wrapper lays them out with plain jnp (:func:`_work_items`).
- Grid ``(KV heads, items, kv splits)``: every CTA computes one item for one KV head
  over its share of the kv chunks the item's rows can see (causal and sliding window:
  ``[first row - W + 1, last row]``), so a small batch still fills the GPU (split-K,
  "flash decoding"); the wrapper merges the splits with their log-sum-exps
  (:func:`_merge_splits`) and scatters rows back to tokens (:func:`_rows_to_tokens`).
- A kv chunk is 64 positions: ``64 / block_size`` pages (or a slice of one larger
  page). Each page's K and V rows of this KV head are copied by TMA straight from the
  cache in either layout (``kv[block, :, 2h]`` and ``kv[block, :, 2h + 1]``, or
  ``kv[block, layer, ...]``) into a ring of ``num_stages`` shared-memory stages; one
  barrier per stage counts the stage's copies, and chunk ``i + num_stages`` is issued as
  soon as chunk ``i``'s matmuls are done with its stage.
- Per chunk: scores ``q k^T`` by wgmma in float32, scale, soft-cap, mask (selection,
  never multiplication), online softmax in registers, ``p v`` by wgmma. V rows a
  query may not see but a chunk holds (before the window's start, past the kv length:
  stale or NaN pages) are zeroed in shared memory first, on the chunks at either end
  of the range only, since ``0 * NaN`` is NaN.

The Mosaic GPU interpreter (CPU tests) runs everything above except the two wgmma
calls: it cannot transpose a shared-memory operand or read one from registers. In
interpret mode :func:`_scores` and :func:`_weighted_values` compute the same products
with ``dot_general`` on the loaded tiles; the wgmma path is checked by lowering the
kernel for CUDA (tests) and by ``scripts/bench_kernels.py`` on a GPU.

Reading order: static sizes (:class:`_Dims`), operands by name (:class:`_Refs`), the
item's kv span (:class:`_Span`), one chunk's copies (:func:`_fetch_chunk`), the
matmuls (:func:`_scores`, :func:`_weighted_values`), masking and the online softmax
(:func:`_visible`, :func:`_online_softmax_step`), the epilogue (:func:`_store_partial`),
the kernel, then the wrapper. Block tables and lengths are trusted: they are checked
on the host, where :func:`jaxkv.device.metadata.build_step_metadata` builds them.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxkv.ints import cdiv, is_int
from jaxkv.pallas.gpu._interpret import interpret_params
from jaxkv.pallas.reference import KVShapeError, check_paged_attention_args, page_dims

ROWS_PER_TILE = 64
"""Query rows of one KV head per work item: the M of one warpgroup matmul."""
DEFAULT_KV_TOKENS_PER_CHUNK = 64
DEFAULT_NUM_STAGES = 3


@dataclass(frozen=True)
class AttentionTuning:
    """The Hopper kernel's knobs in one object, checked when built.

    ``num_kv_splits``: CTAs one item's kv range is split over (None:
    :func:`default_num_splits`). ``kv_tokens_per_chunk``: kv tokens per TMA copy and
    softmax step (a multiple of the 64-row tile; one of it and the block size divides
    the other). ``num_stages``: shared-memory stages in the copy ring (copies in flight).
    """

    num_kv_splits: int | None = None
    kv_tokens_per_chunk: int = DEFAULT_KV_TOKENS_PER_CHUNK
    num_stages: int = DEFAULT_NUM_STAGES

    def __post_init__(self) -> None:
        for name in ("num_kv_splits", "kv_tokens_per_chunk", "num_stages"):
            value = getattr(self, name)
            if (value is not None or name != "num_kv_splits") and not (is_int(value) and value >= 1):
                raise KVShapeError(f"AttentionTuning.{name} must be a positive int, got {value!r}")


TARGET_CTAS = 2 * 132
"""CTAs the kv split aims for: two waves of an H100's 132 SMs."""
_SWIZZLE_BYTES = 128
_DTYPES = (jnp.bfloat16, jnp.float16)
_SCHEDULE = ("item_seq", "item_first", "item_tokens", "kv_lens", "cu_q_lens", "tables")
"""The int32 vectors packed, in this order, into the kernel's one schedule operand
(:func:`_pack_schedule`)."""


@dataclass(frozen=True)
class _Dims:
    """Static sizes the kernel body is specialised on."""

    num_queries_per_kv: int  # G
    chunk: int  # kv positions per chunk
    block_size: int
    head_dim: int
    table_width: int
    num_stages: int
    num_splits: int
    layer_index: int | None
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None
    interpret: bool
    schedule_offsets: tuple[int, ...]  # where each of _SCHEDULE starts in the schedule

    @property
    def tokens_per_tile(self) -> int:
        return ROWS_PER_TILE // self.num_queries_per_kv

    @property
    def rows_per_copy(self) -> int:
        return min(self.block_size, self.chunk)

    @property
    def copies_per_chunk(self) -> int:
        return self.chunk // self.rows_per_copy


class _Refs(NamedTuple):
    """The kernel's operands by name (S sequences, W table width, M items, N blocks,
    L layers per block, H KV heads, NS kv splits, R = 64 rows, C = chunk)."""

    schedule: Any  # (3M + 2S + 1 + S * W,) int32, GMEM: the vectors of _SCHEDULE, read by _scalar
    q: Any  # (H, M * R, D), GMEM: each item's query rows (token-major, G heads per token), 0-padded
    kv: Any  # (N, bs, 2H, D) or (N, L, bs, 2H, D), GMEM: the cache
    out: Any  # (H, M, NS, R, D) float32, GMEM: normalised partial outputs
    lse: Any  # (H, M, NS, R) float32, GMEM: their log-sum-exps (-inf: saw nothing)
    q_tile: Any  # (R, D), SMEM
    k_stages: Any  # (num_stages, C, D), SMEM
    v_stages: Any  # (num_stages, C, D), SMEM
    out_tile: Any  # (R, D) float32, SMEM
    lse_tile: Any  # (R,) float32, SMEM
    q_barrier: Any  # 1 barrier
    stage_barriers: Any  # num_stages barriers, 2 * copies_per_chunk arrivals each


class _Span(NamedTuple):
    """What one CTA computes: its item's rows and the kv chunks of its split."""

    seq: jax.Array
    first_position: jax.Array  # kv position of the item's first query token
    num_tokens: jax.Array  # real query tokens in the tile
    lowest: jax.Array  # lowest kv position any row sees
    kv_len: jax.Array
    first_chunk: jax.Array
    num_chunks: jax.Array


def _layout(d: _Dims, x: jax.Array, layout: Any) -> jax.Array:
    """``x`` in register layout ``layout`` (the interpreter has no layouts: ``x`` itself)."""
    return x if d.interpret else plgpu.layout_cast(x, layout)


def _iota(d: _Dims, shape: tuple[int, int], dimension: int) -> jax.Array:
    """An int32 iota over ``dimension`` in the wgmma accumulator's register layout."""
    if d.interpret:
        return lax.broadcasted_iota(jnp.int32, shape, dimension)
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)


def _scalar(d: _Dims, refs: _Refs, name: str, index: jax.Array) -> jax.Array:
    """Element ``index`` of the schedule's vector ``name``: ``item_seq``, ``item_first``,
    ``item_tokens`` (per item: its sequence, first query token in the batch, query tokens,
    0 for a padding item), ``kv_lens``, ``cu_q_lens`` or ``tables`` (flattened)."""
    return refs.schedule[d.schedule_offsets[_SCHEDULE.index(name)] + index]


def _span(d: _Dims, refs: _Refs, item: jax.Array, split: jax.Array) -> _Span:
    """The item's sequence and positions, and the chunk range of this kv split."""
    seq = _scalar(d, refs, "item_seq", item)
    first_token = _scalar(d, refs, "item_first", item)
    num_tokens = _scalar(d, refs, "item_tokens", item)
    kv_len = _scalar(d, refs, "kv_lens", seq)
    q_start = _scalar(d, refs, "cu_q_lens", seq)
    q_len = _scalar(d, refs, "cu_q_lens", seq + 1) - q_start
    first_position = kv_len - q_len + (first_token - q_start)
    lowest = jnp.int32(0)
    if d.sliding_window is not None:
        lowest = jnp.maximum(first_position - (d.sliding_window - 1), 0)
    end = first_position + num_tokens  # one past the last row's position
    begin_chunk = lax.div(lowest, jnp.int32(d.chunk))
    end_chunk = lax.div(end + (d.chunk - 1), jnp.int32(d.chunk))
    total = jnp.where(num_tokens > 0, end_chunk - begin_chunk, 0)
    share_begin = lax.div(total * split, jnp.int32(d.num_splits))
    share_end = lax.div(total * (split + 1), jnp.int32(d.num_splits))
    return _Span(seq, first_position, num_tokens, lowest, kv_len, begin_chunk + share_begin, share_end - share_begin)


def _page_rows(d: _Dims, kv_ref: Any, block: jax.Array, offset: jax.Array, row: jax.Array) -> Any:
    """``rows_per_copy`` cache rows of one K (``row = 2h``) or V (``2h + 1``) head of a page."""
    rows = pl.ds(offset, d.rows_per_copy)
    if d.layer_index is None:
        return kv_ref.at[block, rows, row]
    return kv_ref.at[block, d.layer_index, rows, row]


def _fetch_chunk(d: _Dims, refs: _Refs, span: _Span, head: jax.Array, chunk: jax.Array, stage: jax.Array) -> None:
    """Issue the TMA copies of one chunk's K and V rows of ``head`` into ``stage``."""
    barrier = refs.stage_barriers.at[stage]
    for i in range(d.copies_per_chunk):
        position = chunk * d.chunk + i * d.rows_per_copy
        page = jnp.minimum(lax.div(position, jnp.int32(d.block_size)), d.table_width - 1)
        block = _scalar(d, refs, "tables", span.seq * d.table_width + page)
        offset = lax.rem(position, jnp.int32(d.block_size))
        into = pl.ds(i * d.rows_per_copy, d.rows_per_copy)
        plgpu.copy_gmem_to_smem(_page_rows(d, refs.kv, block, offset, 2 * head), refs.k_stages.at[stage, into], barrier)
        plgpu.copy_gmem_to_smem(
            _page_rows(d, refs.kv, block, offset, 2 * head + 1), refs.v_stages.at[stage, into], barrier
        )


def _zero_unseen_values(d: _Dims, refs: _Refs, span: _Span, chunk: jax.Array, stage: jax.Array) -> None:
    """Zero V rows of the stage outside ``[lowest, kv_len)`` (end chunks only): stale pages
    may hold NaN, and a zero probability times NaN is NaN."""
    start = chunk * d.chunk

    @pl.when((start < span.lowest) | (start + d.chunk > span.kv_len))
    def _zero() -> None:
        values = refs.v_stages.at[stage]
        position = start + _iota(d, (d.chunk, d.head_dim), 0)
        seen = (position >= span.lowest) & (position < span.kv_len)
        rows = values[...] if d.interpret else plgpu.load(values, (), layout=plgpu.Layout.WGMMA)
        values[...] = jnp.where(seen, rows, jnp.zeros_like(rows))
        plgpu.commit_smem()


def _scores(d: _Dims, refs: _Refs, stage: jax.Array) -> jax.Array:
    """``q k^T`` of the tile against one chunk, float32 ``(R, C)``."""
    keys = refs.k_stages.at[stage]
    if d.interpret:
        return lax.dot_general(
            refs.q_tile[...], keys[...], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    def product(acc_ref: Any) -> jax.Array:
        plgpu.wgmma(acc_ref, refs.q_tile, keys.transpose((1, 0)))
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((ROWS_PER_TILE, d.chunk), jnp.float32))


def _weighted_values(d: _Dims, refs: _Refs, probs: jax.Array, stage: jax.Array) -> jax.Array:
    """``p v`` of one chunk, float32 ``(R, D)`` (``probs`` in the cache's dtype)."""
    values = refs.v_stages.at[stage]
    if d.interpret:
        return lax.dot_general(probs, values[...], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    def product(acc_ref: Any) -> jax.Array:
        plgpu.wgmma(acc_ref, probs, values)
        return acc_ref[...]

    return pl.run_scoped(product, plgpu.ACC((ROWS_PER_TILE, d.head_dim), jnp.float32))


def _visible(d: _Dims, span: _Span, chunk: jax.Array) -> jax.Array:
    """bool ``(R, C)``: which chunk positions each query row sees (causal, window, real row)."""
    shape = (ROWS_PER_TILE, d.chunk)
    token = lax.div(_iota(d, shape, 0), jnp.int32(d.num_queries_per_kv))
    position = span.first_position + token
    kv_position = chunk * d.chunk + _iota(d, shape, 1)
    seen = (token < span.num_tokens) & (kv_position <= position)
    if d.sliding_window is not None:
        seen &= kv_position > position - d.sliding_window
    return seen


class _Softmax(NamedTuple):
    """The online softmax's running state: row max, normaliser, unnormalised output."""

    row_max: jax.Array  # (R,) float32
    denom: jax.Array  # (R,) float32
    acc: jax.Array  # (R, D) float32


def _online_softmax_step(
    d: _Dims, refs: _Refs, state: _Softmax, scores: jax.Array, seen: jax.Array, stage: jax.Array
) -> _Softmax:
    """Fold one chunk's scores into the running softmax and add its weighted values."""
    logits = scores * d.sm_scale
    if d.soft_cap is not None:
        logits = d.soft_cap * jnp.tanh(logits / d.soft_cap)
    logits = jnp.where(seen, logits, -jnp.inf)
    row_max = jnp.maximum(state.row_max, logits.max(axis=1))
    safe_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)
    rescale = jnp.exp(state.row_max - safe_max)
    probs = jnp.exp(logits - lax.broadcast_in_dim(safe_max, logits.shape, [0]))
    denom = state.denom * rescale + probs.sum(axis=1)
    values = _weighted_values(d, refs, probs.astype(refs.q_tile.dtype), stage)
    acc = state.acc * lax.broadcast_in_dim(rescale, state.acc.shape, [0]) + values
    return _Softmax(row_max, denom, acc)


def _store_partial(refs: _Refs, state: _Softmax, head: jax.Array, item: jax.Array, split: jax.Array) -> None:
    """Write this split's normalised output and log-sum-exp (rows that saw nothing: 0 and -inf)."""
    empty = state.denom == 0.0
    denom = jnp.where(empty, 1.0, state.denom)
    refs.out_tile[...] = state.acc / lax.broadcast_in_dim(denom, state.acc.shape, [0])
    refs.lse_tile[...] = jnp.where(empty, -jnp.inf, state.row_max + jnp.log(denom))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(refs.out_tile, refs.out.at[head, item, split])
    plgpu.copy_smem_to_gmem(refs.lse_tile, refs.lse.at[head, item, split])
    plgpu.wait_smem_to_gmem(0)


def _kernel(d: _Dims, *refs: Any) -> None:
    r = _Refs(*refs)
    head, item, split = lax.axis_index("head"), lax.axis_index("item"), lax.axis_index("split")
    span = _span(d, r, item, split)
    plgpu.copy_gmem_to_smem(r.q.at[head, pl.ds(item * ROWS_PER_TILE, ROWS_PER_TILE)], r.q_tile, r.q_barrier.at[0])
    for i in range(d.num_stages):

        @pl.when(i < span.num_chunks)
        def _prefetch(i: int = i) -> None:
            _fetch_chunk(d, r, span, head, span.first_chunk + i, jnp.int32(i))

    plgpu.barrier_wait(r.q_barrier.at[0])

    def step(i: jax.Array, state: _Softmax) -> _Softmax:
        chunk = span.first_chunk + i
        stage = lax.rem(i, jnp.int32(d.num_stages))
        plgpu.barrier_wait(r.stage_barriers.at[stage])
        _zero_unseen_values(d, r, span, chunk, stage)
        state = _online_softmax_step(d, r, state, _scores(d, r, stage), _visible(d, span, chunk), stage)

        @pl.when(i + d.num_stages < span.num_chunks)
        def _refill() -> None:
            _fetch_chunk(d, r, span, head, chunk + d.num_stages, stage)

        return state

    rows = plgpu.Layout.WGMMA.reduce(1)
    init = _Softmax(
        _layout(d, jnp.full((ROWS_PER_TILE,), -jnp.inf, jnp.float32), rows),
        _layout(d, jnp.zeros((ROWS_PER_TILE,), jnp.float32), rows),
        _layout(d, jnp.zeros((ROWS_PER_TILE, d.head_dim), jnp.float32), plgpu.Layout.WGMMA),
    )
    state = lax.fori_loop(0, span.num_chunks, step, init)
    _store_partial(r, state, head, item, split)


# --------------------------------------------------------------------------- wrapper
class _Items(NamedTuple):
    """The batch's work items (padded to a static count) and each token's place in them."""

    seq: jax.Array  # (M,)
    first: jax.Array  # (M,)
    tokens: jax.Array  # (M,)
    token_item: jax.Array  # (T,) the item holding each token
    token_slot: jax.Array  # (T,) its token index within the item
    token_valid: jax.Array  # (T,)


def _work_items(
    num_tokens: int, tokens_per_tile: int, cu_q_lens: jax.Array, num_seqs: jax.Array, max_items: int
) -> _Items:
    """Split every real sequence's query tokens into tiles of ``tokens_per_tile``."""
    max_seqs = cu_q_lens.shape[0] - 1
    real = jnp.arange(max_seqs) < num_seqs[0]
    q_lens = jnp.where(real, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    tiles_end = jnp.cumsum(tiles)
    tiles_start = tiles_end - tiles
    item = jnp.arange(max_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(tiles_end, item, side="right"), max_seqs - 1).astype(jnp.int32)
    first = cu_q_lens[seq] + (item - tiles_start[seq]) * tokens_per_tile
    tokens = jnp.clip(cu_q_lens[seq] + q_lens[seq] - first, 0, tokens_per_tile)
    tokens = jnp.where(item < tiles_end[-1], tokens, 0).astype(jnp.int32)
    first = jnp.where(tokens > 0, first, 0)  # a padding item: no rows, at token 0

    token = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], token, side="right"), max_seqs - 1)
    within = token - cu_q_lens[token_seq]
    token_item = (tiles_start[token_seq] + within // tokens_per_tile).astype(jnp.int32)
    token_valid = token < cu_q_lens[num_seqs[0]]
    return _Items(seq, first.astype(jnp.int32), tokens, token_item, within % tokens_per_tile, token_valid)


def _item_query_rows(q: jax.Array, items: _Items, num_kv_heads: int) -> jax.Array:
    """``(T, H * G, D)`` queries -> ``(H, M * R, D)``: item m's rows at ``m * R`` (rows past
    its tokens: 0), so the kernel's TMA copy of an item's tile starts at a multiple of
    the 8-row shared-memory tile, which Mosaic GPU must prove for a dynamic offset."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_queries_per_kv = num_q_heads // num_kv_heads
    q_rows = q.reshape(num_tokens, num_kv_heads, num_queries_per_kv, head_dim).transpose(1, 0, 2, 3)
    q_rows = q_rows.reshape(num_kv_heads, num_tokens * num_queries_per_kv, head_dim)
    row = jnp.arange(ROWS_PER_TILE, dtype=jnp.int32)
    rows = items.first[:, None] * num_queries_per_kv + row  # (M, R)
    valid = row < items.tokens[:, None] * num_queries_per_kv
    tiles = jnp.where(valid[None, :, :, None], jnp.take(q_rows, rows, axis=1, mode="clip"), 0)
    return tiles.reshape(num_kv_heads, -1, head_dim)


def _pack_schedule(
    items: _Items, kv_lens: jax.Array, cu_q_lens: jax.Array, block_tables: jax.Array
) -> tuple[jax.Array, tuple[int, ...]]:
    """The small int32 operands as one fresh vector, and where each of :data:`_SCHEDULE` starts.

    Mosaic GPU requires every operand 256-byte aligned; XLA may hand a custom call a
    slice of a larger buffer at any offset (on an H200, an engine step's block tables came
    as "Input buffer 5 is not 256-byte aligned"). A concatenation is a buffer of its own.
    """
    parts = (items.seq, items.first, items.tokens, kv_lens, cu_q_lens, block_tables.reshape(-1))
    offsets = tuple(itertools.accumulate((p.shape[0] for p in parts[:-1]), initial=0))
    return jnp.concatenate([p.astype(jnp.int32) for p in parts]), offsets


def _merge_splits(out: jax.Array, lse: jax.Array) -> jax.Array:
    """``(H, M, NS, R, D)`` partials and ``(H, M, NS, R)`` log-sum-exps -> ``(H, M, R, D)``."""
    top = jnp.max(lse, axis=2, keepdims=True)
    weight = jnp.exp(lse - jnp.where(top == -jnp.inf, 0.0, top))  # exp(-inf) = 0 for empty splits
    total = jnp.sum(weight, axis=2)
    merged = jnp.sum(jnp.where(weight[..., None] > 0, out * weight[..., None], 0.0), axis=2)
    return merged / jnp.where(total > 0, total, 1.0)[..., None]


def _rows_to_tokens(merged: jax.Array, items: _Items, num_queries_per_kv: int) -> jax.Array:
    """``(H, M, R, D)`` item rows -> ``(T, H * G, D)`` token-major output (padding tokens: 0)."""
    num_kv_heads, num_items, _, head_dim = merged.shape
    per_token = merged.reshape(num_kv_heads, num_items, -1, num_queries_per_kv, head_dim)
    rows = per_token[:, items.token_item, items.token_slot]  # (H, T, G, D)
    rows = jnp.where(items.token_valid[None, :, None, None], rows, 0.0)
    return rows.transpose(1, 0, 2, 3).reshape(rows.shape[1], num_kv_heads * num_queries_per_kv, head_dim)


def check_supported(
    q: jax.Array | jax.ShapeDtypeStruct,
    kv_buffer: jax.Array | jax.ShapeDtypeStruct,
    *,
    kv_tokens_per_chunk: int = DEFAULT_KV_TOKENS_PER_CHUNK,
) -> None:
    """Raise :class:`KVShapeError` unless the kernel's tiles fit these shapes (arrays or
    their shapes: ``auto`` asks before anything is traced).

    bf16/fp16 caches (the wgmma operand types); query heads per KV head dividing 64;
    a head dim of whole 128-byte rows; a chunk of whole pages or a page of whole chunks.
    """
    block_size, num_kv_heads, head_dim = page_dims(kv_buffer)
    dtype = jnp.dtype(kv_buffer.dtype)
    if dtype not in map(jnp.dtype, _DTYPES) or q.dtype != dtype:
        raise KVShapeError(f"the Mosaic GPU kernel takes bf16 or fp16 q and cache, got q {q.dtype}, cache {dtype}")
    num_queries_per_kv = q.shape[1] // num_kv_heads
    if ROWS_PER_TILE % num_queries_per_kv:
        raise KVShapeError(f"query heads per KV head must divide {ROWS_PER_TILE}, got {num_queries_per_kv}")
    if head_dim % (_SWIZZLE_BYTES // dtype.itemsize):
        raise KVShapeError(f"head_dim {head_dim} must be a multiple of {_SWIZZLE_BYTES // dtype.itemsize}")
    if kv_tokens_per_chunk % ROWS_PER_TILE:
        raise KVShapeError(f"kv_tokens_per_chunk {kv_tokens_per_chunk} must be a multiple of {ROWS_PER_TILE}")
    if kv_tokens_per_chunk % block_size and block_size % kv_tokens_per_chunk:
        raise KVShapeError(
            f"block_size {block_size} and kv_tokens_per_chunk {kv_tokens_per_chunk}: one must divide the other"
        )


def default_num_splits(num_kv_heads: int, max_items: int, max_chunks: int) -> int:
    """Kv splits so that about :data:`TARGET_CTAS` CTAs run (at most one chunk each)."""
    return max(1, min(max_chunks, cdiv(TARGET_CTAS, num_kv_heads * max_items)))


@functools.partial(
    jax.jit,
    static_argnames=(
        "layer_index",
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "tuning",
        "interpret",
    ),
)
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
    interpret: Any = None,
) -> jax.Array:
    """Causal paged attention over a ragged batch; the contract of
    :func:`jaxkv.pallas.reference.paged_attention`, on a Hopper GPU.

    ``tuning`` holds the kernel's knobs (:class:`AttentionTuning`); ``interpret`` (True or
    ``InterpretGPUParams``) runs the Mosaic GPU interpreter instead of compiling (CPU tests).
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
    kv_tokens_per_chunk, num_stages = tuning.kv_tokens_per_chunk, tuning.num_stages
    check_supported(q, kv_buffer, kv_tokens_per_chunk=kv_tokens_per_chunk)
    params = interpret_params(interpret)
    block_size, num_kv_heads, head_dim = page_dims(kv_buffer)
    num_tokens, num_q_heads, _ = q.shape
    num_queries_per_kv = num_q_heads // num_kv_heads
    max_seqs, table_width = block_tables.shape
    tokens_per_tile = ROWS_PER_TILE // num_queries_per_kv
    max_items = cdiv(num_tokens, tokens_per_tile) + max_seqs
    max_chunks = cdiv(table_width * block_size, kv_tokens_per_chunk)
    num_splits = tuning.num_kv_splits or default_num_splits(num_kv_heads, max_items, max_chunks)
    items = _work_items(num_tokens, tokens_per_tile, cu_q_lens, num_seqs, max_items)
    schedule, schedule_offsets = _pack_schedule(items, kv_lens, cu_q_lens, block_tables)
    d = _Dims(
        num_queries_per_kv=num_queries_per_kv,
        chunk=kv_tokens_per_chunk,
        block_size=block_size,
        head_dim=head_dim,
        table_width=table_width,
        num_stages=num_stages,
        num_splits=num_splits,
        layer_index=layer_index,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        interpret=params is not None,
        schedule_offsets=schedule_offsets,
    )
    q_rows = _item_query_rows(q, items, num_kv_heads)

    elems_per_row = _SWIZZLE_BYTES // jnp.dtype(q.dtype).itemsize
    tiles = (plgpu.TilingTransform((8, elems_per_row)), plgpu.SwizzleTransform(_SWIZZLE_BYTES))
    out, lse = plgpu.kernel(
        functools.partial(_kernel, d),
        out_type=(
            jax.ShapeDtypeStruct((num_kv_heads, max_items, num_splits, ROWS_PER_TILE, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_kv_heads, max_items, num_splits, ROWS_PER_TILE), jnp.float32),
        ),
        scratch_types=[
            plgpu.SMEM((ROWS_PER_TILE, head_dim), q.dtype, transforms=tiles),
            plgpu.SMEM((num_stages, kv_tokens_per_chunk, head_dim), q.dtype, transforms=tiles),
            plgpu.SMEM((num_stages, kv_tokens_per_chunk, head_dim), q.dtype, transforms=tiles),
            plgpu.SMEM((ROWS_PER_TILE, head_dim), jnp.float32),
            plgpu.SMEM((ROWS_PER_TILE,), jnp.float32),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=2 * d.copies_per_chunk, num_barriers=num_stages),
        ],
        grid=(num_kv_heads, max_items, num_splits),
        grid_names=("head", "item", "split"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=params,
    )(schedule, q_rows, kv_buffer)
    merged = _merge_splits(out, lse)
    return _rows_to_tokens(merged, items, num_queries_per_kv).astype(q.dtype)
