"""The serving demo (scripts/serve.py) and benchmark (scripts/bench_serve.py) run end to end."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / name), *args],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )


def test_serve_prints_tokens_throughput_hits_and_usage_and_matches_dense(tmp_path):
    out = tmp_path / "serve.json"
    result = run_script(
        "serve.py", "--model=tiny-llama", "--layout=per_layer", "--num_requests=5", "--prefix_len=40",
        "--suffix_len=4,12", "--max_new_tokens=5", "--memory=2MiB", "--max_model_len=128",
        "--max_num_seqs=4", "--max_num_batched_tokens=64", "--progress_every=2", "--head_dim_multiple=128",
        f"--out={out}",
    )
    assert result.returncode == 0, result.stderr
    for text in ("KV cache plan", "head_size rounded up to a multiple of 128", "warm-up: ", "step     2",
                 "req-", "throughput", "prefix hit rate",
                 "KV usage", "tokens identical to the dense (unpaged) forward: yes"):
        assert text in result.stdout
    report = json.loads(out.read_text())["result"]
    assert len(report["outputs"]) == 5 and all(len(o["output_token_ids"]) == 5 for o in report["outputs"])
    assert report["prefix_hit_rate"] > 0.3 and report["num_compilations"] == 0


def test_serve_reports_bad_flags_in_one_line():
    result = run_script("serve.py", "--memory=1KiB", "--noverify")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: memory_bytes=1024 holds 0 blocks")


def test_bench_serve_reports_ratios_in_one_run(tmp_path):
    out = tmp_path / "bench.json"
    result = run_script(
        "bench_serve.py", "--model=tiny-llama", "--prompt_len=80", "--num_requests=3", "--repeats=1",
        "--max_new_tokens=2", "--max_model_len=128", "--max_num_batched_tokens=128", "--memory=4MiB",
        f"--out={out}",
    )
    assert result.returncode == 0, result.stderr
    assert "| TTFT, one shared-prefix request (ms) |" in result.stdout
    report = json.loads(out.read_text())
    assert report["identical_tokens"]
    assert report["results"]["prefix caching"]["batch_prefix_hit_rate"] > 0.5
    assert report["ratios"]["batch_tokens_computed"] > 1.5
    assert all(r["timed_compilations"] == 0 for r in report["results"].values())
