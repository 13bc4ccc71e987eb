"""bench_offload.py: a short policy run prints its table and draws the policies side by side."""

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # runs scripts as a user would

SMALL = ("--sections=policies", "--conversations=20", "--device_blocks=32", "--host_blocks=32", "--scan_blocks=16")


def test_a_short_policy_run_prints_the_table_and_plots_it(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "policies.png"
    done = run_script("bench_offload.py", *SMALL, f"--plot={png}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "(b) prefix hit rate: device 32 blocks" in done.stdout and f"wrote {png}" in done.stdout
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_plot_without_the_policy_section_is_refused_in_one_line(tmp_path):
    done = run_script("bench_offload.py", "--sections=transfers", f"--plot={tmp_path / 'x.png'}")
    assert done.returncode == 2
    assert done.stderr.splitlines() == ["bench_offload.py: error: --plot draws section (b): add policies to --sections"]
