"""One engine across processes: 2 processes x 4 CPU devices (one jax.distributed cluster,
gloo collectives, one global mesh) give the tokens of one process on one device, compile
nothing after warm-up, and a process that decides differently stops both with a typed
lockstep error instead of a hang. The engine has a host tier: each process stores and
loads only its own devices' shards of a block.

Every cluster runs as subprocesses in a session of their own, killed whole after a
timeout, so a hang fails the test instead of blocking the suite. The worker
(tests/cluster_worker.py) runs once for the first three tests, beside a one-process
run; the file takes about 70 s on 2 CPU cores.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
from script_runs import REPO, repo_env

from jaxkv.cluster.launcher import with_cpu_device_count

TIMEOUT_S = 240

pytestmark = pytest.mark.subprocess  # clusters of processes


def start(*args: str) -> subprocess.Popen:
    """A Python subprocess of this repository, in a session of its own (killed whole on timeout),
    with one CPU device unless it asks for more (not the 8 of this suite's conftest)."""
    env = {
        **repo_env(),
        "XLA_FLAGS": with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), 1),
    }
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    """``(status, stdout, stderr)``; fails the test (killing the session) after the timeout."""
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {TIMEOUT_S} s (a hang)")
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Records of the 2-process worker (its second batch diverging on process 1) and of one process."""
    two, one = tmp_path_factory.mktemp("two"), tmp_path_factory.mktemp("one")
    procs = [
        start("tests/cluster_worker.py", f"--out_dir={two}", "--num_processes=2", "--diverge"),
        start("tests/cluster_worker.py", f"--out_dir={one}"),
    ]
    for proc in procs:
        status, _, err = finish(proc)
        assert status == 0, err[-3000:]
    records = {f"process {p}": json.loads((two / f"process-{p}.json").read_text()) for p in range(2)}
    records["alone"] = json.loads((one / "process-0.json").read_text())
    return records


def test_two_processes_of_four_devices_give_the_tokens_of_one_device(runs):
    assert runs["process 0"]["device_count"] == runs["process 1"]["device_count"] == 8
    assert runs["alone"]["device_count"] == 1
    assert runs["process 0"]["tokens"] == runs["process 1"]["tokens"] == runs["alone"]["tokens"]


def test_the_host_tier_stores_and_loads_the_same_blocks_in_every_process(runs):
    moved = [(runs[p]["stored_blocks"], runs[p]["loaded_blocks"]) for p in ("process 0", "process 1", "alone")]
    assert moved[0] == moved[1] == moved[2] and moved[0][1] > 0


def test_nothing_compiles_after_warm_up_in_the_cluster_or_alone(runs):
    assert runs["process 0"]["compilations"] == runs["process 1"]["compilations"] == runs["alone"]["compilations"] == 0


def test_a_process_deciding_differently_raises_the_mismatch_in_every_process(runs):
    errors = [runs[p]["error"] for p in ("process 0", "process 1")]
    assert {e["type"] for e in errors} == {"LockstepMismatchError"}
    assert errors[0]["step"] == errors[1]["step"]
    assert all(f"step {e['step']}: processes [1] decided differently" in e["message"] for e in errors)
    assert "error" not in runs["alone"]


def test_serve_py_runs_as_two_processes_and_matches_the_dense_forward(tmp_path):
    out = tmp_path / "serve.json"
    status, stdout, err = finish(
        start(
            "scripts/serve.py",
            "--model=tiny-llama-kv8",
            "--num_processes=2",
            "--num_devices=4",
            "--num_requests=4",
            "--prefix_len=32",
            "--suffix_len=4,12",
            "--max_new_tokens=4",
            "--memory=2MiB",
            "--max_model_len=128",
            "--max_num_seqs=4",
            "--max_num_batched_tokens=64",
            f"--out={out}",
        )
    )
    assert status == 0, err[-3000:]
    assert "tokens identical to the dense (unpaged) forward: yes" in stdout
    report = json.loads(out.read_text())
    assert report["result"]["num_compilations"] == 0 and report["matches_dense"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--num_processes=0"], "--num_processes=0"),
        (["--model=tiny-llama", "--num_processes=2", "--num_devices=4"], "has 2 KV heads"),
    ],
)
def test_serve_py_refuses_a_cluster_it_cannot_run_in_one_line(args, needle):
    status, _, err = finish(start("scripts/serve.py", *args))
    assert status == 2
    assert err.count("\n") == 1 and needle in err


def test_the_coordinator_binds_the_address_it_is_reached_at_not_every_interface(monkeypatch):
    import jax

    from jaxkv.cluster import distributed
    from jaxkv.cluster.launcher import LaunchError, ProcessRole

    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: seen.update(kwargs))
    distributed.join(ProcessRole("127.0.0.1:4321", 2, 0))
    assert seen["coordinator_bind_address"] == "127.0.0.1:4321"
    assert distributed.coordinator_bind_address("10.0.0.5:99", "0.0.0.0") == "0.0.0.0:99", "only when asked"
    with pytest.raises(LaunchError, match="host:port"):
        distributed.coordinator_bind_address("4321")
