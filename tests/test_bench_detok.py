"""The detokenization benchmark at a tiny preset: both engines' figures and their texts equal."""

import json

import pytest
from hf_checkpoints import save_tiny_checkpoint
from script_runs import run_script
from tiny_tokenizer import save_tiny_tokenizer

pytestmark = pytest.mark.subprocess  # runs the script as a user would


def test_a_tiny_run_reports_the_engine_time_of_both_modes_and_equal_texts(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    save_tiny_tokenizer(tmp_path)
    out = tmp_path / "bench.json"
    done = run_script(
        "bench_detok.py", f"--checkpoint={tmp_path}", "--seqs=4", "--steps=2", "--windows=1", f"--out={out}"
    )
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["seqs"] == 4 and row["texts_identical"] is True
    assert row["inline_engine_ms"] > 0 and row["off_engine_ms"] > 0 and row["off_text_ms"] > 0


def test_a_checkpoint_without_a_tokenizer_is_one_line_and_status_2(tmp_path):
    done = run_script("bench_detok.py", f"--checkpoint={tmp_path}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "must be a checkpoint directory with a tokenizer.json" in done.stderr
