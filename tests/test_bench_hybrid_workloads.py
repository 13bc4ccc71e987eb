"""The issue-39 workload benchmark runs every kind at both memories, its numbers are sane and repeatable."""

import json

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # runs the script as a user would

KINDS = ["prefix_once", "near_duplicate", "short_behind_prefix", "agent", "forks"]


def _quick_run(path) -> dict:
    done = run_script("bench_hybrid_workloads.py", "--quick", "--nopeer", "--out", str(path))
    assert done.returncode == 0, done.stderr
    for section in ("[workloads]", "[states]", "[summary]", "[admission]"):
        assert section in done.stdout
    return json.loads(path.read_text())


def _without_times(report: dict) -> dict:
    return {
        key: [{k: v for k, v in row.items() if k != "wall_s"} for row in value] if key == "workloads" else value
        for key, value in report.items()
        if key != "wall_s"
    }


def test_a_quick_run_reports_every_kind_at_both_memories_sanely_and_repeatably(tmp_path):
    report = _quick_run(tmp_path / "a.json")
    rows = report["workloads"]
    assert [(r["kind"], r["memory"]) for r in rows] == [(k, m) for k in KINDS for m in ("1x", "2x")]
    for one, two in zip(rows[::2], rows[1::2], strict=True):
        assert two["gib"] == pytest.approx(2 * one["gib"], rel=1e-6)
    for row in rows:
        rates = (row["attention_only_hit_rate"], row["jaxkv_hit_rate"])
        assert all(0 <= rate <= 1 for rate in rates) and row["prompt_tokens"] > 0
        assert row["attention_only_hit_rate"] > 0  # every kind shares prefixes
        assert row["attention_only_hit_rate"] >= row["jaxkv_hit_rate"]  # no states to hold: the most the bytes allow
        assert row["jaxkv_over_attention"] == row["jaxkv_hit_rate"] / row["attention_only_hit_rate"]
        assert row["vllm_hit_rate"] is None and row["vllm_over_attention"] is None and row["jaxkv_ge_vllm"] is None
        assert 0 <= row["jaxkv_chat_hit_rate"] <= row["attention_only_hit_rate"]
    ratios = [r["jaxkv_over_attention"] for r in rows]
    summary = report["summary"]
    assert summary["mean_jaxkv_over_attention"] == pytest.approx(sum(ratios) / len(ratios))
    assert summary["mean_vllm_over_attention"] is None and summary["compared_rows"] == 0
    chat = {r["kind"]: r["jaxkv_chat_over_attention"] for r in rows if r["memory"] == "2x"}
    assert chat["near_duplicate"] == rows[3]["jaxkv_over_attention"], "no message boundary named: the default's run"
    assert summary["mean_jaxkv_chat_over_attention"] == pytest.approx(
        sum(r["jaxkv_chat_over_attention"] for r in rows) / len(rows)
    )
    assert summary["jaxkv_ge_095_rows"] == sum(r >= 0.95 for r in ratios)
    assert summary["holds_rows"] == sum(r["holds_states"] for r in rows) >= summary["holds_ge_095_rows"]
    assert report["vllm"] is None and report["kinds"] == KINDS and report["memories"] == ["1", "2"]
    states = {s["kind"]: s["memories"] for s in report["states"]}
    assert list(states) == KINDS and states["short_behind_prefix"][0]["open_prefixes"] == 4
    for kind, memories in states.items():
        for m, row in zip(memories, (r for r in rows if r["kind"] == kind), strict=True):
            assert m["needed_mib"] == pytest.approx(m["open_prefixes"] * m["state_mib"] + m["prefix_kv_mib"])
            assert m["holds"] == (m["needed_mib"] <= m["left_mib"]) == row["holds_states"]
    assert [a["prompt_len"] for a in report["admission"]] == [929, 1360]
    assert all(a["jaxkv"] >= 1 and a["vllm"] is None for a in report["admission"])
    assert _without_times(_quick_run(tmp_path / "b.json")) == _without_times(report)  # seeded: the same numbers


@pytest.mark.parametrize(
    ("flag", "message"),
    [("--kinds=agent,chat", "unknown kinds ['chat']"), ("--memories=1,-2", "'-2' is not a positive memory factor")],
)
def test_a_bad_kind_or_memory_is_one_line_and_status_2(flag, message):
    done = run_script("bench_hybrid_workloads.py", "--nopeer", flag)
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert message in done.stderr
