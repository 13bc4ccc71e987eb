"""Copy whole KV blocks in place (copy-on-write, state copies), as a Mosaic TPU kernel.

In the cross-layer layout a block (all layer slots) is one contiguous region, so each
``src -> dst`` pair is ONE HBM -> HBM DMA; with per-layer buffers it is one DMA per
buffer. The buffers are aliased input -> output (in place under a donating jit); all
DMAs are started, then all are waited for. Pairs with ``src == dst`` (the ``0 -> 0``
padding) do nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxkv.pallas.reference import CROSS_LAYER_NDIM, PER_LAYER_NDIM, KVShapeError
from jaxkv.pallas.tpu._common import Interpret, interpret_params


def _check(buffers: tuple[jax.Array, ...], src: jax.Array, dst: jax.Array) -> None:
    if not buffers:
        raise KVShapeError("no buffers given")
    first = buffers[0]
    cross = first.ndim == CROSS_LAYER_NDIM and len(buffers) == 1
    per_layer = first.ndim == PER_LAYER_NDIM and all(
        b.shape == first.shape and b.dtype == first.dtype for b in buffers
    )
    if not (cross or per_layer):
        raise KVShapeError(
            "expected one cross-layer buffer or per-layer buffers of one shape, got shapes "
            f"{[b.shape for b in buffers]}"
        )
    if src.shape != dst.shape or src.ndim != 1 or src.dtype != jnp.int32 or dst.dtype != jnp.int32:
        raise KVShapeError(
            f"src {src.shape} {src.dtype} and dst {dst.shape} {dst.dtype} must be equal 1-D int32"
        )


def _kernel(src_ref, dst_ref, *refs, num_buffers: int):
    outs, sem = refs[num_buffers : 2 * num_buffers], refs[-1]

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


def copy_blocks(
    buffers: Sequence[jax.Array], src: jax.Array, dst: jax.Array, *, interpret: Interpret = False
) -> tuple[jax.Array, ...]:
    """Return ``buffers`` with block ``dst[i]`` := block ``src[i]`` in every layer slot.

    ``buffers``: one cross-layer ``(N, S, bs, 2H, D)`` buffer or per-layer
    ``(N, bs, 2H, D)`` buffers. Contract (as the reference, plus one clause): real
    ``dst`` ids are distinct and none is also a ``src`` of another pair (copy-on-write
    targets are fresh blocks), since the DMAs run concurrently on one buffer. Pad with
    ``src = dst = 0``. Donate the buffers under jit for an in-place copy.
    """
    buffers = tuple(buffers)
    _check(buffers, src, dst)
    if src.shape[0] == 0:
        return buffers
    n = len(buffers)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        lambda *refs: _kernel(*refs, num_buffers=n),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(),
            in_specs=[any_spec] * n,
            out_specs=[any_spec] * n,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=[jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers],
        input_output_aliases={2 + i: i for i in range(n)},
        interpret=interpret_params(interpret),
        name="jaxkv_copy_blocks",
    )(src, dst, *buffers)
    return tuple(out)
