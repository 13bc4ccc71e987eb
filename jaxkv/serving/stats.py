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
    The device cache's missed tokens by cause (see
    :class:`~jaxkv.core.manager.PrefixCacheStats`): ``prefix_cache_misses_no_checkpoint``
    (attention matched, no recurrent state there), ``prefix_cache_misses_below_block``
    (past the last whole block), ``prefix_cache_misses_evicted`` (cached, then evicted by
    memory pressure), ``prefix_cache_misses_salt`` (a salted prompt's tokens cached under
    another salt or none), ``prefix_cache_misses_not_cached`` (never cached, e.g. another
    prompt, or evicted long ago); :attr:`host_cache_misses` the tokens the host tier was
    asked for and lacked.
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
    prefix_cache_misses_no_checkpoint: int = 0
    prefix_cache_misses_below_block: int = 0
    prefix_cache_misses_not_cached: int = 0
    prefix_cache_misses_evicted: int = 0
    prefix_cache_misses_salt: int = 0

    @property
    def host_cache_misses(self) -> int:
        """Tokens asked of the host tier that it did not load."""
        return self.host_cache_queries - self.host_cache_hits
