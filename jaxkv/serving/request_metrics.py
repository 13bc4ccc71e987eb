"""Request-level Prometheus series under vLLM's names, with vLLM 0.33's buckets.

vLLM's dashboards read, besides the engine's gauges and counters
(:mod:`jaxkv.serving.metrics`), per-request histograms: time to first token, time between
tokens, end-to-end time and its phases (queued, prefill, decode, inference: scheduled to
last token), time per output token, prompt / generated / recomputed prompt tokens,
preemptions, the ``n`` and ``max_tokens`` asked for; counters of prompt, cached and
generated tokens, and finished requests by reason. As in vLLM each of a request's ``n``
sequences is one request (its own first token, phases and reason); ``n`` and the longest
sequence's tokens are observed once per request, when its last sequence ends.

A server feeds one :class:`RequestTimer` per request with the deltas it streams; the token
times are the server's (what its client waits for), the queue times the engine thread's
(:class:`~jaxkv.serving.async_engine.RequestStream`: when the engine took the request and
first scheduled each sequence). prometheus-client is imported when the exporter is built,
never by importing this module.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from jaxkv.serving.metrics import import_prometheus_client

if TYPE_CHECKING:
    from jaxkv.serving.outputs import RequestDelta

# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
# fmt: on
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
"""Histogram buckets (seconds; counts): vLLM 0.33's ``vllm/v1/metrics/buckets.py`` families."""


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_model_len``."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


TIME_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Time to first token, from the request's arrival", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Time between two outputs of one sequence", ITL_BUCKETS),
    "vllm:request_time_per_output_token_seconds": ("Decode time per output token after the first", ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Time from the request's arrival to its sequence's end", REQUEST_BUCKETS),
    "vllm:request_queue_time_seconds": ("Time from the engine's taking a sequence to its scheduling", REQUEST_BUCKETS),
    "vllm:request_prefill_time_seconds": ("Time from first scheduling to first token", REQUEST_BUCKETS),
    "vllm:request_decode_time_seconds": ("Time from first token to last token", REQUEST_BUCKETS),
    "vllm:request_inference_time_seconds": ("Time from first scheduling to last token", REQUEST_BUCKETS),
    "vllm:request_params_n": ("The n request parameter", N_BUCKETS),
    "vllm:request_num_preemptions": ("Preemptions of a finished sequence", PREEMPTION_BUCKETS),
}
TOKEN_HISTOGRAMS = {
    "vllm:request_prompt_tokens": "Prompt tokens per finished sequence",
    "vllm:request_generation_tokens": "Generated tokens per finished sequence",
    "vllm:request_params_max_tokens": "The max_tokens request parameter, per finished sequence",
    "vllm:request_max_num_generation_tokens": "The most tokens any sequence of a request generated",
    "vllm:request_prefill_kv_computed_tokens": "Prompt tokens computed (not found cached) per finished sequence",
}
COUNTERS = {
    "vllm:prompt_tokens": "Prompt tokens of sequences that drew their first token",
    "vllm:prompt_tokens_cached": "Prompt tokens found in the prefix cache (device and host tier)",
    "vllm:generation_tokens": "Tokens generated",
}
SUCCESS = "vllm:request_success"
"""Finished requests, labelled ``finished_reason`` (stop, length, abort)."""


class SequenceTimes(Protocol):
    """What the engine thread saw of a request's ``n`` sequences
    (:class:`~jaxkv.serving.async_engine.RequestStream`); times are ``time.monotonic()``."""

    @property
    def n(self) -> int: ...
    @property
    def queued_at(self) -> float | None: ...
    def scheduled_at(self, index: int) -> float | None: ...
    def num_preemptions(self, index: int) -> int: ...


