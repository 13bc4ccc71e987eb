"""The manager benchmark runs its workloads end to end (jaxkv's side; vLLM is optional)."""

import json

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # runs scripts as a user would


def test_a_tiny_run_reports_every_op_of_every_workload(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--scale", "0.05", "--pairs", "1", "--nopeer", "--nocheck_decisions", "--out", str(out)]
    done = run_script("bench_manager.py", *args)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())["results"]
    assert {(r["model"], r["workload"]) for r in results} == {
        (m, w)
        for m in ("full", "gemma3-like", "mixed-blocks", "recurrent", "recurrent-shared")
        for w in ("base", "pressure", "running512")
    }
    for r in results:
        assert set(r["jaxkv"]) == {"request", "lookup", "alloc_prefill", "alloc_decode", "free", "append"}
        assert r["jaxkv_total"] > 0
