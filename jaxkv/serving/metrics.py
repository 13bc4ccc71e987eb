"""Prometheus metrics of one engine process, under vLLM's names (the ``metrics`` extra).

Routers and autoscalers built for vLLM scrape ``vllm:kv_cache_usage_perc``,
``vllm:num_requests_running`` / ``_waiting``, ``vllm:num_preemptions`` and the
prefix-cache counters; a jaxkv engine exports the same names, so they read it unchanged:

    metrics = PrometheusMetrics(labels={"model_name": "tiny-gemma3"})
    engine.add_step_observer(metrics)
    metrics.serve(8000)  # http://127.0.0.1:8000/metrics: loopback unless a host is named

The host tier is vLLM's "external" prefix cache (``vllm:external_prefix_cache_*``, what
vLLM counts for its KV connectors). Offload bytes have no vLLM name we rely on, so they
are jaxkv's own: ``jaxkv:kv_offload_bytes`` with a ``direction`` label. prometheus-client
is imported when an exporter is built, never by importing this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxkv.errors import JaxkvError
from jaxkv.serving.stats import EngineStats

GAUGES = {
    "vllm:kv_cache_usage_perc": ("KV cache usage: the share of usable device blocks in use (0 to 1)", "kv_cache_usage"),
    "vllm:num_requests_running": ("Requests in the running batch", "num_running"),
    "vllm:num_requests_waiting": ("Requests waiting to be admitted (new or preempted)", "num_waiting"),
}
"""Gauge name -> (help, :class:`EngineStats` field)."""

COUNTERS = {
    "vllm:num_preemptions": ("Preemptions (recompute) of running requests", "num_preemptions"),
    "vllm:prefix_cache_queries": ("Tokens looked up in the device prefix cache", "prefix_cache_queries"),
    "vllm:prefix_cache_hits": ("Tokens found in the device prefix cache", "prefix_cache_hits"),
    "vllm:external_prefix_cache_queries": ("Tokens looked up in the host tier", "host_cache_queries"),
    "vllm:external_prefix_cache_hits": ("Tokens loaded from the host tier", "host_cache_hits"),
}
"""Counter name (without the ``_total`` that Prometheus appends) -> (help, field)."""

WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
"""vLLM's waiting requests by reason; jaxkv's wait for capacity only (``reason="capacity"``)."""
LOOPBACK_HOST = "127.0.0.1"
"""Where :meth:`PrometheusMetrics.serve` listens unless told otherwise."""
OFFLOAD_BYTES = "jaxkv:kv_offload_bytes"
OFFLOAD_DIRECTIONS = {"device_to_host": "offload_stored_bytes", "host_to_device": "offload_loaded_bytes"}
PREFIX_CACHE_MISSES = "vllm:prefix_cache_misses"
MISS_CAUSES = {
    "no_checkpoint": "prefix_cache_misses_no_checkpoint",
    "below_block": "prefix_cache_misses_below_block",
    "not_cached": "prefix_cache_misses_not_cached",
    "evicted": "prefix_cache_misses_evicted",
    "salt": "prefix_cache_misses_salt",
    "host_miss": "host_cache_misses",
}
"""The ``cause`` label of the missed-token counter -> its :class:`EngineStats` field."""


class MetricsUnavailableError(JaxkvError, ImportError):
    """prometheus-client is not installed (``pip install 'jaxkv[metrics]'``)."""


def import_prometheus_client() -> Any:
    """The prometheus_client module; :class:`MetricsUnavailableError` naming the extra without it."""
    try:
        import prometheus_client
    except ImportError as err:
        message = "Prometheus metrics need prometheus-client: pip install 'jaxkv[metrics]'"
        raise MetricsUnavailableError(message) from err
    return prometheus_client


class PrometheusMetrics:
    """A step observer that exports :class:`EngineStats` as Prometheus gauges and counters.

    ``labels`` are constant labels on every series (vLLM labels by ``model_name``);
    ``registry`` defaults to a fresh ``CollectorRegistry``, so two engines in one process
    do not clash (pass ``prometheus_client.REGISTRY`` to use the global one).
    """

    def __init__(self, *, labels: Mapping[str, str] | None = None, registry: Any = None) -> None:
        prometheus_client = import_prometheus_client()
        self.labels = dict(labels or {})
        self.registry = prometheus_client.CollectorRegistry() if registry is None else registry
        names = list(self.labels)
        self._gauges = {
            field: prometheus_client.Gauge(name, text, names, registry=self.registry).labels(**self.labels)
            for name, (text, field) in GAUGES.items()
        }
        self._counters = {
            field: prometheus_client.Counter(name, text, names, registry=self.registry).labels(**self.labels)
            for name, (text, field) in COUNTERS.items()
        }
        waiting = prometheus_client.Gauge(
            WAITING_BY_REASON, "Waiting requests by reason", [*names, "reason"], registry=self.registry
        )
        self._waiting_for_capacity = waiting.labels(**self.labels, reason="capacity")
        offload = prometheus_client.Counter(
            OFFLOAD_BYTES, "KV bytes moved between device and host", [*names, "direction"], registry=self.registry
        )
        for direction, field in OFFLOAD_DIRECTIONS.items():
            self._counters[field] = offload.labels(**self.labels, direction=direction)
        misses = prometheus_client.Counter(
            PREFIX_CACHE_MISSES,
            "Prompt tokens not found in the prefix cache, by cause",
            [*names, "cause"],
            registry=self.registry,
        )
        for cause, field in MISS_CAUSES.items():
            self._counters[field] = misses.labels(**self.labels, cause=cause)
        self._last: dict[str, int] = dict.fromkeys(self._counters, 0)

    def serve(self, port: int, *, host: str = LOOPBACK_HOST) -> Any:
        """Serve the registry over HTTP on ``host:port`` (loopback by default: name an
        interface, e.g. ``"0.0.0.0"``, to let other machines scrape it; port 0 takes a
        free one); the server (``server_address``; ``shutdown()`` stops it)."""
        import prometheus_client

        server, _ = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        return server

    def __call__(self, stats: EngineStats) -> None:
        """Set the gauges and advance the counters to ``stats`` (a total that went down has restarted)."""
        for field, gauge in self._gauges.items():
            gauge.set(getattr(stats, field))
        self._waiting_for_capacity.set(stats.num_waiting)
        for field, counter in self._counters.items():
            total = getattr(stats, field)
            last = self._last[field]
            counter.inc(total - last if total >= last else total)
            self._last[field] = total
