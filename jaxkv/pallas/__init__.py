"""Implementations of the device ops: ``reference`` (plain jnp, the oracle), ``xla``
(paged attention in plain XLA, the GPU default) and ``tpu`` (Pallas Mosaic TPU kernels,
imported lazily by :mod:`jaxkv.ops`)."""
