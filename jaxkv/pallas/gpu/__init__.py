"""Mosaic GPU (Hopper) Pallas kernels for the device ops (``interpret=`` runs them on CPU).

- :func:`paged_attention`: ragged prefill+decode batch, causal, GQA, sliding window,
  soft-cap; pages copied by TMA from either cache layout into a ring of shared-memory
  stages, wgmma matmuls, kv splits merged by log-sum-exp. Mirrors
  :func:`jaxkv.pallas.reference.paged_attention`.

KV writes and block copies on a GPU are XLA's (:mod:`jaxkv.pallas.xla`): single
in-bounds scatters of whole rows and blocks.
"""

from jaxkv.pallas.gpu.paged_attention import AttentionTuning, check_supported, paged_attention

__all__ = ["AttentionTuning", "check_supported", "paged_attention"]
