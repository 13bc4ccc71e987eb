"""The device side: the cache as a pytree of JAX arrays, the step metadata kernels read,
and the public ops that dispatch to an implementation.

- :mod:`~jaxkv.device.cache`: :class:`KVCache`, the paged attention buffers;
- :mod:`~jaxkv.device.state_pages`, :mod:`~jaxkv.device.state_cache`: recurrent states,
  in the pages of the one block pool or in a pool of their own (:class:`HybridCache`);
- :mod:`~jaxkv.device.metadata`: block tables, slot maps and lengths per step, padded to
  a few bucket shapes (:func:`build_step_metadata`);
- :mod:`~jaxkv.device.ops`: ``write_kv``, ``paged_attention``, block copies, one
  dispatch table over :mod:`jaxkv.pallas`;
- :mod:`~jaxkv.device.mesh`: the tensor-parallel mesh and its shardings;
- :mod:`~jaxkv.device.jax_support`: the jax releases the device side is tested with (imported
  first: without jax, every device module raises one error naming ``jaxkv[device]``).
"""

import jaxkv.device.jax_support  # noqa: F401 - first: a missing or untested jax is refused with the pip hint
from jaxkv.device import ops
from jaxkv.device.cache import KVCache, UnknownLayerError, allocate_kv_cache
from jaxkv.device.metadata import Buckets, ScheduledSeq, StepMetadata, build_step_metadata
from jaxkv.device.state_cache import HybridCache

__all__ = [
    "Buckets",
    "HybridCache",
    "KVCache",
    "ScheduledSeq",
    "StepMetadata",
    "UnknownLayerError",
    "allocate_kv_cache",
    "build_step_metadata",
    "ops",
]
