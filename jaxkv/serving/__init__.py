"""One engine process: continuous batching over jaxkv's cache.

- :mod:`jaxkv.serving.scheduler`: which requests run this step (host only, no JAX);
- :mod:`jaxkv.serving.runner`: step metadata and the one jitted step function;
- :mod:`jaxkv.serving.offload_connector`: the host tier's loads and stores for the scheduler;
- :mod:`jaxkv.serving.sampling_params`, :mod:`jaxkv.serving.sampler`, :mod:`jaxkv.serving.stopping`:
  what a request asks for, the draw on device, when a sequence stops;
- :mod:`jaxkv.serving.input_processor`: request checks before anything is queued;
- :mod:`jaxkv.serving.output_processor`: per-sequence output state (stops, text,
  logprobs, the ``n`` siblings) turned into deltas;
- :mod:`jaxkv.serving.outputs`: the result types (no JAX: a server or client names them);
- :mod:`jaxkv.serving.engine`: ``Engine.generate`` / ``Engine.step``, the loop
  schedule -> execute -> update -> process driving all of them;
- :mod:`jaxkv.serving.async_engine`: one engine on its own thread, a stream per request;
- :mod:`jaxkv.serving.kv_events`: what the engine caches, published for routers;
- :mod:`jaxkv.serving.logit_check`: served tokens compared with a dense forward;
- :mod:`jaxkv.serving.simulator`, :mod:`jaxkv.serving.workloads`: trace replay through
  the scheduler (host only) and prompt batches for demos and benchmarks.

Import the submodules directly; this package imports nothing, so the host-only
scheduler does not pull in JAX or Flax.
"""
