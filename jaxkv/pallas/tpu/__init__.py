"""Mosaic TPU Pallas kernels for the device ops (``interpret=`` runs them on CPU).

Each mirrors its plain-jnp oracle in :mod:`jaxkv.pallas.reference`:

- :func:`paged_attention`: ragged prefill+decode batch, causal, GQA, sliding window,
  soft-cap; pages DMA'd from either cache layout with double buffering.
- :func:`write_kv`: new K/V into their slots, cache aliased in place.
- :func:`copy_blocks`: whole-block copies, one DMA per cross-layer block;
  :func:`copy_states`: recurrent state rows, one DMA per row and state buffer.
"""

from jaxkv.pallas.tpu.copy_blocks import copy_blocks, copy_states
from jaxkv.pallas.tpu.paged_attention import AttentionTuning, paged_attention
from jaxkv.pallas.tpu.write_kv import write_kv

__all__ = ["AttentionTuning", "copy_blocks", "copy_states", "paged_attention", "write_kv"]
