"""The manager benchmark runs its workloads end to end (jaxkv's side; vLLM is optional)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess  # runs scripts as a user would

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_manager.py"


def test_a_tiny_run_reports_every_op_of_every_workload(tmp_path):
    out = tmp_path / "bench.json"
    args = ["--scale", "0.05", "--pairs", "1", "--nopeer", "--nocheck_decisions", "--out", str(out)]
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, capture_output=True, text=True)
    results = json.loads(out.read_text())["results"]
    assert {(r["model"], r["workload"]) for r in results} == {
        (m, w) for m in ("full", "gemma3-like") for w in ("base", "pressure", "running512")
    }
    for r in results:
        assert set(r["jaxkv"]) == {"lookup", "alloc_prefill", "alloc_decode", "free", "hash"}
        assert r["jaxkv_total"] > 0
