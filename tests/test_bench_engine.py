"""The engine benchmark's quick preset runs both sections and reports what it measured."""

import json

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # runs the script as a user would


def test_a_quick_run_without_vllm_reports_both_sections_with_vllm_columns_na(tmp_path):
    out = tmp_path / "bench.json"
    done = run_script("bench_engine.py", "--quick", "--nopeer", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "[engine]" in done.stdout and "[overlap]" in done.stdout and "n/a" in done.stdout
    report = json.loads(out.read_text())
    assert report["peer"] is None and report["quick"]
    rows = report["engine"]["rows"]
    assert [(r["setting"], r["running"]) for r in rows] == [("tiny", 8), ("stub1k", 8)]
    for row in rows:
        assert row["jaxkv_host_ms"] > 0 and row["jaxkv_wall_ms"] >= row["jaxkv_host_ms"] * 0.5
        assert row["vllm_total_ms"] is None and row["ratio"] is None and row["rest_ratio"] is None
        assert row["ratio_q1"] is None and row["less_call_ratio"] is None and row["num_windows"] == 0
        assert row["reps"] == 1 and row["tokens_same_every_rep"] is True  # a repetition draws the first run's tokens
        assert 0 < row["jaxkv_call_ms"] < row["jaxkv_runner_ms"]  # the jitted call, inside the runner
        assert 0 < row["jaxkv_runner_ms"] < row["jaxkv_host_ms"] and 0 < row["jaxkv_rest_ms"] < row["jaxkv_host_ms"]
    tiny, stub = rows
    assert tiny["tokens_as_preset"] is None and stub["tokens_as_preset"] is True  # the stub drew its preset
    overlap = report["overlap"]
    assert overlap["running"] == 8
    for key in ("host_ms", "host_cpu_ms", "device_ms", "wall_ms"):
        assert overlap[key] > 0
    bound = max(overlap["host_ms"], overlap["device_ms"])
    assert overlap["wall_over_max"] == pytest.approx(overlap["wall_ms"] / bound)
    assert overlap["serial_bound"] == pytest.approx((overlap["host_ms"] + overlap["device_ms"]) / bound)


def test_bad_flags_are_one_line_and_status_2():
    done = run_script("bench_engine.py", "--sections", "engine,speed")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "unknown sections ['speed']" in done.stderr
    done = run_script("bench_engine.py", "--batch_sizes", "8,x")
    assert done.returncode == 2 and "--batch_sizes must be positive ints, got 8,x" in done.stderr
