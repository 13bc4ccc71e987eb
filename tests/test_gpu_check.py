"""scripts/gpu_check.py: the prepared GPU-lease check. Its step runner (timeouts, failures,
the budget) with stand-in steps, and the whole check end to end on CPU with its CPU preset."""

from __future__ import annotations

import json

import pytest
from script_runs import run_script
from test_bench_kernels import script_module


@pytest.fixture(scope="module")
def gpu_check():
    return script_module("gpu_check")


def python(code: str) -> tuple[str, ...]:
    return ("-c", code)


def test_a_step_that_times_out_or_fails_does_not_stop_the_next_and_the_budget_holds(gpu_check, monkeypatch, tmp_path):
    stand_ins = [
        gpu_check.Step("hangs", python("import time; print('started', flush=True); time.sleep(60)"), 1.0),
        gpu_check.Step("fails", python("raise SystemExit(3)"), 30.0),
        gpu_check.Step(
            "passes",
            python(f"import json; json.dump({{'x': 2}}, open({str(tmp_path / 'r.json')!r}, 'w'))"),
            30.0,
            "r.json",
            lambda path: {"x": json.loads(path.read_text())["x"] * 10},
        ),
        gpu_check.Step("long", python("pass"), 1000.0, optional=True),  # more than the budget leaves
    ]
    monkeypatch.setattr(gpu_check, "steps", lambda preset, out: stand_ins)
    report = gpu_check.check("cpu", tmp_path, budget_s=120.0, only=None)
    statuses = {s["name"]: (s["status"], s.get("rc")) for s in report["steps"]}
    assert statuses["hangs"][0] == "timeout" and statuses["fails"] == ("failed", 3)
    assert statuses["passes"] == ("passed", 0) and statuses["long"] == ("skipped", None)
    assert report["steps"][2]["figures"] == {"x": 20}
    assert report["steps"][0]["seconds"] < 30  # killed at its timeout, not waited for
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    log = (tmp_path / "gpu_check.log").read_text()
    assert "  started" in log and "== hangs: timeout" in log and "== summary" in log


@pytest.mark.subprocess
def test_an_unknown_step_is_one_line_and_status_2(tmp_path):
    done = run_script("gpu_check.py", f"--out={tmp_path}", "--preset=accelerator", "--steps=env,nope")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_check.py: error: --steps: unknown step nope; valid: env,kernels,serve,tests,transfers,serve-4096"
    ]


@pytest.mark.slow
@pytest.mark.subprocess
def test_the_whole_check_runs_on_cpu_and_reports_every_step(tmp_path):
    """Tiny sizes, kernels interpreted: a few minutes on 2 CPU cores."""
    done = run_script("gpu_check.py", f"--out={tmp_path}", "--preset=cpu", "--budget_s=1500", timeout=1800)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["env", "kernels", "serve", "tests", "transfers"]
    assert all(s["status"] == "passed" for s in steps.values()), (done.stdout[-3000:], report)
    assert done.returncode == 0
    assert steps["env"]["figures"]["auto"][0] == "reference"
    assert steps["kernels"]["figures"]["decode"]["pallas_gpu_max_abs_err"] < 2e-2  # interpreted, bf16
    assert steps["tests"]["figures"]["failures"] == 0 and steps["tests"]["figures"]["tests"] > 10
    assert steps["serve"]["figures"]["token_check_passed"] and steps["serve"]["figures"]["impl"] == "auto"
    assert set(steps["transfers"]["figures"]["128 KiB"]) >= {"cross_store_of_bulk", "cross_load_of_bulk"}
    log = (tmp_path / "gpu_check.log").read_text()
    assert "[1/1] paged_attention decode: " in log and "test_auto.py::" in log
