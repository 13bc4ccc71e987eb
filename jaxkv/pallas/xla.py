"""The device ops in plain XLA, built for GPUs: the ``xla_gpu`` implementation of :mod:`jaxkv.device.ops`.

- :func:`paged_attention`: an online softmax over chunks of each sequence's pages,
  bounded by the batch's real kv lengths (the contract of
  :func:`jaxkv.pallas.reference.paged_attention`);
- :func:`write_kv` and :func:`copy_blocks`: the reference's scatters, told what the
  metadata guarantees (every index in bounds, real indices distinct) so XLA drops the
  bounds checks and the serialisation a scatter with possibly repeated indices needs
  (on a GPU: atomics or sorting). Padding repeats only indices into the null block 0,
  the sink whose content is never read (attention selects by length, never by a
  page's value), so the order of those racing writes does not matter.

Gathers and scatters of whole blocks (offload staging) stay the reference ops.

Inputs are trusted: block ids and lengths are checked on the host, where
:func:`jaxkv.device.metadata.build_step_metadata` builds them, never here.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxkv.ints import cdiv
from jaxkv.pallas import reference

CHUNK_BYTES = {"cpu": 4 << 20}
"""Size of the pages one step of the attention loop gathers, per backend.

A GPU takes big steps (:data:`DEFAULT_CHUNK_BYTES`: fewer, larger einsums). A CPU wants
the gathered pages to stay in its caches: with 64 MiB steps a 128-token prefill over a
1024-token context ran 4x slower than with 4 MiB ones (hidden 128, float32), which
made a cached prompt's short prefill cost almost as much as the whole prompt's."""
DEFAULT_CHUNK_BYTES = 64 << 20
"""The gather size of one attention loop step on backends not in :data:`CHUNK_BYTES`."""
MAX_CHUNK_TOKENS = 512
"""Most kv positions one step of the attention loop covers."""


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
    chunk_tokens: int | None = None,
) -> jax.Array:
    """Causal paged attention over a ragged batch; same contract as the reference, built for speed.

    Each token reads only its own sequence's pages, through its block table,
    ``chunk_tokens`` kv positions (rounded down to whole blocks; default: what fits the
    backend's :data:`CHUNK_BYTES` for T tokens, at most :data:`MAX_CHUNK_TOKENS`) per loop step,
    with an online softmax in float32: memory O(T * chunk) instead of O(T * table
    width). The loop runs only over the chunks some token can see (lowest window start
    to longest kv length in the batch), so bucketed table widths and empty padding cost
    nothing. A decode token reads each of its pages once; a prefill chunk re-reads its
    pages per query token, the price of staying in plain XLA.

    Masked positions are selected away, never multiplied by zero: whatever a page holds
    past a sequence's kv length or outside its window (NaN included) cannot reach the
    output.
    """
    reference.check_paged_attention_args(
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
    block_size, num_kv_heads, head_dim = reference.page_dims(kv_buffer)
    num_tokens, num_q_heads, _ = q.shape
    num_queries_per_kv = num_q_heads // num_kv_heads
    if chunk_tokens is None:
        token_bytes = num_tokens * 2 * num_kv_heads * head_dim * kv_buffer.dtype.itemsize
        chunk_bytes = CHUNK_BYTES.get(jax.default_backend(), DEFAULT_CHUNK_BYTES)
        chunk_tokens = min(MAX_CHUNK_TOKENS, chunk_bytes // max(token_bytes, 1))
    chunk_blocks = max(1, min(block_tables.shape[1], chunk_tokens // block_size))
    chunk = chunk_blocks * block_size
    width = cdiv(block_tables.shape[1], chunk_blocks) * chunk_blocks
    tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))

    seq, position, valid = reference.token_sequences(num_tokens, cu_q_lens, kv_lens, num_seqs)
    token_tables = tables[seq]  # (T, width)
    lowest = jnp.zeros_like(position) if sliding_window is None else position - sliding_window + 1
    first = jnp.min(jnp.where(valid, jnp.maximum(lowest, 0), width * block_size)) // chunk
    last = cdiv(jnp.max(jnp.where(valid, position + 1, 0)), chunk)  # type: ignore[arg-type]  # traced ints too

    qg = q.reshape(num_tokens, num_kv_heads, num_queries_per_kv, head_dim)  # (T, H, G, D)
    precision = jax.lax.Precision.HIGHEST

    def step(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        row_max, denom, acc = carry  # (T, H, G), (T, H, G), (T, H, G, D)
        pages = jax.lax.dynamic_slice_in_dim(token_tables, j * chunk_blocks, chunk_blocks, 1)
        kv = kv_buffer[pages] if layer_index is None else kv_buffer[pages, layer_index]
        kv = kv.reshape(num_tokens, chunk, 2 * num_kv_heads, head_dim)  # keeps the 2H axis whole
        kv_pos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = reference.attention_mask(kv_pos, position, valid, sliding_window)  # (T, chunk)
        logits = (
            jnp.einsum(
                "thgd,tlhd->thgl",
                qg,
                kv[:, :, 0::2],
                precision=precision,
                preferred_element_type=jnp.float32,
            )
            * sm_scale
        )
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        scale = jnp.exp(row_max - safe_max)
        probs = jnp.exp(logits - safe_max[..., None])
        denom = denom * scale + jnp.sum(probs, axis=-1)
        v = jnp.where(mask[:, :, None, None], kv[:, :, 1::2], 0)  # 0 * NaN is NaN: select
        acc = acc * scale[..., None] + jnp.einsum(
            "thgl,tlhd->thgd",
            probs.astype(kv.dtype),
            v,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return new_max, denom, acc

    shape = (num_tokens, num_kv_heads, num_queries_per_kv)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros((*shape, head_dim), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first, last, step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def write_kv(
    kv_buffer: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer_index: int | None = None,
) -> jax.Array:
    """:func:`jaxkv.pallas.reference.write_kv` as one scatter of whole token rows ``(2H, D)``.

    The buffer is viewed as rows (a free reshape of either layout); real slots are
    distinct and padding slots lie in the null block, so the scatter is declared
    in-bounds with unique indices. Donate ``kv_buffer`` to write in place.
    """
    reference.check_write_kv_args(kv_buffer, k, v, slot_mapping, layer_index=layer_index)
    block_size, num_kv_heads, head_dim = reference.page_dims(kv_buffer)
    rows = kv_buffer.reshape(-1, 2 * num_kv_heads, head_dim)
    row = slot_mapping
    if layer_index is not None:  # (N, L, bs): block b's layer l starts at row (b * L + l) * bs
        block, offset = slot_mapping // block_size, slot_mapping % block_size
        row = (block * kv_buffer.shape[1] + layer_index) * block_size + offset
    new = rows.at[row].set(
        reference.interleave_kv(k, v, kv_buffer.dtype), mode="promise_in_bounds", unique_indices=True
    )
    return new.reshape(kv_buffer.shape)


def copy_blocks(buffers: Sequence[jax.Array], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`jaxkv.pallas.reference.copy_blocks` as one gather and one scatter of whole
    blocks per buffer, declared in-bounds with unique indices (real ``dst`` ids are
    distinct by contract; padding pairs copy the null block onto itself)."""
    buffers = reference.check_copy_blocks_args(buffers, src, dst)
    return tuple(
        b.at[dst].set(b.at[src].get(mode="promise_in_bounds"), mode="promise_in_bounds", unique_indices=True)
        for b in buffers
    )


def copy_states(buffers: Sequence[jax.Array], src: jax.Array, dst: jax.Array) -> tuple[jax.Array, ...]:
    """:func:`jaxkv.pallas.reference.copy_states` as one in-bounds gather and scatter of
    rows per buffer (padding repeats the null row, so indices are not declared unique)."""
    buffers = reference.check_copy_states_args(buffers, src, dst)
    return tuple(b.at[dst].set(b.at[src].get(mode="promise_in_bounds"), mode="promise_in_bounds") for b in buffers)
