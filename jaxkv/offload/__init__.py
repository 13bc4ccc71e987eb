"""The host-memory offload tier.

- :mod:`jaxkv.offload.catalog`: which (block hash, group) keys the tier holds, and where
  (the offloading manager; host only, no JAX);
- :mod:`jaxkv.offload.policies`: LRU and ARC eviction (host only);
- :mod:`jaxkv.offload.host_blocks`: the places a backend hands out (host only);
- :mod:`jaxkv.offload.host_buffers`: the pinned-host buffer holding the bytes (JAX);
- :mod:`jaxkv.offload.transfer`: bucketed device<->host block copies (JAX).

Import the submodules directly; this package imports nothing, so the host-side
bookkeeping does not pull in JAX. The serving loop joins the tier to a runner in
:mod:`jaxkv.serving.offload_connector`.
"""
