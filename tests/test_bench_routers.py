"""scripts/bench_routers.py at a tiny preset: two jaxkv-server replicas behind vllm-router's
``kv_aware`` policy, the router started after they cached and kept across a replica
restart. Runs where vllm-router is installed (``pip install 'jaxkv[fleet]'``, or the
environment ``JAXKV_ROUTERS_VENV`` names); skips with the reason elsewhere."""

import json
import os
import shutil
from pathlib import Path

import pytest
from script_runs import run_script

pytest.importorskip("msgspec")
pytest.importorskip("zmq")
pytest.importorskip("fastapi")

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]  # three servers and a Rust router, as a user runs them


def routers_venv() -> Path | None:
    """The environment holding vllm-router: JAXKV_ROUTERS_VENV, else the one on PATH."""
    named = os.environ.get("JAXKV_ROUTERS_VENV")
    if named:
        return Path(named) if (Path(named) / "bin" / "vllm-router").exists() else None
    found = shutil.which("vllm-router")
    return None if found is None else Path(found).resolve().parent.parent


def venv_and_checkpoint(tmp_path: Path, family: str) -> tuple[Path, Path]:
    """The routers' environment (skips without vllm-router) and a tiny ``family`` checkpoint saved for the run."""
    venv = routers_venv()
    if venv is None:
        pytest.skip("vllm-router is not installed (pip install 'jaxkv[fleet]', or set JAXKV_ROUTERS_VENV)")
    checkpoint = tmp_path / f"tiny-{family}"
    saved = run_script("save_tiny_checkpoint.py", f"--family={family}", f"--out={checkpoint}")
    assert saved.returncode == 0, saved.stderr[-3000:]
    return venv, checkpoint


def test_kv_aware_vllm_router_follows_replicas_that_cached_before_it_started(tmp_path):
    venv, checkpoint = venv_and_checkpoint(tmp_path, "llama")
    out = tmp_path / "routers.json"
    args = ["--checkpoint", str(checkpoint), f"--routers_venv={venv}"]
    args += ["--configs=vllm:kv_aware", "--num_replicas=2", "--num_conversations=4", "--turns=3", f"--out={out}"]
    result = run_script("bench_routers.py", *args, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    big, kv = report["big"], report["configs"]["vllm:kv_aware"]
    assert big["queries"] > 0 and kv["queries"] > 0
    # routed as the replicas' replayed events say: as many hits as one cache of both
    assert kv["late_join_hit_rate"] >= 0.9 * big["late_join_hit_rate"], report
    assert "vllm:kv_aware" in result.stdout


def test_kv_aware_credits_a_hybrids_state_aware_events_and_nothing_the_replicas_recompute(tmp_path):
    """Tiny Qwen3-Next: with state-aware events vllm-router credits the routed turn only
    with what the replicas then hit, and it hits more than with the raw per-group events."""
    venv, checkpoint = venv_and_checkpoint(tmp_path, "qwen3_next")
    out = tmp_path / "routers.json"
    args = ["--checkpoint", str(checkpoint), f"--routers_venv={venv}", "--configs=vllm:kv_aware"]
    args += ["--kv_events=state_aware,raw", "--num_replicas=2", "--num_conversations=4", "--turns=2", f"--out={out}"]
    result = run_script("bench_routers.py", *args, timeout=480)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    aware, raw = report["configs"]["vllm:kv_aware"], report["configs"]["vllm:kv_aware[raw]"]
    assert aware["credited_tokens"] > 0 and aware["recomputed_credited_tokens"] == 0, aware
    assert aware["hits"] > raw["hits"], report
