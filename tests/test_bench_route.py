"""scripts/bench_route.py: a short run end to end (real replica processes, one killed
mid-trace, none left behind), and bad input refused in one line with status 2."""

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from script_runs import run_script

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

pytestmark = pytest.mark.subprocess  # replica processes and the script, as a user runs them


def run(*args: str) -> subprocess.CompletedProcess:
    return run_script("bench_route.py", *args)


def replica_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if "jaxkv.fleet.replica" in line and "bench_route-" in line]


def test_a_quick_run_reports_every_policy_and_survives_a_killed_replica(tmp_path):
    before = replica_processes()
    result = run("--quick", f"--out={tmp_path / 'route.json'}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "route.json").read_text())
    assert set(report["results"]) == {"round_robin", "least_loaded", "prefix", "one big cache"}
    assert all(r["errors"] == 0 and r["requests"] == 16 for r in report["results"].values())
    assert set(report["ratios"]) >= {"hit_rate_prefix_vs_big_cache", "hit_rate_prefix_vs_round_robin"}
    kill = report["kill_replica"]
    assert kill["all_completed"] and kill["completed"] == kill["requests"] == 16
    assert kill["victim_hashes_in_index"] == 0 and kill["sent_to_victim_after_drop"] == 0
    assert "| prefix |" in result.stdout and "hit_rate_prefix_vs_round_robin" in result.stdout
    assert replica_processes() == before


BAD_INPUT = {
    "too short for the chats": (["--max_model_len=100"], "--max_model_len=100 is too short"),
    "unreadable memory": (["--memory=lots"], "lots"),
    "one replica": (["--num_replicas=1"], "--num_replicas"),
    "negative penalty": (["--load_penalty=-1"], "--load_penalty must be a finite number >= 0"),
}


@pytest.fixture(scope="module")
def refused() -> dict[str, subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=len(BAD_INPUT)) as pool:
        futures = {case: pool.submit(run, *args) for case, (args, _) in BAD_INPUT.items()}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_status_2(refused, case):
    result = refused[case]
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_route.py: error: "), lines
    assert BAD_INPUT[case][1] in lines[0]
