"""Peers of jaxkv's paged attention, timed beside it by ``scripts/bench_kernels.py``.

A peer is another way to compute the same attention on the same K/V: JAX's bundled
kernels, cuDNN, or dense attention over a contiguous copy (the bound a paged kernel can
approach). Each takes a :class:`PagedBatch` (jaxkv's layout: pages of ``2*H`` rows, K of
head ``h`` at row ``2h``, V at ``2h + 1``), converts it to its own layout once, and
returns a :class:`PeerRun` whose ``call`` is only the peer's kernel on the converted
inputs: conversions are never timed. A peer that cannot run a case raises
:class:`NotApplicable` with the reason the table shows.

Benchmark-only: nothing under ``jaxkv/`` imports this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

try:  # Pallas-Triton, deprecated from jax 0.11: it may vanish
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as triton_paged_attention
except ImportError:  # pragma: no cover - depends on the installed jax
    triton_paged_attention = None  # type: ignore[assignment]
try:  # private module: the only way to cuDNN's paged attention from JAX
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
except ImportError:  # pragma: no cover - depends on the installed jax
    cudnn_attention = None  # type: ignore[assignment]
try:  # TPU kernel; its module imports on every backend
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention
except ImportError:  # pragma: no cover - depends on the installed jax
    ragged_paged_attention = None  # type: ignore[assignment]

TRITON_K_SPLITS = 16  # the bundled kernel's defaults, kept: the peer is timed as it ships
TRITON_PAGES_PER_COMPUTE_BLOCK = 8


class NotApplicable(Exception):
    """A peer cannot run this case here; the message is the reason the table shows."""


@dataclass(frozen=True)
class PagedBatch:
    """A ragged paged-attention batch in jaxkv's layout: what the jaxkv columns are timed on.

    ``q`` holds sequence i's tokens at ``cu_q_lens[i]:cu_q_lens[i+1]`` (decodes first,
    no padding tokens); ``kv`` is a per-layer ``(N, bs, 2H, D)`` or cross-layer
    ``(N, L, bs, 2H, D)`` buffer, read at ``layer_index`` when cross-layer.
    """

    q: jax.Array  # (T, QH, D)
    kv: jax.Array
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    block_tables: np.ndarray  # (S, W) int32
    layer_index: int | None
    sm_scale: float
    sliding_window: int | None = None
    soft_cap: float | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def block_size(self) -> int:
        return self.kv.shape[-3]

    @property
    def cu_q_lens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)

    def metadata(self) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(kv_lens, block_tables, cu_q_lens, num_seqs)`` on device, in jaxkv's argument order."""
        return (
            jnp.asarray(self.kv_lens, jnp.int32),
            jnp.asarray(self.block_tables),
            jnp.asarray(self.cu_q_lens),
            jnp.asarray([self.num_seqs], jnp.int32),
        )

    def visible_start(self) -> np.ndarray:
        """Per sequence, the lowest kv position any of its queries sees (window start or 0)."""
        q, kv = np.asarray(self.q_lens), np.asarray(self.kv_lens)
        if self.sliding_window is None:
            return np.zeros_like(kv)
        return np.maximum(kv - q - self.sliding_window + 1, 0)

    def pages(self) -> jax.Array:
        """This layer's pages ``(N, bs, 2H, D)`` (a slice of a cross-layer buffer)."""
        return self.kv if self.layer_index is None else self.kv[:, self.layer_index]


@dataclass(frozen=True)
class PeerRun:
    """A peer ready to time: ``fn(*args)`` on converted inputs; ``rows`` maps its output to
    the reference's ``(T, QH, D)`` rows (outside the timed call)."""

    fn: Callable[..., jax.Array]
    args: tuple[jax.Array, ...]
    rows: Callable[[jax.Array], jax.Array]
    note: str

    def call(self) -> jax.Array:
        return self.fn(*self.args)


