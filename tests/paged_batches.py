"""Random ragged paged-attention batches shared by the kernel tests (TPU and GPU).

Cache bytes a kernel must not read (past kv_len, out of the window, other layers'
pages, unused and null blocks) are NaN in the kernel's cache, so a stray read shows
up as NaN in its output; the reference runs on the same cache with those NaNs
replaced by finite noise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.pallas import reference as ref

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 1e-2}


class SeededRng(np.random.Generator):
    """A generator that remembers its seed, for failure messages."""

    def __init__(self, seed: int):
        super().__init__(np.random.PCG64(seed))
        self.seed = seed


def bits(x: jax.Array) -> np.ndarray:
    """The raw bits of an array, so NaNs compare equal to themselves bit for bit."""
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


@dataclass
class Batch:
    """A ragged batch: kernel inputs (poisoned cache) and the reference's clean cache."""

    q: jax.Array
    kv_poisoned: jax.Array
    kv_clean: jax.Array
    kv_lens: jax.Array
    tables: jax.Array
    cu_q_lens: jax.Array
    num_seqs: jax.Array

    def args(self, kv: jax.Array) -> tuple[jax.Array, ...]:
        return (self.q, kv, self.kv_lens, self.tables, self.cu_q_lens, self.num_seqs)


def make_batch(
    rng: SeededRng,
    seqs: list[tuple[int, int]],
    *,
    max_seqs: int,
    block_size: int,
    num_kv_heads: int,
    num_queries_per_kv: int,
    head_dim: int,
    dtype,
    window: int | None = None,
    num_layers_per_block: int | None = None,
    layer_index: int | None = None,
    extra_tokens: int = 3,
    width_slack: int = 1,
) -> Batch:
    """``seqs``: (q_len, kv_len) per real sequence, decodes first. Blocks are random and
    distinct; pages wholly outside every query's window are freed to the null block."""
    bs, h = block_size, num_kv_heads
    num_pages = [-(-kv // bs) for _, kv in seqs]
    width = max([*num_pages, 1]) + width_slack
    num_blocks = 1 + sum(num_pages) + 2
    page_shape = (bs, 2 * h, head_dim)
    full_shape = (num_blocks,) + ((num_layers_per_block,) if layer_index is not None else ()) + page_shape
    kv = np.full(full_shape, np.nan, np.float32)
    layer = kv if layer_index is None else kv[:, layer_index]
    tables = np.zeros((max_seqs, width), np.int32)
    blocks = iter(rng.permutation(np.arange(1, num_blocks)))
    for i, (q_len, kv_len) in enumerate(seqs):
        first_visible = max(kv_len - q_len - (window or kv_len) + 1, 0)
        for p in range(num_pages[i]):
            if window is not None and (p + 1) * bs <= first_visible:
                continue  # out of every query's window: freed, reads as the null block
            b = next(blocks)
            tables[i, p] = b
            n = min(bs, kv_len - p * bs)
            layer[b, :n] = rng.standard_normal((n, *page_shape[1:]))
    clean = np.where(np.isnan(kv), rng.standard_normal(kv.shape), kv)
    q_lens = [q for q, _ in seqs]
    num_tokens = sum(q_lens) + extra_tokens
    cu = np.full(max_seqs + 1, sum(q_lens), np.int32)
    cu[: len(seqs) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    kv_lens = np.zeros(max_seqs, np.int32)
    kv_lens[: len(seqs)] = [kv for _, kv in seqs]
    return Batch(
        q=jnp.asarray(rng.standard_normal((num_tokens, h * num_queries_per_kv, head_dim)), dtype),
        kv_poisoned=jnp.asarray(kv, dtype),
        kv_clean=jnp.asarray(clean, dtype),
        kv_lens=jnp.asarray(kv_lens),
        tables=jnp.asarray(tables),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([len(seqs)], jnp.int32),
    )


def random_seqs(rng: SeededRng, num_decodes: int, num_prefills: int, max_len: int) -> list[tuple[int, int]]:
    """Decodes (q_len 1) then prefill chunks (q_len >= 1, some with a computed prefix)."""
    seqs = [(1, int(rng.integers(1, max_len + 1))) for _ in range(num_decodes)]
    for _ in range(num_prefills):
        q_len = int(rng.integers(1, max_len // 2 + 1))
        seqs.append((q_len, q_len + int(rng.integers(0, max_len // 2 + 1))))
    return seqs


def compare_attention(
    kernel: Callable[..., jax.Array],
    rng: SeededRng,
    batch: Batch,
    *,
    layer_index: int | None = None,
    sm_scale: float = 0.35,
    window: int | None = None,
    soft_cap: float | None = None,
    **tuning,
) -> np.ndarray:
    """Run ``kernel`` (poisoned cache) and the reference (clean cache); compare all rows."""
    kw = {
        "layer_index": layer_index,
        "sm_scale": sm_scale,
        "sliding_window": window,
        "soft_cap": soft_cap,
    }
    out = kernel(*batch.args(batch.kv_poisoned), **kw, **tuning)
    want = ref.paged_attention(*batch.args(batch.kv_clean), **kw)
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    msg = f"seed={rng.seed}"
    assert out.shape == want.shape, msg
    assert np.isfinite(out).all(), f"NaN/inf in the kernel output ({msg})"
    tol = TOL[batch.q.dtype.type]
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol, equal_nan=False, err_msg=msg)
    padding = slice(int(batch.cu_q_lens[int(batch.num_seqs[0])]), None)
    assert not out[padding].any(), f"padding rows must be zero ({msg})"
    return out


def random_batch(
    rng: SeededRng,
    dtype,
    num_kv_heads: int,
    num_queries_per_kv: int,
    head_dim: int,
    block_size: int,
    num_decodes: int,
    num_prefills: int,
    max_len: int,
    *,
    window: int | None = None,
    layer_index: int | None = None,
    num_layers_per_block: int = 3,
) -> Batch:
    """A batch of one case row: random decodes and prefill chunks, one padded sequence,
    in a cross-layer cache of ``num_layers_per_block`` layers when ``layer_index`` is set."""
    seqs = random_seqs(rng, num_decodes, num_prefills, max_len)
    return make_batch(
        rng,
        seqs,
        max_seqs=len(seqs) + 1,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        num_queries_per_kv=num_queries_per_kv,
        head_dim=head_dim,
        dtype=dtype,
        window=window,
        num_layers_per_block=None if layer_index is None else num_layers_per_block,
        layer_index=layer_index,
    )


def ragged_metadata(
    rng: np.random.Generator,
    seqs: list[tuple[int, int]],
    *,
    block_size: int,
    num_blocks: int,
    width: int,
    max_seqs: int,
) -> dict[str, np.ndarray]:
    """Paged-attention metadata for (q_len, kv_len) sequences (decodes first), padded
    to fixed shapes: distinct random non-null blocks, unused table entries 0."""
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((max_seqs, width), np.int32)
    kv_lens = np.zeros(max_seqs, np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    used = 0
    for i, (q_len, kv_len) in enumerate(seqs):
        n = -(-kv_len // block_size)
        tables[i, :n] = ids[used : used + n]
        used += n
        kv_lens[i] = kv_len
        cu[i + 1] = cu[i] + q_len
    cu[len(seqs) + 1 :] = cu[len(seqs)]
    return dict(kv_lens=kv_lens, block_tables=tables, cu_q_lens=cu, num_seqs=np.array([len(seqs)], np.int32))


@dataclass(frozen=True)
class AttentionCase:
    """One random paged-attention batch to check a kernel on: its shapes, mix of decodes
    and prefills, the attention options and the kernel's tuning knobs."""

    dtype: Any
    num_kv_heads: int
    num_queries_per_kv: int
    head_dim: int
    block_size: int
    num_decodes: int
    num_prefills: int
    max_len: int
    window: int | None = None
    soft_cap: float | None = None
    layer_index: int | None = None
    tuning: Any = None
    """The kernel's tuning object (None: its defaults)."""

    def batch(self, rng: SeededRng, **kwargs: Any) -> Batch:
        """A fresh random batch of this case (``kwargs`` go to :func:`random_batch`)."""
        return random_batch(
            rng,
            self.dtype,
            self.num_kv_heads,
            self.num_queries_per_kv,
            self.head_dim,
            self.block_size,
            self.num_decodes,
            self.num_prefills,
            self.max_len,
            window=self.window,
            layer_index=self.layer_index,
            **kwargs,
        )
