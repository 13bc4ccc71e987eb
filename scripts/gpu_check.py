"""The checks a lent GPU (H100/H200, ~15 minutes) must answer, in one call of at most 8 minutes.

Each step is a subprocess under its own timeout, its output streamed (flushed) to stdout
and to ``<out>/gpu_check.log`` as it comes; ``<out>/gpu_check.json`` is rewritten after
every step with each step's status (passed, failed, timeout, skipped), seconds, and key
figures read from its own JSON. A step that fails or times out does not stop the next;
no step starts with less time than it needs, and the whole run stays inside
``--budget_s``. The most important figures come first:

1. ``env``: the device, jax, and what ``auto`` picks (llama-1b's attention included);
2. ``kernels``: ``bench_kernels.py --cases`` decode 32 x 4096, 8 x 32768 and prefill
   2 x 512 after 1,024 cached, beside cuDNN's paged attention and the copy bandwidth
   measured in the same run;
3. ``serve``: ``bench_serve.py --quick`` with its defaults (``auto``): llama-1b TTFT with
   and without prefix caching, tokens checked;
4. ``tests``: the GPU-backend tests (``auto``'s rule, the Mosaic kernel, the ops, the cache);
5. ``transfers``: ``bench_offload.py`` host transfers at 128 KiB blocks against one bulk copy;
6. ``serve-4096`` (accelerator only, if time remains): the 4,096-token prompts of issue 32.

On CPU (``--preset=cpu``, the default there) every step runs with tiny sizes, the
kernels in their interpreters: the test suite runs it so that the lease run is known to
work end to end.

    PYTHONPATH=. python scripts/gpu_check.py --out "$OUT"
    PYTHONPATH=. python scripts/gpu_check.py --out /tmp/check --steps=env,kernels

The parent process never imports JAX (it would take the GPU's memory from the steps).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from xml.etree import ElementTree

from absl import app, flags

from jaxkv.commands.cli import exit_error, flags_parser

REPO = Path(__file__).resolve().parents[1]

PROG = "gpu_check.py"
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags, defined only when it runs (the tests import its step runner)."""
    flags.DEFINE_string("out", None, "directory for gpu_check.json, gpu_check.log and each step's JSON (created)")
    flags.DEFINE_enum("preset", "auto", ["auto", "cpu", "accelerator"], "step sizes (auto: cpu on a CPU-only machine)")
    flags.DEFINE_float("budget_s", 480.0, "wall-clock seconds for all steps together", lower_bound=1.0)
    flags.DEFINE_list("steps", None, "run only these steps, in the usual order (default: all)")
    flags.mark_flag_as_required("out")


ENV_PROBE = """
import json, subprocess, sys
import jax, jax.numpy as jnp
from jaxkv import ops
from jaxkv.device import auto
device = jax.devices()[0]
q = jax.ShapeDtypeStruct((64, 32, 64), jnp.bfloat16)  # llama-1b: 32 query heads over 8 KV heads, head dim 64
kv = jax.ShapeDtypeStruct((1024, 16, 16, 64), jnp.bfloat16)
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError):
    smi = None
env = {
    "jax": jax.__version__, "backend": jax.default_backend(), "device_kind": device.device_kind,
    "compute_capability": getattr(device, "compute_capability", None), "num_devices": jax.device_count(),
    "nvidia_smi": smi, "auto": list(auto.device_choice()),
    "auto_llama_1b_attention": list(auto.attention_choice(q, kv)),
}
print(json.dumps(env, indent=1))
with open(sys.argv[1], "w") as f:
    json.dump(env, f, indent=1)
"""


@dataclass(frozen=True)
class Step:
    """One check: ``argv`` after the Python interpreter, its timeout, the JSON it writes
    (a name under ``--out``) and what to read out of that JSON."""

    name: str
    argv: tuple[str, ...]
    timeout_s: float
    result: str | None = None
    summarize: Callable[[Path], dict] | None = None  # the result file -> key figures
    optional: bool = False  # run only if its whole timeout fits what is left of the budget

    @property
    def command(self) -> str:
        """The command as a log shows it (the env probe's code by name)."""
        return "python " + ("-c ENV_PROBE" if self.argv[0] == "-c" else " ".join(self.argv))