def split_kv(pages: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K and V ``(N, bs, H, D)`` each, as separate contiguous arrays (one strided copy each)."""
    return pages[:, :, 0::2], pages[:, :, 1::2]


def require_decode(batch: PagedBatch, why: str) -> None:
    if any(q != 1 for q in batch.q_lens):
        raise NotApplicable(f"decode only ({why})")


def window_tables(batch: PagedBatch) -> tuple[np.ndarray, np.ndarray]:
    """Block tables and kv lengths for a peer with no window argument, decodes only.

    A window is met by dropping the pages before it (as a serving engine frees them):
    each row starts at the window's first page and its length shrinks by the pages
    dropped. Exact only where every window starts on a page boundary; otherwise
    :class:`NotApplicable`.
    """
    tables, lens = batch.block_tables, np.asarray(batch.kv_lens, np.int32)
    if batch.sliding_window is None:
        return tables, lens
    start = batch.visible_start()
    if np.any(start % batch.block_size):
        raise NotApplicable("no window argument, and a window here starts inside a page")
    skip = start // batch.block_size
    shifted = np.zeros_like(tables)
    for i, s in enumerate(skip):
        shifted[i, : tables.shape[1] - s] = tables[i, s:]
    width = max(1, int(np.max(-(-(lens - start) // batch.block_size))))
    return shifted[:, :width], (lens - start).astype(np.int32)


def pad_columns(tables: np.ndarray, width: int) -> np.ndarray:
    """``tables`` widened to ``width`` with null-block (0) entries."""
    return np.pad(tables, ((0, 0), (0, width - tables.shape[1])))


def ragged_rows(batch: PagedBatch) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, offset) of every real query token: its place in a ``(B, T_max)`` padded batch."""
    seq = np.repeat(np.arange(batch.num_seqs), batch.q_lens)
    offset = np.arange(len(seq)) - batch.cu_q_lens[seq]
    return seq, offset


def triton_width(width: int) -> int:
    """A table width the bundled GPU kernel tiles: split in ``TRITON_K_SPLITS`` partitions of
    a whole number of compute blocks (padding pages past a length are never read)."""
    per_split = -(-width // TRITON_K_SPLITS)
    if per_split > TRITON_PAGES_PER_COMPUTE_BLOCK:
        per_split = -(-per_split // TRITON_PAGES_PER_COMPUTE_BLOCK) * TRITON_PAGES_PER_COMPUTE_BLOCK
    return per_split * TRITON_K_SPLITS


def jax_paged_attention(batch: PagedBatch, *, interpret: bool = False) -> PeerRun:
    """JAX's bundled GPU paged attention (Pallas-Triton), decodes only.

    Its layout: K and V pages ``(H, N, bs, D)`` apart, a table row per query token and a
    length per row; no scale argument (q is pre-scaled here, as a model would fold it
    into the q projection) and no window (:func:`window_tables`).
    """
    if triton_paged_attention is None:
        raise NotApplicable(f"jax {jax.__version__} has no jax.experimental.pallas.ops.gpu.paged_attention")
    require_decode(batch, "no ragged prefill")
    tables, lens = window_tables(batch)
    tables = pad_columns(tables, triton_width(tables.shape[1]))
    k, v = (jnp.transpose(x, (2, 0, 1, 3)) for x in split_kv(batch.pages()))  # (H, N, bs, D)
    q = (batch.q.astype(jnp.float32) * batch.sm_scale).astype(batch.q.dtype)
    fn = jax.jit(
        functools.partial(
            triton_paged_attention,
            k_splits=TRITON_K_SPLITS,
            pages_per_compute_block=TRITON_PAGES_PER_COMPUTE_BLOCK,
            attn_logits_soft_cap=batch.soft_cap,
            interpret=interpret,
        )
    )
    args = jax.block_until_ready((q, k, v, jnp.asarray(tables), jnp.asarray(lens)))
    return PeerRun(fn, args, rows=lambda out: out, note="Pallas-Triton; q pre-scaled")


def cudnn_paged_attention(batch: PagedBatch) -> PeerRun:
    """cuDNN's paged attention through the private ``jax._src.cudnn``, decodes only.

    Its layout: K and V pools ``(B * P, bs, H, D)`` apart (exactly ``P`` pages per
    sequence: the pool is padded with zero pages, or rows with null entries, to fit),
    page tables ``(B, 1, P, 1)``, q ``(B, 1, QH, D)``, a padding mask by lengths.
    Prefill is refused: cuDNN's causal mask is top-left aligned, while queries after a
    cached context need it bottom-right. No soft cap; no window (:func:`window_tables`).
    """
    if cudnn_attention is None or not hasattr(cudnn_attention, "paged_attention"):
        raise NotApplicable(f"jax {jax.__version__} has no jax._src.cudnn paged_attention")
    require_decode(batch, "causal mask is top-left aligned")
    if batch.soft_cap is not None:
        raise NotApplicable("no logit soft cap")
    tables, lens = window_tables(batch)
    pages = batch.pages()
    width = max(tables.shape[1], -(-pages.shape[0] // batch.num_seqs))
    tables = pad_columns(tables, width)
    pool = batch.num_seqs * width
    k, v = (jnp.pad(x, ((0, pool - x.shape[0]), (0, 0), (0, 0), (0, 0))) for x in split_kv(pages))
    q = batch.q.reshape(batch.num_seqs, 1, *batch.q.shape[1:])
    fn = jax.jit(
        lambda q, k, v, q_lens, kv_lens, table: cudnn_attention.paged_attention(
            q,
            k,
            v,
            q_lens,
            kv_lens,
            table,
            table,
            scale=batch.sm_scale,
            mask_type=cudnn_attention.MaskType.PADDING,
        )
    )
    args = jax.block_until_ready(
        (
            q,
            k,
            v,
            jnp.ones((batch.num_seqs,), jnp.int32),
            jnp.asarray(lens),
            jnp.asarray(tables).reshape(batch.num_seqs, 1, width, 1),
        )
    )
    return PeerRun(fn, args, rows=lambda out: out.reshape(batch.q.shape), note="cuDNN (private jax._src.cudnn)")


def jax_rpa(batch: PagedBatch) -> PeerRun:
    """JAX's bundled TPU ragged paged attention, in jaxkv's own layout (per-layer only)."""
    if ragged_paged_attention is None:
        raise NotApplicable(f"jax {jax.__version__} has no ragged_paged_attention")
    if batch.layer_index is not None:
        raise NotApplicable("per-layer layout only")
    fn = jax.jit(
        functools.partial(
            ragged_paged_attention,
            sm_scale=batch.sm_scale,
            sliding_window=batch.sliding_window,
            soft_cap=batch.soft_cap,
        )
    )
    return PeerRun(fn, (batch.q, batch.kv, *batch.metadata()), rows=lambda out: out, note="Mosaic TPU")


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    kv_pos: jax.Array,
    kv_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:
    """Causal attention over contiguous K/V in plain jnp; ``(B, T, QH, D)`` out.

    ``q (B, T, QH, D)`` at positions ``q_pos (B, T)``; ``k``, ``v (B, S, H, D)`` at
    ``kv_pos (B, S)``, of which the first ``kv_lens[b]`` are real. Logits accumulate in
    float32; probabilities meet V in V's dtype (as a flash kernel's second matmul does).
    Rows that see nothing are zeros.
    """
    b, t, num_q_heads, d = q.shape
    num_kv_heads = k.shape[2]
    qg = q.reshape(b, t, num_kv_heads, num_q_heads // num_kv_heads, d)
    logits = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=jnp.float32) * sm_scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)
    real = jnp.arange(k.shape[1])[None, :] < kv_lens[:, None]
    mask = real[:, None, :] & (kv_pos[:, None, :] <= q_pos[:, :, None])  # (B, T, S)
    if sliding_window is not None:
        mask &= kv_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    mask = mask[:, None, None]  # against logits (B, H, G, T, S)
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    probs = jnp.where(mask, jnp.exp(logits - jnp.where(mask, row_max, 0.0)), 0.0)
    denom = jnp.sum(probs, axis=-1)
    out = jnp.einsum("bhgts,bshd->bhgtd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, num_q_heads, d).astype(q.dtype)


def contiguous_kv(batch: PagedBatch) -> tuple[jax.Array, jax.Array, np.ndarray, np.ndarray]:
    """Each sequence's visible context copied out of its pages into one row.

    Returns ``k, v (B, S, H, D)`` (zeros past a row's length), their kv positions
    ``(B, S)`` and lengths ``(B,)``; only the span some query sees is copied (a window's
    pages, not the whole context), the least any kernel must read.
    """
    start = batch.visible_start()
    lens = np.asarray(batch.kv_lens) - start
    span = np.arange(max(int(lens.max()), 1))
    real = span[None, :] < lens[:, None]
    pos = np.where(real, start[:, None] + span[None, :], 0)
    page = np.take_along_axis(batch.block_tables, pos // batch.block_size, axis=1)
    dense = batch.pages()[jnp.asarray(page), jnp.asarray(pos % batch.block_size)]  # (B, S, 2H, D)
    dense = jnp.where(jnp.asarray(real)[:, :, None, None], dense, 0)
    k, v = split_kv(dense)
    return k, v, pos.astype(np.int32), lens.astype(np.int32)


def dense_bound(batch: PagedBatch) -> PeerRun:
    """Dense attention over a contiguous copy of the same K/V (no page table): the bound.

    On a GPU, decodes without a soft cap go to cuDNN through
    ``jax.nn.dot_product_attention`` (the copy holds only what each query sees, so a
    length mask is the whole mask); everything else, or where cuDNN refuses the shapes,
    to :func:`dense_attention` in XLA.
    """
    k, v, kv_pos, kv_lens = contiguous_kv(batch)
    seq, offset = ragged_rows(batch)
    q = jnp.zeros((batch.num_seqs, max(batch.q_lens), *batch.q.shape[1:]), batch.q.dtype)
    q = q.at[seq, offset].set(batch.q)
    q_pos = np.asarray(batch.kv_lens)[:, None] - np.asarray(batch.q_lens)[:, None] + np.arange(q.shape[1])[None, :]
    rows = lambda out: out[seq, offset]  # noqa: E731
    decode = all(n == 1 for n in batch.q_lens)
    refusal = ""
    if jax.default_backend() == "gpu" and decode and batch.soft_cap is None:
        cudnn = jax.jit(
            lambda q, k, v, lens: jax.nn.dot_product_attention(
                q, k, v, scale=batch.sm_scale, key_value_seq_lengths=lens, implementation="cudnn"
            )
        )
        args = jax.block_until_ready((q, k, v, jnp.asarray(kv_lens)))
        try:
            cudnn.lower(*args).compile()
        except Exception as err:
            refusal = f"; cuDNN refused: {type(err).__name__}: {str(err)[:120]}"
        else:
            return PeerRun(cudnn, args, rows, note="dense cuDNN (jax.nn.dot_product_attention)")
    fn = jax.jit(
        functools.partial(
            dense_attention, sm_scale=batch.sm_scale, sliding_window=batch.sliding_window, soft_cap=batch.soft_cap
        )
    )
    args = jax.block_until_ready((q, k, v, jnp.asarray(q_pos, jnp.int32), jnp.asarray(kv_pos), jnp.asarray(kv_lens)))
    return PeerRun(fn, args, rows, note="dense XLA (jnp)" + refusal)


@dataclass(frozen=True)
class Peer:
    """A named peer column: where it runs (None: every backend) and how to prepare it."""

    name: str
    backends: frozenset[str] | None
    prepare: Callable[[PagedBatch], PeerRun]


PEERS = (
    Peer("jax_rpa", frozenset({"tpu"}), jax_rpa),
    Peer("jax_paged_attention", frozenset({"gpu"}), jax_paged_attention),
    Peer("cudnn_paged_attention", frozenset({"gpu"}), cudnn_paged_attention),
    Peer("dense_bound", None, dense_bound),
)
