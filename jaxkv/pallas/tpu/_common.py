"""Helpers shared by the Mosaic TPU kernels: interpret-mode switch and page views."""

from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu

Interpret = bool | pltpu.InterpretParams


def interpret_params(interpret: Interpret) -> pltpu.InterpretParams | bool:
    """``True`` means the TPU interpreter with default params (DMAs, semaphores, SMEM).

    Plain ``interpret=True`` in ``pallas_call`` selects the generic interpreter, which
    cannot run TPU DMAs or semaphores, so it is never passed through.
    """
    if interpret is True:
        return pltpu.InterpretParams()
    return interpret


def page_ref(kv_ref, block, layer_slot: int | None):
    """The ``(bs, 2H, D)`` page of ``block`` (at ``layer_slot`` in the cross-layer layout)."""
    return kv_ref.at[block] if layer_slot is None else kv_ref.at[block, layer_slot]
