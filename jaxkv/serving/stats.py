"""What one engine step leaves behind for a metrics exporter: gauges and counters.

:class:`EngineStats` is a snapshot the :class:`~jaxkv.serving.engine.Engine` hands to
every step observer (:meth:`~jaxkv.serving.engine.Engine.add_step_observer`) after each
step. Counters are totals since their owner started; an aborted step replaces the
scheduler, so a counter that goes down has restarted (exporters add the new total). Host
imports only: an exporter process may read these without JAX.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """The engine after a step.

    Prefix-cache counters are in tokens, as vLLM counts them: ``prefix_cache_queries``
    are the tokens of admitted requests looked up in the device prefix cache and
    ``prefix_cache_hits`` those found there; ``host_cache_queries`` / ``host_cache_hits``
    the same for the host tier (the tokens past the device hit asked of it, and those
    loaded from it; 0 without a host tier). ``offload_stored_bytes`` and
    ``offload_loaded_bytes`` count bytes moved device -> host and host -> device.
    """

    kv_cache_usage: float
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    host_cache_queries: int = 0
    host_cache_hits: int = 0
    offload_stored_bytes: int = 0
    offload_loaded_bytes: int = 0
