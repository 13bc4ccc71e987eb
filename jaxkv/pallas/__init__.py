"""Implementations of the device ops: ``reference`` (plain jnp, the oracle), ``xla``
(plain XLA for GPUs), ``tpu`` (Pallas Mosaic TPU kernels) and ``gpu`` (the Pallas Mosaic
GPU attention for Hopper); the Pallas ones are imported lazily by :mod:`jaxkv.device.ops`."""

import jaxkv.device.jax_support  # noqa: F401 - refuses a jax outside the tested range
