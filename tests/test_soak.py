"""A reduced soak (scripts/soak.py): the tiny models (a recurrent one with its states in the
KV pages), both store policies, LRU and ARC, a small device pool and host tier, random
store and load failures; no leaks, and every request's tokens equal those of an engine
without offload."""

import json

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # runs scripts as a user would

REDUCED = (
    "--num_requests=48",
    "--batch_size=4",
    "--num_conversations=5",
    "--num_system_prompts=2",
    "--system_len=40,72",
    "--user_len=8,24",
    "--max_prompt_len=120",
    "--max_model_len=128",
    "--max_new_tokens=4",
    "--max_num_seqs=4",
    "--max_num_batched_tokens=64",
    "--device_requests=1.1",  # 1.5 held every reuse on device once superseded checkpoints wait for a full pool
    "--host_requests=1.5",
    "--fail_rate=0.2",
)


def test_reduced_soak_leaks_nothing_and_keeps_the_tokens(tmp_path):
    out = tmp_path / "soak.json"
    result = run_script("soak.py", *REDUCED, f"--out={out}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for text in (
        "requests",
        "preemptions",
        "faults injected",
        "device blocks leaked",
        "host blocks leaked",
        "tokens equal",
        "RSS",
        "soak passed",
    ):
        assert text in result.stdout
    report = json.loads(out.read_text())
    totals = report["totals"]
    assert report["ok"] and totals["errors"] == 0
    assert totals["requests"] == 48 and totals["tokens_equal"] == 48
    assert totals["device_blocks_leaked"] == 0 and totals["host_blocks_leaked"] == 0
    configs = report["configs"]
    assert {(c["model"], c["store"]) for c in configs} == {
        (m, s) for m in ("tiny-llama", "tiny-hybrid", "tiny-qwen3-next") for s in ("on_eviction", "write_through")
    }
    assert {c["policy"] for c in configs} == {"lru", "arc"}
    # The reduced run still exercises what the soak is for: preemption, host hits and both kinds of fault.
    assert totals["preemptions"] > 0 and totals["faults_store"] > 0 and totals["faults_load"] > 0
    assert sum(c["loaded_tokens"] or 0 for c in configs) > 0
