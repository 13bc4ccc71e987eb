"""The serving demo (scripts/serve.py) and benchmark (scripts/bench_serve.py): end to end, and bad input.

Bad input is one line ``<script>: error: ...`` on stderr with exit status 2 and no
traceback. Those runs stop before any model is built, so they run side by side (each
pays only for importing JAX, ~4 s of CPU); the other refusals (flag parsing, sizes) are
the shared helpers of jaxkv.commands.plan, tested in-process in test_plan_cli.py. The whole file
takes about 40 s on 2 CPU cores (the two end-to-end runs, ~10 s and ~15 s, most of it).
"""

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # runs scripts as a user would


def test_serve_prints_tokens_throughput_hits_and_usage_and_matches_dense(tmp_path):
    out = tmp_path / "serve.json"
    result = run_script(
        "serve.py",
        "--model=tiny-llama",
        "--layout=per_layer",
        "--num_requests=5",
        "--prefix_len=40",
        "--suffix_len=4,12",
        "--max_new_tokens=5",
        "--memory=2MiB",
        "--max_model_len=128",
        "--max_num_seqs=4",
        "--max_num_batched_tokens=64",
        "--progress_every=2",
        "--head_dim_multiple=128",
        "--verify_uncached",
        f"--out={out}",
    )
    assert result.returncode == 0, result.stderr
    for text in (
        "KV cache plan",
        "head_size rounded up to a multiple of 128",
        "warm-up: ",
        "step     2",
        "req-",
        "throughput",
        "prefix hit rate",
        "KV usage",
        "tokens identical to the dense (unpaged) forward: yes",
        "against a run without prefix caching: PASS: float32 must give identical tokens: tokens identical (25)",
    ):
        assert text in result.stdout
    assert json.loads(out.read_text())["uncached_check"]["passed"]
    implementation = json.loads(out.read_text())["implementation"]  # --impl auto: the backend's pick, by name
    assert implementation != "auto" and f"jaxkv.device.ops implementation {implementation!r} on" in result.stdout
    report = json.loads(out.read_text())["result"]
    assert len(report["outputs"]) == 5 and all(len(o["output_token_ids"]) == 5 for o in report["outputs"])
    assert report["prefix_hit_rate"] > 0.3 and report["num_compilations"] == 0


def test_bench_serve_reports_ratios_in_one_run(tmp_path):
    out = tmp_path / "bench.json"
    result = run_script(
        "bench_serve.py",
        "--model=tiny-llama",
        "--prompt_len=80",
        "--num_requests=3",
        "--repeats=1",
        "--max_new_tokens=2",
        "--max_model_len=128",
        "--max_num_batched_tokens=128",
        "--memory=4MiB",
        f"--profile_dir={tmp_path / 'trace'}",
        f"--out={out}",
    )
    assert result.returncode == 0, result.stderr
    assert "| TTFT, one shared-prefix request (ms) |" in result.stdout
    phases = [line.split(":")[0].strip() for line in result.stdout.splitlines() if ":" in line]
    assert phases[:3] == ["load", "load", "tiny-llama (float32), cross_layer, auto (reference) ops on cpu"]
    calls = [line.split()[:2] for line in result.stdout.splitlines() if " req: TTFT " in line]
    assert calls[:2] == [["warm-up", "no"], ["warm-up", "prefix"]] and calls[-1] == ["check", "prefix"]
    assert "auto paged attention, q (" in result.stderr  # auto's choice per shape, with its reason
    assert list((tmp_path / "trace").rglob("*.xplane.pb")), "no profiler trace of the timed batch"
    report = json.loads(out.read_text())
    assert "with vs without prefix caching: PASS: float32 must give identical tokens" in result.stdout
    assert report["token_check"]["passed"] and report["token_check"]["identical_tokens"]
    assert report["results"]["prefix caching"]["batch_prefix_hit_rate"] > 0.5
    assert report["ratios"]["batch_tokens_computed"] > 1.5
    assert all(r["timed_compilations"] == 0 for r in report["results"].values())


# case: (script, flags, what the one line on stderr must hold)
BAD_INPUT = {
    # 1 PiB exceeds any device (bytes_limit, or physical RAM on CPU): refused before planning.
    "serve: budget over device memory": (
        "serve.py",
        ["--memory=1PiB"],
        "--memory=1PiB budget of 1,125,899,906,842,624 bytes (1.0 PiB) exceeds the device memory: ",
    ),
    "serve: zero memory": ("serve.py", ["--memory=0"], "memory size must be positive, got '0'"),
    "serve: memory too small": ("serve.py", ["--memory=1KiB"], "memory_bytes=1024 holds 0 blocks"),
    "serve: negative seed": ("serve.py", ["--seed=-1"], "flag --seed=-1"),
    "serve: reversed suffix range": ("serve.py", ["--suffix_len=48,8"], "--suffix_len must be lo,hi with 1 <= lo"),
    "serve: prompts longer than max_model_len": (
        "serve.py",
        ["--max_model_len=40"],
        "--prefix_len=96 + --suffix_len hi=48 = 144 prompt tokens leave no room for output in --max_model_len=40",
    ),
    "serve: a text prompt without a tokenizer": (
        "serve.py",
        ["--prompt=hello"],
        "--prompt needs --checkpoint DIR with a tokenizer.json",
    ),
    "bench: budget over device memory": ("bench_serve.py", ["--memory=1PiB"], "exceeds the device memory: "),
    "bench: prompts longer than max_model_len": (
        "bench_serve.py",
        ["--max_model_len=100"],
        "--prompt_len=1024 + --max_new_tokens=16 exceeds --max_model_len=100",
    ),
    "bench: NaN shared fraction": ("bench_serve.py", ["--shared=nan"], "--shared must be a fraction in [0, 1]"),
    "bench: zero logit tolerance": (
        "bench_serve.py",
        ["--logit_tolerance=0"],
        "--logit_tolerance must be a finite number > 0",
    ),
    "serve: unknown dtype": ("serve.py", ["--dtype=float16"], "flag --dtype=float16: value should be one of"),
    "serve: more devices than KV heads": (
        "serve.py",
        ["--num_devices=100000"],
        "KV heads, not a multiple of the 100000 devices",
    ),
    "simulate: a trace that reads without end": (
        "simulate.py",
        ["--trace=/dev/zero"],
        "--trace=/dev/zero is not a regular file",
    ),
}


@pytest.fixture(scope="module")
def refused() -> dict[str, subprocess.CompletedProcess]:
    """Every BAD_INPUT case, run side by side."""
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        futures = {case: pool.submit(run_script, script, *args) for case, (script, args, _) in BAD_INPUT.items()}
        return {case: future.result() for case, future in futures.items()}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_on_stderr_and_status_2(refused, case):
    script, _, expected = BAD_INPUT[case]
    result = refused[case]
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{script}: error: "), lines
    assert expected in lines[0]
