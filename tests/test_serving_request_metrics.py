"""Request-level series under vLLM's names, fed by the deltas a server streams."""

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from jaxkv.serving.engine import RequestDelta  # noqa: E402
from jaxkv.serving.request_metrics import RequestMetrics  # noqa: E402


def delta(index: int, tokens: int, reason: str | None = None) -> RequestDelta:
    return RequestDelta("r", index, tuple(range(tokens)), "", None, reason)


def sample(metrics: RequestMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if value is None else value


def test_a_two_sequence_request_counts_one_first_token_every_gap_and_each_end():
    metrics = RequestMetrics(labels={"model_name": "m"})
    timer = metrics.timer(num_prompt_tokens=12, n=2)
    for d in [delta(0, 1), delta(1, 1), delta(0, 3), delta(1, 0, "abort"), delta(0, 1, "length")]:
        timer.observe(d)
    assert sample(metrics, "vllm:prompt_tokens_total") == 12
    assert sample(metrics, "vllm:generation_tokens_total") == 6
    assert sample(metrics, "vllm:time_to_first_token_seconds_count") == 1
    assert sample(metrics, "vllm:inter_token_latency_seconds_count") == 4, "3 + 1 tokens after sequence 0's first"
    assert sample(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert sample(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert sample(metrics, "vllm:e2e_request_latency_seconds_count") == 2
    assert sample(metrics, "vllm:request_generation_tokens_sum") == 6
    assert sample(metrics, "vllm:request_prompt_tokens_sum") == 24