class RequestMetrics:
    """The request-level series, registered in ``registry`` with constant ``labels``
    (share the registry of the engine's :class:`~jaxkv.serving.metrics.PrometheusMetrics`);
    token counts bucketed up to ``max_model_len``."""

    def __init__(self, *, max_model_len: int, labels: Mapping[str, str] | None = None, registry: Any = None) -> None:
        prometheus_client = import_prometheus_client()
        self.labels = dict(labels or {})
        self.registry = prometheus_client.CollectorRegistry() if registry is None else registry
        names = list(self.labels)
        histograms = dict(TIME_HISTOGRAMS)
        tokens = token_buckets(max_model_len)
        histograms.update({name: (text, tokens) for name, text in TOKEN_HISTOGRAMS.items()})
        self.histograms = {
            name: prometheus_client.Histogram(name, text, names, buckets=buckets, registry=self.registry).labels(
                **self.labels
            )
            for name, (text, buckets) in histograms.items()
        }
        self.counters = {
            name: prometheus_client.Counter(name, text, names, registry=self.registry).labels(**self.labels)
            for name, text in COUNTERS.items()
        }
        self._success = prometheus_client.Counter(
            SUCCESS, "Finished requests by reason", [*names, "finished_reason"], registry=self.registry
        )

    def timer(self, stream: SequenceTimes, arrival: float, num_prompt_tokens: int, max_tokens: int) -> RequestTimer:
        """The timer of a request that arrived at ``arrival`` (``time.monotonic()``, before the
        engine took it as ``stream``), with ``num_prompt_tokens`` and ``max_tokens`` per sequence."""
        return RequestTimer(self, stream, num_prompt_tokens, max_tokens, arrival)

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)

    def count(self, name: str, value: float) -> None:
        self.counters[name].inc(value)

    def succeeded(self, reason: str) -> None:
        self._success.labels(**self.labels, finished_reason=reason).inc()


class RequestTimer:
    """One request's clock: :meth:`observe` each delta of its stream as it is read."""

    def __init__(
        self, metrics: RequestMetrics, stream: SequenceTimes, num_prompt_tokens: int, max_tokens: int, arrival: float
    ) -> None:
        self._metrics = metrics
        self._stream = stream
        self._num_prompt_tokens = num_prompt_tokens
        self._max_tokens = max_tokens
        self._arrival = arrival
        n = stream.n
        self._first_token: list[float | None] = [None] * n
        self._last_token: list[float | None] = [None] * n
        self._generated = [0] * n
        self._unfinished = n

    def observe(self, delta: RequestDelta) -> None:
        now = time.monotonic()
        i, metrics = delta.index, self._metrics
        if delta.token_ids:
            last = self._last_token[i]
            if last is None:
                self._first_token[i] = now
                metrics.observe("vllm:time_to_first_token_seconds", now - self._arrival)
                metrics.count("vllm:prompt_tokens", self._num_prompt_tokens)
            else:
                metrics.observe("vllm:inter_token_latency_seconds", now - last)
            metrics.count("vllm:generation_tokens", len(delta.token_ids))
            self._last_token[i] = now
            self._generated[i] += len(delta.token_ids)
        if delta.finish_reason is not None:
            self._finished(delta, now)

    def _finished(self, delta: RequestDelta, now: float) -> None:
        """Sequence ``delta.index`` ended: its reason, counts and phases; ``n`` once all have."""
        i, metrics = delta.index, self._metrics
        generated = self._generated[i]
        metrics.succeeded(delta.finish_reason or "abort")
        metrics.observe("vllm:e2e_request_latency_seconds", now - self._arrival)
        metrics.observe("vllm:request_prompt_tokens", self._num_prompt_tokens)
        metrics.observe("vllm:request_generation_tokens", generated)
        metrics.observe("vllm:request_params_max_tokens", self._max_tokens)
        metrics.observe("vllm:request_num_preemptions", self._stream.num_preemptions(i))
        if delta.num_cached_tokens is not None:
            metrics.count("vllm:prompt_tokens_cached", delta.num_cached_tokens)
            computed = self._num_prompt_tokens - delta.num_cached_tokens
            metrics.observe("vllm:request_prefill_kv_computed_tokens", computed)
        scheduled, first, last = self._stream.scheduled_at(i), self._first_token[i], self._last_token[i]
        queued = self._stream.queued_at
        if scheduled is not None and queued is not None and first is not None and last is not None:
            metrics.observe("vllm:request_queue_time_seconds", scheduled - queued)
            metrics.observe("vllm:request_prefill_time_seconds", first - scheduled)
            metrics.observe("vllm:request_decode_time_seconds", last - first)
            metrics.observe("vllm:request_inference_time_seconds", last - scheduled)
            per_token = (last - first) / (generated - 1) if generated > 1 else 0.0
            metrics.observe("vllm:request_time_per_output_token_seconds", per_token)
        self._unfinished -= 1
        if not self._unfinished:
            metrics.observe("vllm:request_params_n", len(self._generated))
            metrics.observe("vllm:request_max_num_generation_tokens", max(self._generated))