def kernel_figures(path: Path) -> dict:
    """Per case: ms of the Mosaic kernel, xla_gpu and cuDNN, the kernel's speed over cuDNN's
    (cuDNN ms / kernel ms; target >= 0.95) and its share of the copy bandwidth."""
    report = json.loads(path.read_text())
    figures: dict[str, Any] = {"copy_bandwidth_gb_s": report["machine"]["copy_bandwidth_gb_s"]}
    for row in report["results"]:
        ms = {col: row.get(f"{col}_s") for col in ("pallas_gpu", "xla_gpu", "cudnn_paged_attention", "dense_bound")}
        kernel, cudnn = ms["pallas_gpu"], ms["cudnn_paged_attention"]
        figures[row["case"]] = {
            **{f"{col}_ms": None if s is None else round(s * 1e3, 4) for col, s in ms.items()},
            "pallas_gpu_vs_cudnn": None if not (kernel and cudnn) else round(cudnn / kernel, 3),
            "pallas_gpu_vs_dense_bound": row["speedups"].get("pallas_gpu_vs_dense_bound"),
            "pallas_gpu_of_copy_bandwidth": row.get("pallas_gpu_hbm_fraction"),
            "pallas_gpu_max_abs_err": row.get("pallas_gpu_max_abs_err"),
        }
    return figures


def serve_figures(path: Path) -> dict:
    """TTFTs and tokens/s with and without prefix caching, and the token check."""
    report = json.loads(path.read_text())
    off, on = report["results"]["no prefix caching"], report["results"]["prefix caching"]
    return {
        "impl": report["flags"]["impl"],
        "model": report["flags"]["model"],
        "prompt_len": report["flags"]["prompt_len"],
        "cold_ttft_ms": round(off["single_ttft_s"] * 1e3, 2),
        "cached_ttft_ms": round(on["single_ttft_s"] * 1e3, 2),
        "batch_output_tokens_per_s": [
            round(off["batch_output_tokens_per_s"], 1),
            round(on["batch_output_tokens_per_s"], 1),
        ],
        "token_check_passed": report["token_check"]["passed"],
    }


def transfer_figures(path: Path) -> dict:
    """Cross-layer block stores and loads over one bulk copy of the same bytes (target >= 0.8)."""
    report = json.loads(path.read_text())
    return {
        f"{row['block_bytes'] // 1024} KiB": {k: round(v, 3) for k, v in row.items() if k != "block_bytes"}
        for row in report["cross_layer_ratios"]
    }


def env_figures(path: Path) -> dict:
    """The device and ``auto``'s choices, as the probe wrote them."""
    report: dict = json.loads(path.read_text())
    return report


def junit_figures(path: Path) -> dict:
    """Counts of a pytest JUnit report, and the tests that failed."""
    suite = ElementTree.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {**counts, "failed": failed}


def steps(preset: str, out: Path) -> list[Step]:
    """The step list of ``preset``, most important figures first."""
    cpu = preset == "cpu"
    env = Step("env", ("-c", ENV_PROBE, str(out / "env.json")), 120 if cpu else 45, "env.json", env_figures)
    kernel_args = (
        ("--preset=cpu", "--cases=decode", "--dtype=bfloat16", "--repeats=1")
        if cpu
        else (
            "--preset=accelerator",
            "--cases=decode,decode-long,prefill-512",
            "--repeats=5",
        )
    )
    kernels = Step(
        "kernels",
        ("scripts/bench_kernels.py", *kernel_args, f"--out={out / 'kernels.json'}"),
        400 if cpu else 170,
        "kernels.json",
        kernel_figures,
    )
    serve = Step(
        "serve",
        ("scripts/bench_serve.py", "--quick", f"--out={out / 'serve.json'}"),
        600 if cpu else 110,
        "serve.json",
        serve_figures,
    )
    test_files = (
        ("tests/test_auto.py",)
        if cpu
        else (
            "tests/test_auto.py",
            "tests/test_pallas_gpu.py",
            "tests/test_ops.py",
            "tests/test_cache.py",
        )
    )
    tests = Step(
        "tests",
        (
            "-m",
            "pytest",
            *test_files,
            "-vv",  # one line per test, despite the project's -q
            "--tb=short",
            "--maxfail=10",
            "-p",
            "no:cacheprovider",
            f"--junitxml={out / 'tests.xml'}",
        ),
        300 if cpu else 110,
        "tests.xml",
        junit_figures,
    )
    transfer_args = ("--batch_blocks=8", "--repeats=1") if cpu else ("--repeats=5",)
    transfers = Step(
        "transfers",
        (
            "scripts/bench_offload.py",
            "--sections=transfers",
            "--block_bytes=131072",
            *transfer_args,
            f"--out={out / 'transfers.json'}",
        ),
        200 if cpu else 45,
        "transfers.json",
        transfer_figures,
    )
    chosen = [env, kernels, serve, tests, transfers]
    if not cpu:
        long_serve = (
            "scripts/bench_serve.py",
            "--model=llama-1b",
            "--prompt_len=4096",
            "--max_model_len=4352",
            "--max_num_batched_tokens=4096",
            "--memory=8GiB",
            "--repeats=2",
            "--num_requests=4",
            "--max_new_tokens=4",
            f"--out={out / 'serve_4096.json'}",
        )
        chosen.append(Step("serve-4096", long_serve, 150, "serve_4096.json", serve_figures, optional=True))
    return chosen


