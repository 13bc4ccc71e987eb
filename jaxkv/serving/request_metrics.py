"""Request-level Prometheus series under vLLM's names: latencies and token counts per request.

vLLM's dashboards read, besides the engine's gauges and counters
(:mod:`jaxkv.serving.metrics`), histograms of each request's time to first token, time
between its tokens and end-to-end time, counters of prompt and generated tokens, and
finished requests by reason. A server feeds one :class:`RequestTimer` per request with the
deltas it streams (the times are the server's: what its client waits for). Each of the
``n`` sequences of a request counts as one finished request, with its own reason.
prometheus-client is imported when the exporter is built, never by importing this module.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxkv.serving.metrics import import_prometheus_client

if TYPE_CHECKING:
    from jaxkv.serving.engine import RequestDelta

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
"""Histogram buckets (seconds; tokens), the ranges vLLM's own series use."""

HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Time to first token, from the request's arrival", LATENCY_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Time between two tokens of one sequence", LATENCY_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Time from the request's arrival to its sequence's end", REQUEST_BUCKETS),
    "vllm:request_prompt_tokens": ("Prompt tokens per finished request", TOKEN_BUCKETS),
    "vllm:request_generation_tokens": ("Generated tokens per finished request", TOKEN_BUCKETS),
}
COUNTERS = {
    "vllm:prompt_tokens": "Prompt tokens of the requests received",
    "vllm:generation_tokens": "Tokens generated",
}
SUCCESS = "vllm:request_success"
"""Finished requests, labelled ``finished_reason`` (stop, length, abort)."""


class RequestMetrics:
    """The request-level series, registered in ``registry`` with constant ``labels``
    (share the registry of the engine's :class:`~jaxkv.serving.metrics.PrometheusMetrics`)."""

    def __init__(self, *, labels: Mapping[str, str] | None = None, registry: Any = None) -> None:
        prometheus_client = import_prometheus_client()
        self.labels = dict(labels or {})
        self.registry = prometheus_client.CollectorRegistry() if registry is None else registry
        names = list(self.labels)
        self.histograms = {
            name: prometheus_client.Histogram(name, text, names, buckets=buckets, registry=self.registry).labels(
                **self.labels
            )
            for name, (text, buckets) in HISTOGRAMS.items()
        }
        self.counters = {
            name: prometheus_client.Counter(name, text, names, registry=self.registry).labels(**self.labels)
            for name, text in COUNTERS.items()
        }
        self._success = prometheus_client.Counter(
            SUCCESS, "Finished requests by reason", [*names, "finished_reason"], registry=self.registry
        )

    def timer(self, num_prompt_tokens: int, n: int) -> RequestTimer:
        """The timer of a request that arrives now with ``num_prompt_tokens`` and ``n`` sequences."""
        self.counters["vllm:prompt_tokens"].inc(num_prompt_tokens)
        return RequestTimer(self, num_prompt_tokens, n)

    def finished(self, reason: str, num_prompt_tokens: int, num_generated: int, e2e_s: float) -> None:
        """One sequence ended."""
        self._success.labels(**self.labels, finished_reason=reason).inc()
        self.histograms["vllm:e2e_request_latency_seconds"].observe(e2e_s)
        self.histograms["vllm:request_prompt_tokens"].observe(num_prompt_tokens)
        self.histograms["vllm:request_generation_tokens"].observe(num_generated)


class RequestTimer:
    """One request's clock: :meth:`observe` each delta as it is streamed."""

    def __init__(self, metrics: RequestMetrics, num_prompt_tokens: int, n: int) -> None:
        self._metrics = metrics
        self._num_prompt_tokens = num_prompt_tokens
        self._arrival = time.monotonic()
        self._first_token = False
        self._last_token = [self._arrival] * n
        self._generated = [0] * n

    def observe(self, delta: RequestDelta) -> None:
        now = time.monotonic()
        i, count = delta.index, len(delta.token_ids)
        histograms = self._metrics.histograms
        if count:
            if not self._first_token:
                histograms["vllm:time_to_first_token_seconds"].observe(now - self._arrival)
                self._first_token = True
            elif self._generated[i]:
                gap = (now - self._last_token[i]) / count
                for _ in range(count):
                    histograms["vllm:inter_token_latency_seconds"].observe(gap)
            self._metrics.counters["vllm:generation_tokens"].inc(count)
            self._last_token[i] = now
            self._generated[i] += count
        if delta.finish_reason is not None:
            e2e = now - self._arrival
            self._metrics.finished(delta.finish_reason, self._num_prompt_tokens, self._generated[i], e2e)
