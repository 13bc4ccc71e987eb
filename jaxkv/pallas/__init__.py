"""Kernels for the device ops: ``reference`` (plain jnp, the oracle) and ``tpu`` (Pallas
Mosaic TPU kernels, imported lazily by :mod:`jaxkv.ops`)."""
