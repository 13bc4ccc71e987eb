"""Copy whole KV blocks, or recurrent state rows, in place as a Mosaic TPU kernel.

In the cross-layer layout a block (all its layers' pages) is one contiguous region, so each
``src -> dst`` pair is ONE HBM -> HBM DMA; with per-layer buffers it is one DMA per
buffer. State rows (:func:`copy_states`: copy-on-write of a prefix-cache checkpoint) are
one DMA per pair and state buffer, whatever each buffer's shape and dtype. The buffers
are aliased input -> output (in place under a donating jit); all DMAs are started, then
all are waited for. Pairs with ``src == dst`` (the ``0 -> 0``
padding) do nothing.

Operands (``B`` buffers, ``P`` pairs):

- scalar prefetch (SMEM): ``src_ref``, ``dst_ref`` (P,) int32;
- inputs: the ``B`` cache buffers in HBM (``pl.ANY``), aliased to the outputs;
- outputs: the same ``B`` buffers;
- scratch: one DMA semaphore shared by every copy.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.pallas.reference import KVShapeError, check_block_buffers, check_copy_states_args
from jaxkv.pallas.tpu._common import Interpret, check_int32, interpret_params


def _check(buffers: tuple[jax.Array, ...], src: jax.Array, dst: jax.Array) -> None:
    """The reference's buffer rules, plus int32 ids (scalar prefetch needs them)."""
    check_block_buffers(buffers)
    if src.shape != dst.shape or src.ndim != 1:
        raise KVShapeError(f"src {src.shape} and dst {dst.shape} must be equal 1-D shapes")
    check_int32(src=src, dst=dst)


def _kernel(
    # Scalar prefetch
    src_ref,  # (P,) int32, SMEM: source block ids
    dst_ref,  # (P,) int32, SMEM: destination block ids
    # Inputs (B of them), then outputs (B), then scratch
    *refs,  # B x (N, ...) in HBM (KV blocks or state rows), in then out; a DMA semaphore
    num_buffers: int,
):
    outs, sem = refs[num_buffers : 2 * num_buffers], refs[-1]  # inputs alias the outputs

    def visit(action):
        def body(i, carry):
            src, dst = src_ref[i], dst_ref[i]

            @pl.when(src != dst)
            def _():
                for out in outs:
                    action(pltpu.make_async_copy(out.at[src], out.at[dst], sem))

            return carry

        lax.fori_loop(0, src_ref.shape[0], body, 0)

    visit(lambda copy: copy.start())
    visit(lambda copy: copy.wait())


def _copy_rows(buffers: tuple[jax.Array, ...], src: jax.Array, dst: jax.Array, interpret: Interpret, name: str):
    """One pallas_call: row ``dst[i]`` := row ``src[i]`` of every buffer, in place."""
    if src.shape[0] == 0:
        return buffers
    n = len(buffers)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    scalar_prefetches = (src, dst)
    scratch_shapes = [pltpu.SemaphoreType.DMA(())]  # every copy signals one semaphore
    out = pl.pallas_call(
        functools.partial(_kernel, num_buffers=n),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(scalar_prefetches),
            grid=(),
            in_specs=[any_spec] * n,
            out_specs=[any_spec] * n,
            scratch_shapes=scratch_shapes,
        ),
        out_shape=[jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers],
        input_output_aliases={len(scalar_prefetches) + i: i for i in range(n)},
        interpret=interpret_params(interpret),
        name=name,
    )(*scalar_prefetches, *buffers)
    return tuple(out)


def copy_blocks(
    buffers: Sequence[jax.Array], src: jax.Array, dst: jax.Array, *, interpret: Interpret = False
) -> tuple[jax.Array, ...]:
    """Return ``buffers`` with block ``dst[i]`` := block ``src[i]``, every layer's page.

    ``buffers``: one cross-layer ``(N, L, bs, 2H, D)`` buffer or per-layer
    ``(N, bs, 2H, D)`` buffers. Contract (as the reference, plus one clause): real
    ``dst`` ids are distinct and none is also a ``src`` of another pair (copy-on-write
    targets are fresh blocks), since the DMAs run concurrently on one buffer. Pad with
    ``src = dst = 0``. Donate the buffers under jit for an in-place copy. Block ids are
    trusted (checked where the metadata is built): an id out of range is not checked here.
    """
    buffers = tuple(buffers)
    _check(buffers, src, dst)
    return _copy_rows(buffers, src, dst, interpret, "jaxkv_copy_blocks")


def copy_states(
    buffers: Sequence[jax.Array], src: jax.Array, dst: jax.Array, *, interpret: Interpret = False
) -> tuple[jax.Array, ...]:
    """Return state ``buffers`` (each ``(rows, ...)``, any dtype) with row ``dst[i]`` :=
    row ``src[i]``; the contract of :func:`copy_blocks` (distinct real ``dst`` rows, none a
    ``src`` of another pair; pad ``0 -> 0``; donate for in place; trusted rows)."""
    buffers = check_copy_states_args(buffers, src, dst)
    check_int32(src=src, dst=dst)
    return _copy_rows(buffers, src, dst, interpret, "jaxkv_copy_states")
