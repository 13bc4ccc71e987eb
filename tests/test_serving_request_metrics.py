"""Request-level series under vLLM's names and buckets, fed by the deltas a server streams."""

import time
from dataclasses import dataclass, field

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from jaxkv.serving.outputs import RequestDelta  # noqa: E402
from jaxkv.serving.request_metrics import (  # noqa: E402
    ITL_BUCKETS,
    REQUEST_BUCKETS,
    TTFT_BUCKETS,
    RequestMetrics,
    token_buckets,
)


@dataclass
class Times:
    """A request's sequences as the engine thread saw them (what a RequestStream says)."""

    n: int
    queued_at: float | None = None
    scheduled: dict[int, float] = field(default_factory=dict)
    preemptions: dict[int, int] = field(default_factory=dict)

    def scheduled_at(self, index: int) -> float | None:
        return self.scheduled.get(index)

    def num_preemptions(self, index: int) -> int:
        return self.preemptions.get(index, 0)


def delta(index: int, tokens: int, reason: str | None = None, cached: int | None = None) -> RequestDelta:
    return RequestDelta("r", index, tuple(range(tokens)), "", None, reason, cached)


def sample(metrics: RequestMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if value is None else value


def test_the_buckets_are_vllm_033s():
    assert TTFT_BUCKETS[-3:] == (160.0, 640.0, 2560.0) and len(TTFT_BUCKETS) == 22
    assert ITL_BUCKETS[0] == 0.01 and len(ITL_BUCKETS) == 19
    assert REQUEST_BUCKETS[-1] == 7680.0 and len(REQUEST_BUCKETS) == 21
    assert token_buckets(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def test_each_sequence_is_a_request_with_its_phases_and_n_is_counted_once_at_the_end():
    metrics = RequestMetrics(max_model_len=512, labels={"model_name": "m"})
    start = time.monotonic() - 1.0  # arrived a second ago, taken 10 ms later, its sequences scheduled 20, 40 ms after
    times = Times(n=2, queued_at=start + 0.01, scheduled={0: start + 0.03, 1: start + 0.05})
    timer = metrics.timer(times, start, num_prompt_tokens=12, max_tokens=5)
    timer.observe(delta(0, 1))
    timer.observe(delta(1, 1))
    timer.observe(delta(0, 3))
    timer.observe(delta(1, 0, "abort", cached=8))
    assert sample(metrics, "vllm:request_params_n_count") == 0, "n is observed when the last sequence ends"
    times.preemptions[0] = 2
    timer.observe(delta(0, 1, "length", cached=0))

    assert sample(metrics, "vllm:prompt_tokens_total") == 24, "each sequence that drew processed the prompt"
    assert sample(metrics, "vllm:prompt_tokens_cached_total") == 8
    assert sample(metrics, "vllm:generation_tokens_total") == 6
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 2, "one first token per sequence"
    assert sample(metrics, "vllm:inter_token_latency_seconds_count") == 2, "one gap per later output, as vLLM 0.33"
    assert sample(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert sample(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert sample(metrics, "vllm:e2e_request_latency_seconds_count") == 2
    assert sample(metrics, "vllm:request_generation_tokens_sum") == 6
    assert sample(metrics, "vllm:request_prompt_tokens_sum") == 24
    assert sample(metrics, "vllm:request_params_max_tokens_sum") == 10
    assert sample(metrics, "vllm:request_prefill_kv_computed_tokens_sum") == 4 + 12
    assert sample(metrics, "vllm:request_num_preemptions_sum") == 2
    assert sample(metrics, "vllm:request_params_n_sum") == 2 and sample(metrics, "vllm:request_params_n_count") == 1
    assert sample(metrics, "vllm:request_max_num_generation_tokens_sum") == 5
    assert sample(metrics, "vllm:request_max_num_generation_tokens_bucket", le="5.0") == 1
    # both sequences were scheduled and drew: each has its phases
    for phase in ("queue", "prefill", "decode", "inference"):
        assert sample(metrics, f"vllm:request_{phase}_time_seconds_count") == 2, phase
    assert sample(metrics, "vllm:request_queue_time_seconds_sum") == pytest.approx(0.02 + 0.04)
    assert sample(metrics, "vllm:request_queue_time_seconds_bucket", le="0.3") == 2
    assert sample(metrics, "vllm:time_to_first_token_seconds_bucket", le="0.75") == 0, "a second since arrival"
    decode = sample(metrics, "vllm:request_decode_time_seconds_sum")
    inference = sample(metrics, "vllm:request_inference_time_seconds_sum")
    prefill = sample(metrics, "vllm:request_prefill_time_seconds_sum")
    assert inference == pytest.approx(prefill + decode)
    assert sample(metrics, "vllm:request_time_per_output_token_seconds_count") == 2


def test_a_sequence_aborted_before_it_was_scheduled_counts_no_phase():
    metrics = RequestMetrics(max_model_len=64, labels={"model_name": "m"})
    timer = metrics.timer(Times(n=1, queued_at=time.monotonic()), time.monotonic(), 5, 8)
    timer.observe(delta(0, 0, "abort"))
    assert sample(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert sample(metrics, "vllm:request_queue_time_seconds_count") == 0
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 0
    assert sample(metrics, "vllm:prompt_tokens_total") == 0
    assert sample(metrics, "vllm:request_max_num_generation_tokens_count") == 1
