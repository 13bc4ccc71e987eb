"""A small reference serving loop over jaxkv: continuous batching on a real model.

- :mod:`jaxkv.serving.scheduler`: which requests run this step (host only, no JAX);
- :mod:`jaxkv.serving.models`: tiny Flax NNX models, paged and dense forwards;
- :mod:`jaxkv.serving.runner`: step metadata and the one jitted step function;
- :mod:`jaxkv.serving.engine`: ``Engine.generate`` driving all of them;
- :mod:`jaxkv.serving.workloads`: shared-prefix prompt batches for demos and benchmarks.

Import the submodules directly; this package imports nothing, so the host-only
scheduler (used by :mod:`jaxkv.serving.simulator`) does not pull in JAX or Flax.
"""