class Log:
    """Lines to stdout and to the log file, each flushed as written."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("w")
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            for stream in (sys.stdout, self._file):
                stream.write(text if text.endswith("\n") else text + "\n")
                stream.flush()

    def lines_of(self, stream: IO[str]) -> None:
        """Every line of a step's output, indented, until it closes."""
        for text in stream:
            self.line(f"  {text}")

    def close(self) -> None:
        self._file.close()


def child_env() -> dict[str, str]:
    """The environment of every step: the repository importable, output unbuffered, offline."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def run_step(step: Step, timeout_s: float, log: Log) -> tuple[str, int | None]:
    """Run ``step`` under ``timeout_s``, streaming its output; (status, exit code)."""
    try:
        proc = subprocess.Popen(
            [sys.executable, *step.argv],
            cwd=REPO,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # its own process group: a timeout ends its children too
        )
    except OSError as err:
        log.line(f"[{step.name}] could not start: {err}")
        return "error", None
    reader = threading.Thread(target=log.lines_of, args=(proc.stdout,), daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
        status = "passed" if code == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        status = "timeout"
    reader.join(timeout=10)
    return status, code


def summary_of(step: Step, out: Path) -> dict | str | None:
    """The step's key figures from its result file (None: it wrote none; a string: unreadable)."""
    if step.result is None or step.summarize is None or not (out / step.result).is_file():
        return None
    try:
        return step.summarize(out / step.result)
    except (ValueError, KeyError, TypeError, IndexError, ElementTree.ParseError) as err:
        return f"unreadable: {type(err).__name__}: {err}"


def check(preset: str, out: Path, budget_s: float, only: list[str] | None) -> dict:
    """Run the steps in order inside ``budget_s``; the report (also written after each step)."""
    out.mkdir(parents=True, exist_ok=True)
    log = Log(out / "gpu_check.log")
    started = time.monotonic()
    report: dict[str, Any] = {"preset": preset, "budget_s": budget_s, "steps": []}
    try:
        for step in steps(preset, out):
            if only is not None and step.name not in only:
                continue
            left = budget_s - (time.monotonic() - started)
            entry: dict[str, Any] = {"name": step.name, "command": step.command}
            timeout_s = min(step.timeout_s, left)
            if left < (step.timeout_s if step.optional else min(step.timeout_s, 20.0)):
                entry.update(status="skipped", reason=f"{left:.0f} s of the budget left")
                log.line(f"== {step.name}: skipped ({left:.0f} s of the budget left)")
            else:
                log.line(f"== {step.name} (timeout {timeout_s:.0f} s, {left:.0f} s left): {entry['command']}")
                begun = time.monotonic()
                status, code = run_step(step, timeout_s, log)
                entry.update(status=status, rc=code, seconds=round(time.monotonic() - begun, 1), timeout_s=timeout_s)
                entry["figures"] = summary_of(step, out)
                log.line(f"== {step.name}: {status} in {entry['seconds']} s")
            report["steps"].append(entry)
            report["total_s"] = round(time.monotonic() - started, 1)
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        log.line("== summary")
        for entry in report["steps"]:
            figures = json.dumps(entry.get("figures")) if entry.get("figures") else ""
            log.line(f"{entry['name']:<11} {entry['status']:<8} {entry.get('seconds', 0):>6} s  {figures}")
    finally:
        log.close()
    return report


def main(argv: list[str]) -> None:
    del argv
    preset = FLAGS.preset
    if preset == "auto":
        preset = "cpu" if not Path("/dev/nvidia0").exists() and not Path("/dev/accel0").exists() else "accelerator"
    names = [step.name for step in steps(preset, Path(FLAGS.out))]
    unknown = [name for name in FLAGS.steps or () if name not in names]
    if unknown:
        exit_error(PROG, f"--steps: unknown step {', '.join(unknown)}; valid: {','.join(names)}")
    report = check(preset, Path(FLAGS.out), FLAGS.budget_s, FLAGS.steps)
    if any(entry["status"] != "passed" for entry in report["steps"]):
        sys.exit(1)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=flags_parser(PROG))
