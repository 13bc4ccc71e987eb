"""The mesh benchmark serves the same prompts on meshes of several sizes, with identical
tokens and nothing compiled while timed, and splits jaxkv's host time from JAX's dispatch."""

import json

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # runs scripts as a user would


def test_a_short_run_on_one_and_two_devices_reports_both_host_times(tmp_path):
    out = tmp_path / "mesh.json"
    done = run_script(
        "bench_mesh.py", "--devices=1,2", "--num_requests=2", "--max_new_tokens=2", "--repeats=1", f"--out={out}"
    )
    assert done.returncode == 0, done.stderr
    assert "tokens identical on every mesh: yes" in done.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"1", "2"}
    for row in results.values():
        assert row["num_compilations"] == 0
        assert row["host_ms_per_step"] > 0 and row["dispatch_ms_per_step"] > 0
    assert results["1"]["host_ratio"] == results["1"]["dispatch_ratio"] == 1.0


def test_devices_that_are_not_positive_ints_exit_2_with_one_line():
    done = run_script("bench_mesh.py", "--devices=1,x")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--devices" in done.stderr
