"""Write new tokens' K/V into their cache slots in place, as a Mosaic TPU Pallas kernel.

The cache stays in HBM (``pl.ANY``) and is aliased input -> output, so under a jit that
donates it the update is in place: only the new tokens' bytes move. The new K/V
(interleaved per head, ``(T, 2H, D)``) are copied HBM -> HBM by DMA:

- one DMA per run of ``block_size`` tokens that fills a whole block (prefill);
- one DMA per remaining token (decodes, partial blocks).

Runs are found in the wrapper with a vectorised scan of ``slot_mapping`` and
scalar-prefetched with it. All DMAs are started, then all are waited for. Tokens aimed
at the null block 0 (padding) are dropped: block 0 is a sink whose content nobody reads,
and dropping them keeps duplicate padding slots from racing.

Operands (``T`` new tokens):

- scalar prefetch (SMEM): ``slots_ref`` (T,) int32, the slot mapping; ``full_ref`` (T,)
  int32, 1 where a run of ``block_size`` tokens filling one block starts;
- inputs: the new K/V ``(T, 2H, D)`` and the cache, both in HBM (``pl.ANY``);
- output: the cache, aliased to its input;
- scratch: one DMA semaphore shared by every copy.

Slots are trusted: :func:`jaxkv.device.metadata.build_step_metadata` checks the block ids they
come from; a slot out of range is not checked here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.pallas.reference import check_write_kv_args, interleave_kv
from jaxkv.pallas.tpu._common import Interpret, check_int32, interpret_params, page_ref


def _full_block_runs(slot_mapping: jax.Array, block_size: int) -> jax.Array:
    """int32 (T,): 1 where tokens t..t+bs-1 fill block ``slot // bs`` (> 0) in order."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens < block_size:
        return jnp.zeros((num_tokens,), jnp.int32)
    step = (slot_mapping[1:] == slot_mapping[:-1] + 1).astype(jnp.int32)
    prefix = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(step)])
    starts = num_tokens - block_size + 1
    consecutive = prefix[block_size - 1 : block_size - 1 + starts] - prefix[:starts] == block_size - 1
    first = slot_mapping[:starts]
    full = consecutive & (first % block_size == 0) & (first >= block_size)
    return jnp.pad(full, (0, block_size - 1)).astype(jnp.int32)


def _kernel(
    # Scalar prefetch
    slots_ref,  # (T,) int32, SMEM: global slot of each token
    full_ref,  # (T,) int32, SMEM: 1 where a whole-block run starts
    # Inputs
    kv_ref,  # (T, 2H, D) in HBM: the new K/V, interleaved per head
    cache_in,  # (N, bs, 2H, D) or (N, L, bs, 2H, D) in HBM, aliased with cache_out
    # Output
    cache_out,  # the same shape as cache_in
    # Scratch
    sem,  # DMA semaphore
    *,
    block_size: int,
    layer_index: int | None,
):
    del cache_in  # aliased with cache_out: the same HBM buffer
    num_tokens = slots_ref.shape[0]

    def visit(action):
        """Walk the tokens once, applying ``action`` to each DMA (start or wait)."""

        def body(t):
            slot = slots_ref[t]
            block, offset = lax.div(slot, block_size), lax.rem(slot, block_size)
            full = full_ref[t] == 1
            page = page_ref(cache_out, block, layer_index)  # (bs, 2H, D)

            @pl.when(full)
            def _():
                action(pltpu.make_async_copy(kv_ref.at[pl.ds(t, block_size)], page, sem))

            @pl.when(jnp.logical_and(jnp.logical_not(full), block != 0))
            def _():
                action(pltpu.make_async_copy(kv_ref.at[t], page.at[offset], sem))

            return t + jnp.where(full, block_size, 1)

        lax.while_loop(lambda t: t < num_tokens, body, jnp.int32(0))

    visit(lambda copy: copy.start())
    visit(lambda copy: copy.wait())


def write_kv(
    kv_buffer: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    layer_index: int | None = None,
    interpret: Interpret = False,
) -> jax.Array:
    """Return ``kv_buffer`` with token t's K/V (``k, v: (T, H, D)``) at ``slot_mapping[t]``.

    Same contract as :func:`jaxkv.pallas.reference.write_kv` (global slot =
    ``block_id * block_size + offset``), except that writes into the null block 0 are
    dropped. Donate ``kv_buffer`` under jit for an in-place update. Slots are trusted
    (checked where the metadata is built).
    """
    check_write_kv_args(kv_buffer, k, v, slot_mapping, layer_index=layer_index)
    check_int32(slot_mapping=slot_mapping)
    block_size = kv_buffer.shape[-3]
    if k.shape[0] == 0:
        return kv_buffer
    kv = interleave_kv(k, v, kv_buffer.dtype)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scalar_prefetches = (slot_mapping, _full_block_runs(slot_mapping, block_size))
    scratch_shapes = [pltpu.SemaphoreType.DMA(())]  # every copy signals one semaphore
    return pl.pallas_call(
        functools.partial(_kernel, block_size=block_size, layer_index=layer_index),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_prefetches),
            grid=(),
            in_specs=[any_spec, any_spec],  # kv, cache
            out_specs=any_spec,
            scratch_shapes=scratch_shapes,
        ),
        out_shape=jax.ShapeDtypeStruct(kv_buffer.shape, kv_buffer.dtype),
        input_output_aliases={len(scalar_prefetches) + 1: 0},  # the cache, in place
        interpret=interpret_params(interpret),
        name="jaxkv_write_kv",
    )(*scalar_prefetches, kv, kv_buffer)
