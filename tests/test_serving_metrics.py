"""The Prometheus exporter: vLLM's names, counters advanced by the engine's step
observer, restarts absorbed; the host tier counted as the external prefix cache."""

import sys
import urllib.request

import numpy as np
import prometheus_client
import pytest

from jaxkv.device.metadata import Buckets
from jaxkv.errors import JaxkvError
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.serving.engine import Engine
from jaxkv.serving.metrics import MetricsUnavailableError, PrometheusMetrics
from jaxkv.serving.offload_connector import OffloadConfig
from jaxkv.serving.stats import EngineStats

LABELS = {"model_name": "tiny"}


def stats(**changes) -> EngineStats:
    base = dict(
        kv_cache_usage=0.25,
        num_running=3,
        num_waiting=1,
        num_preemptions=2,
        prefix_cache_queries=100,
        prefix_cache_hits=40,
    )
    return EngineStats(**{**base, **changes})


def sample(metrics: PrometheusMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, {**LABELS, **labels})
    assert value is not None, name
    return value


def test_gauges_and_counters_carry_vllms_names():
    metrics = PrometheusMetrics(labels=LABELS)
    metrics(stats())
    assert sample(metrics, "vllm:kv_cache_usage_perc") == 0.25
    assert sample(metrics, "vllm:num_requests_running") == 3
    assert sample(metrics, "vllm:num_requests_waiting") == 1
    assert sample(metrics, "vllm:num_requests_waiting_by_reason", reason="capacity") == 1
    assert sample(metrics, "vllm:num_preemptions_total") == 2
    assert sample(metrics, "vllm:prefix_cache_queries_total") == 100
    assert sample(metrics, "vllm:prefix_cache_hits_total") == 40
    assert sample(metrics, "vllm:external_prefix_cache_hits_total") == 0
    assert sample(metrics, "jaxkv:kv_offload_bytes_total", direction="device_to_host") == 0
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert 'vllm:kv_cache_usage_perc{model_name="tiny"} 0.25' in text


def test_counters_advance_by_the_change_and_absorb_a_restart():
    metrics = PrometheusMetrics(labels=LABELS)
    metrics(stats(prefix_cache_hits=40, offload_stored_bytes=1000))
    metrics(stats(prefix_cache_hits=70, offload_stored_bytes=3000, num_running=0))
    assert sample(metrics, "vllm:prefix_cache_hits_total") == 70
    assert sample(metrics, "jaxkv:kv_offload_bytes_total", direction="device_to_host") == 3000
    assert sample(metrics, "vllm:num_requests_running") == 0
    metrics(stats(num_preemptions=1))  # the total went down: its owner restarted from 0
    assert sample(metrics, "vllm:num_preemptions_total") == 2 + 1


def test_two_exporters_in_one_process_do_not_clash():
    first, second = PrometheusMetrics(labels=LABELS), PrometheusMetrics(labels=LABELS)
    first(stats())
    assert second.registry is not first.registry


def test_the_exporter_serves_on_loopback_unless_told_otherwise():
    """The documented recipe (prometheus-client's start_http_server) listened on every interface."""
    metrics = PrometheusMetrics(labels=LABELS)
    metrics(stats())
    server = metrics.serve(0)
    try:
        host, port = server.server_address[:2]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            text = page.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert host == "127.0.0.1" and "vllm:kv_cache_usage_perc" in text


def test_without_prometheus_client_the_exporter_is_a_typed_refusal(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(MetricsUnavailableError, match=r"jaxkv\[metrics\]") as info:
        PrometheusMetrics()
    assert isinstance(info.value, JaxkvError)


def test_an_engine_feeds_the_exporter_once_per_step():
    model = TinyLM(get_model_config("tiny-llama"), seed=0)
    plan = plan_kv_cache(
        model.config.layer_specs(), 4 << 20, max_model_len=256, options=PlanOptions(max_num_batched_tokens=64)
    )
    engine = Engine(model, plan, max_num_seqs=4, buckets=Buckets((64,), (4,), (16,)), offload=OffloadConfig(2 << 20))
    seen: list[EngineStats] = []
    metrics = PrometheusMetrics(labels=LABELS)
    engine.add_step_observer(metrics)
    engine.add_step_observer(seen.append)
    shared = np.random.default_rng(0).integers(0, 512, 48).tolist()
    engine.generate([[*shared, 1, 2], [*shared, 3, 4]], 4)
    engine.generate([[*shared, 5, 6]], 2)
    assert seen and seen[-1] == engine.stats()
    last = seen[-1]
    assert sample(metrics, "vllm:prefix_cache_queries_total") == last.prefix_cache_queries > 0
    assert sample(metrics, "vllm:prefix_cache_hits_total") == last.prefix_cache_hits >= 48
    assert sample(metrics, "vllm:kv_cache_usage_perc") == last.kv_cache_usage
    assert last.num_running == last.num_waiting == 0
    assert sample(metrics, "vllm:external_prefix_cache_queries_total") == last.host_cache_queries > 0


def test_missed_tokens_are_counted_by_cause():
    metrics = PrometheusMetrics(labels=LABELS)
    metrics(
        stats(
            prefix_cache_misses_no_checkpoint=32,
            prefix_cache_misses_below_block=8,
            prefix_cache_misses_not_cached=20,
            prefix_cache_misses_evicted=12,
            prefix_cache_misses_salt=16,
            host_cache_queries=20,
            host_cache_hits=16,
        )
    )
    name = "vllm:prefix_cache_misses_total"
    assert sample(metrics, name, cause="no_checkpoint") == 32
    assert sample(metrics, name, cause="below_block") == 8
    assert sample(metrics, name, cause="not_cached") == 20
    assert sample(metrics, name, cause="evicted") == 12
    assert sample(metrics, name, cause="salt") == 16
    assert sample(metrics, name, cause="host_miss") == 4
