"""scripts/bench_interop.py: a quick run end to end (jaxkv's column; sglang-jax's RadixCache
joins when ``SGLANG_JAX_SRC`` names a sglang-jax ``python/`` folder whose imports resolve)."""

import json
import os

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # the script, as a user runs it


def test_a_quick_run_reports_every_operation(tmp_path):
    src = os.environ.get("SGLANG_JAX_SRC")
    if src:
        pytest.importorskip("psutil", reason="sglang-jax's utilities import psutil")
    args = ["--quick", "--repeats=1", f"--out={tmp_path / 'interop.json'}"]
    result = run_script("bench_interop.py", *args, *([f"--sglang_jax_src={src}"] if src else []))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "interop.json").read_text())
    ops = {"match_prefix", "inc_lock_ref", "alloc_extend", "alloc_decode", "cache_finished_req"}
    assert set(report["mean_us"]["jaxkv"]) == ops
    assert report["hit_tokens"]["jaxkv"] == (20 - 8) * 256  # every request after the first per prompt
    if src:
        assert report["hit_tokens"]["sglang-jax"] == report["hit_tokens"]["jaxkv"]
    assert "| alloc_decode |" in result.stdout and "| per request |" in result.stdout
