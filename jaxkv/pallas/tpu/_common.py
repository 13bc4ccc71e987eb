"""Helpers shared by the Mosaic TPU kernels: interpret-mode switch, int32 checks, page views."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from jaxkv.pallas.reference import KVShapeError

Interpret = bool | pltpu.InterpretParams


def interpret_params(interpret: Interpret) -> pltpu.InterpretParams | bool:
    """``True`` means the TPU interpreter with default params (DMAs, semaphores, SMEM).

    Plain ``interpret=True`` in ``pallas_call`` selects the generic interpreter, which
    cannot run TPU DMAs or semaphores, so it is never passed through.
    """
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret


def check_int32(**arrays: jax.Array) -> None:
    """Raise :class:`KVShapeError` naming the first array that is not int32 (scalar
    prefetch and DMA indices need int32)."""
    for name, x in arrays.items():
        if x.dtype != jnp.int32:
            raise KVShapeError(f"{name} {x.shape} must be int32, got {x.dtype}")


def page_ref(kv_ref, block, layer_index: int | None):
    """The ``(bs, 2H, D)`` page of ``block`` (its layer ``layer_index`` in the cross-layer layout)."""
    return kv_ref.at[block] if layer_index is None else kv_ref.at[block, layer_index]
