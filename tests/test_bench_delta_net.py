"""The Gated DeltaNet benchmark times both serving forms on the same tokens, and they agree."""

import json

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # runs scripts as a user would


def test_a_small_run_times_both_forms_and_they_agree(tmp_path):
    out = tmp_path / "delta.json"
    done = run_script(
        "bench_delta_net.py", "--tokens=64", "--seqs=1,2", "--repeats=1", "--chunk_size=16", f"--out={out}"
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["meta"]["default_form"] in ("scan", "chunked")
    assert [(c["seqs"], c["scan_steps"], c["chunked_steps"]) for c in report["cases"]] == [(1, 64, 4), (2, 64, 4)]
    assert all(c["max_abs_diff"] < 1e-4 and c["scan_s"] > 0 and c["chunked_s"] > 0 for c in report["cases"])
