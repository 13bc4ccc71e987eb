"""The hybrid benchmark runs every section end to end and its plan targets hold."""

import importlib.util
import json

import pytest
from script_runs import run_script

from jaxkv.benchmarks.vllm_manager import vllm_available

pytestmark = pytest.mark.subprocess  # runs scripts as a user would


def test_a_quick_run_reports_every_section_and_meets_the_plan_targets(tmp_path):
    out = tmp_path / "bench.json"
    plot = [] if importlib.util.find_spec("matplotlib") is None else [f"--plot={tmp_path / 'all.png'}"]
    done = run_script("bench_hybrid.py", "--quick", "--out", str(out), *plot)  # every section drawn, too
    assert done.returncode == 0, done.stderr
    for section in ("[granularity]", "[concurrency]", "[capacity]", "[chat]", "[multiturn]", "[ttft]", "[retention]"):
        assert section in done.stdout
    report = json.loads(out.read_text())
    granularity = {r["preset"]: r for r in report["granularity"]["rows"]}
    assert set(granularity) == {"nemotron-h-8b", "qwen3-next-80b", "jamba-1.5-mini"}
    assert all(r["default"] <= 64 for r in granularity.values())
    assert [granularity[p]["attention_pages"] for p in ("nemotron-h-8b", "qwen3-next-80b", "jamba-1.5-mini")] == [
        1040,
        1056,
        144,
    ]
    for row in report["concurrency"]["rows"]:
        assert row["default_ratio"] >= 0.98 and row["default"] >= row["attention_pages"]
    peer = vllm_available()  # vLLM's own manager beside jaxkv's where the benchmark extra is installed
    for row in report["capacity"]["rows"]:
        assert row["default"] >= row["attention_pages"] >= 1
        assert row["default"] >= row["vllm"] >= 1 if peer else row["vllm"] is None
        assert row["served"] >= 1 and row["served_preemptions"] >= 0  # through the scheduler
        assert row["vllm_served"] >= 1 if peer else row["vllm_served"] is None
    for row in report["chat"]["rows"]:
        assert row["default_hit_rate"] >= row["attention_pages_hit_rate"]
        assert row["default_hit_rate"] >= row["vllm_hit_rate"] if peer else row["vllm_hit_rate"] is None
    multiturn = report["multiturn"]["rows"]
    assert {r["preset"] for r in multiturn} == {"tiny-mamba-hybrid", "nemotron-h-8b", "jamba-1.5-mini"}
    for row in multiturn:
        rates = (row["attention_only_hit_rate"], row["attention_pages_hit_rate"], row["default_hit_rate"])
        assert all(0 <= r <= 1 for r in rates)
    (ttft,) = report["ttft"]["rows"]
    assert ttft["model"] == "tiny-qwen3-next" and ttft["tokens_identical"]
    assert ttft["uncached_ttft_ms"] > 0 and ttft["cached_ttft_ms"] > 0
    retention = report["retention"]["rows"]
    assert [r["memory"] for r in retention] == ["16GiB", "20GiB"]
    for row in retention:
        assert 0 <= row["vllm_hit_rate"] <= 1 and 0 <= row["group_aware_hit_rate"] <= 1
        assert row["gain_points"] == 100 * (row["group_aware_hit_rate"] - row["vllm_hit_rate"])


def test_an_unknown_section_is_one_line_and_status_2():
    done = run_script("bench_hybrid.py", "--sections", "granularity,speed")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert (
        "unknown sections ['speed']" in done.stderr
        and "granularity, concurrency, capacity, chat, multiturn, ttft, retention" in done.stderr
    )


def test_the_plan_sections_are_drawn_as_grouped_bars(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "hybrid.png"
    done = run_script("bench_hybrid.py", "--sections=granularity,concurrency", f"--plot={png}")
    assert done.returncode == 0, done.stderr
    assert "(granularity ...)" in done.stdout and f"wrote {png}" in done.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"
