"""Trace simulator: synthetic traces, JSON traces, the scheduler's replay and the CLI."""

import json
import subprocess
from pathlib import Path

import pytest
from kv_configs import FULL, make_manager
from script_runs import run_script

from jaxkv.core.manager import KVCacheManager
from jaxkv.errors import JaxkvError
from jaxkv.planner import PlanOptions, plan_kv_cache
from jaxkv.presets import get_preset
from jaxkv.serving.simulator import (
    MAX_NUM_BLOCKS,
    PlanTooLargeError,
    PoolTooSmallError,
    RequestTooLongError,
    SimulationError,
    Simulator,
    TraceError,
    TraceRequest,
    check_num_blocks,
    load_trace,
    output_token_ids,
    save_trace,
    synthetic_trace,
)

BLOCK_BYTES = 16 * 1024  # tiny-hybrid: one slot of 16 tokens x 2 heads x 64 x K/V x float32

TRACE_KNOBS = {
    "num_conversations": 12,
    "turns_per_conversation": 3,
    "num_system_prompts": 2,
    "system_prompt_len": 128,
    "user_turn_len": (8, 64),
    "output_len": (4, 32),
    "arrival_rate": 2.0,
    "turn_gap_s": 2.0,
}


def chat_trace(seed: int = 1) -> list[TraceRequest]:
    return synthetic_trace(**TRACE_KNOBS, seed=seed)


def tiny_hybrid_sim(num_blocks: int, *, caching: bool = True) -> Simulator:
    """tiny-hybrid (5 sliding-window groups + 1 full) with ``num_blocks`` blocks."""
    config = plan_kv_cache(
        get_preset("tiny-hybrid"),
        num_blocks * BLOCK_BYTES,
        max_model_len=512,
        options=PlanOptions(max_num_batched_tokens=128),
    )
    assert config.num_blocks == num_blocks
    manager = KVCacheManager(config, enable_caching=caching)
    return Simulator(manager, max_num_seqs=8, max_num_batched_tokens=128)


# ------------------------------------------------------------ synthetic traces
def test_synthetic_trace_is_deterministic_for_a_seed():
    assert chat_trace(seed=1) == chat_trace(seed=1)
    assert chat_trace(seed=1) != chat_trace(seed=2)


def test_synthetic_trace_shares_system_prompts_and_arrives_in_order():
    trace = chat_trace()
    assert len(trace) == 36
    assert [r.arrival_time for r in trace] == sorted(r.arrival_time for r in trace)
    systems = {r.prompt_token_ids[:128] for r in trace}
    assert len(systems) == 2


def test_follow_up_turns_extend_the_previous_turn_and_its_output():
    by_id = {r.request_id: r for r in chat_trace()}
    for c in range(12):
        for k in (1, 2):
            prev, cur = by_id[f"conv{c}-turn{k - 1}"], by_id[f"conv{c}-turn{k}"]
            context = prev.prompt_token_ids + tuple(output_token_ids(prev.request_id, prev.max_output_tokens))
            assert cur.prompt_token_ids[: len(context)] == context
            assert 8 <= len(cur.prompt_token_ids) - len(context) <= 64
            assert cur.arrival_time > prev.arrival_time


def test_output_tokens_are_a_prefix_stable_function_of_the_id():
    assert output_token_ids("r", 50)[:20] == output_token_ids("r", 20)
    assert output_token_ids("r", 20) != output_token_ids("s", 20)


@pytest.mark.parametrize(
    "knobs, match",
    [
        ({"user_turn_len": (5, 2)}, "user_turn_len"),
        ({"output_len": (0, 4)}, "output_len"),
        ({"arrival_rate": 0.0}, "arrival_rate"),
        ({"num_system_prompts": 0}, "num_system_prompts"),
        ({"seed": -1}, "seed must be a.* int.*, got -1"),
        ({"user_turn_len": (1, 2, 3)}, r"user_turn_len .*got \(1, 2, 3\)"),
        ({"output_len": 7}, "output_len .*got 7"),
        ({"num_conversations": True}, "num_conversations must be a.* int.*, got True"),
    ],
)
def test_bad_synthetic_knobs_are_named(knobs, match):
    with pytest.raises(TraceError, match=match):
        synthetic_trace(**{**TRACE_KNOBS, **knobs})


# ------------------------------------------------------------------ replay
def test_replay_finishes_every_request_and_frees_every_block():
    sim = tiny_hybrid_sim(400)
    trace = chat_trace()
    result = sim.run(trace)
    assert result.num_finished == result.num_requests == len(trace)
    assert sim.manager.num_free_blocks == sim.manager.config.num_blocks - 1
    for req in trace:
        assert result.outputs[req.request_id] == tuple(output_token_ids(req.request_id, req.max_output_tokens))
    assert result.num_generated_tokens == sum(r.max_output_tokens for r in trace)
    assert result.num_prompt_tokens == sum(len(r.prompt_token_ids) for r in trace)
    assert 0 < result.mean_usage <= result.peak_usage <= 1
    assert result.host_us_p50 <= result.host_us_p99
    assert result.num_preemptions == 0 and result.num_capped == 0


def test_prefix_caching_hits_without_changing_the_outputs():
    cached = tiny_hybrid_sim(400).run(chat_trace())
    uncached = tiny_hybrid_sim(400, caching=False).run(chat_trace())
    assert cached.prompt_hit_rate > 0.5 and cached.cache_hit_rate > 0.5
    assert uncached.prompt_hit_rate == uncached.cache_hit_rate == uncached.cache_queries == 0
    assert cached.outputs == uncached.outputs
    assert cached.outputs_digest() == uncached.outputs_digest()
    assert cached.num_scheduled_tokens < uncached.num_scheduled_tokens


def test_a_tiny_budget_preempts_but_completes_with_the_same_outputs():
    roomy = tiny_hybrid_sim(400).run(chat_trace())
    sim = tiny_hybrid_sim(100, caching=False)
    tight = sim.run(chat_trace())
    assert tight.num_preemptions > 0
    assert tight.peak_usage > 0.95
    assert tight.num_finished == len(chat_trace())
    assert tight.outputs == roomy.outputs
    assert sim.manager.num_free_blocks == 99


def test_the_most_recently_admitted_request_is_preempted():
    # 6 usable blocks of 16 tokens: "a" grows to 69 tokens (5 blocks), "b" to 59 (4).
    mgr = make_manager(7, FULL, max_model_len=256)
    freed = []
    free = mgr.free
    mgr.free = lambda req: (freed.append((req.request_id, req.num_tokens)), free(req))
    trace = [TraceRequest("a", 0.0, range(40), 30), TraceRequest("b", 0.0, range(100, 130), 30)]
    result = Simulator(mgr, max_num_seqs=4, max_num_batched_tokens=512).run(trace)
    assert result.num_preemptions == 1
    assert [rid for rid, _ in freed] == ["b", "a", "b"]
    assert freed[0][1] < 60 and freed[1] == ("a", 70) and freed[2] == ("b", 60)
    # The manager counts a lookup for "b" on every step it waits at the head of the
    # queue after its preemption; first admissions alone hit nothing here.
    assert result.cache_queries > 3 and result.num_prompt_hit_tokens == 0


def test_chunked_prefill_respects_the_token_budget():
    mgr = make_manager(20, FULL)
    result = Simulator(mgr, max_num_batched_tokens=16).run([TraceRequest("a", 0.0, range(100), 3)])
    assert result.num_steps == 7 + 2  # ceil(100 / 16) prefill steps, then 2 decode steps
    assert result.num_scheduled_tokens == 102


def test_idle_time_is_skipped_and_arrivals_wait_for_their_time():
    mgr = make_manager(20, FULL)
    trace = [TraceRequest("late", 100.0, range(10), 2), TraceRequest("early", 0.0, range(10), 2)]
    result = Simulator(mgr, step_duration_s=0.5).run(trace)
    assert result.num_steps == 4
    assert result.simulated_time_s == pytest.approx(101.0)


def test_generation_stops_at_max_model_len():
    mgr = make_manager(20, FULL, max_model_len=64)
    result = Simulator(mgr).run([TraceRequest("a", 0.0, range(60), 10)])
    assert result.num_capped == 1 and len(result.outputs["a"]) == 4


def test_a_huge_max_output_tokens_is_capped_at_max_model_len():
    # 10**11 output tokens: the replay draws only what fits in max_model_len (no huge list).
    mgr = make_manager(20, FULL, max_model_len=64)
    result = Simulator(mgr).run([TraceRequest("a", 0.0, range(10), 10**11), TraceRequest("b", 0.0, range(5), 3)])
    assert result.num_finished == 2 and result.num_capped == 1
    assert result.outputs["a"] == tuple(output_token_ids("a", 54))
    assert len(result.outputs["b"]) == 3
    assert mgr.num_free_blocks == 19


def test_a_plan_of_too_many_blocks_is_refused_before_a_manager_exists():
    assert check_num_blocks(MAX_NUM_BLOCKS) == MAX_NUM_BLOCKS == 2**24
    config = plan_kv_cache(get_preset("gemma-3-27b"), 1 << 50, max_model_len=8192)  # 1 PiB
    with pytest.raises(PlanTooLargeError, match=f"{config.num_blocks:,} blocks.*at most 16,777,216") as err:
        check_num_blocks(config.num_blocks)
    assert isinstance(err.value, SimulationError) and isinstance(err.value, JaxkvError)
    with pytest.raises(SimulationError, match=r"num_blocks must be a.* int.*, got 0"):
        check_num_blocks(0)


def test_a_prompt_without_room_for_output_is_refused_up_front():
    mgr = make_manager(20, FULL, max_model_len=64)
    trace = [TraceRequest("ok", 0.0, range(10), 2), TraceRequest("big", 0.0, range(64), 2)]
    with pytest.raises(RequestTooLongError, match=r"'big' has a 64-token prompt; max_model_len=64"):
        Simulator(mgr).run(trace)
    assert mgr.prefix_cache_stats().num_requests == 0


@pytest.mark.parametrize("prompt, output", [(40, 30), (60, 1)])
def test_a_pool_too_small_for_one_request_is_an_error(prompt, output):
    mgr = make_manager(4, FULL, max_model_len=256)  # 3 usable blocks = 48 tokens
    with pytest.raises(PoolTooSmallError, match="'a'"):
        Simulator(mgr, max_num_batched_tokens=512).run([TraceRequest("a", 0.0, range(prompt), output)])


def test_bad_simulator_arguments_are_named():
    mgr = make_manager(20, FULL)
    with pytest.raises(SimulationError, match=r"max_num_seqs must be a.* int.*, got 0"):
        Simulator(mgr, max_num_seqs=0)
    with pytest.raises(TypeError, match="max_num_running"):  # renamed to the scheduler's word, no alias
        Simulator(mgr, max_num_running=4)
    with pytest.raises(SimulationError, match="step_duration_s"):
        Simulator(mgr, step_duration_s=-1.0)
    with pytest.raises(TraceError, match="duplicate request_id 'a'"):
        Simulator(mgr).run([TraceRequest("a", 0.0, [1], 1), TraceRequest("a", 1.0, [2], 1)])


# ------------------------------------------------------------- JSON traces
def test_json_trace_round_trip(tmp_path):
    trace = [
        *chat_trace()[:5],
        TraceRequest("salted", 3.5, [1, 2, 3], 4, cache_salt="t1", lora_name="sql"),
        TraceRequest("chat", 4.0, [1, 2, 3], 4, branch_points=[2, 1]),
    ]
    path = tmp_path / "trace.json"
    save_trace(path, trace)
    assert load_trace(path) == trace
    assert json.loads(path.read_text())[-1]["branch_points"] == [1, 2]
    assert json.loads(path.read_text())[-2] == {
        "request_id": "salted",
        "arrival_time": 3.5,
        "prompt_token_ids": [1, 2, 3],
        "max_output_tokens": 4,
        "cache_salt": "t1",
        "lora_name": "sql",
    }


GOOD = {"request_id": "r0", "arrival_time": 0, "prompt_token_ids": [1, 2], "max_output_tokens": 3}


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        ('{"requests": []}', "JSON list"),
        ([GOOD, 7], r"entry \[1\]: must be an object"),
        ([GOOD, {"request_id": "r1", "arrival_time": 0, "prompt_token_ids": [1]}], r"\[1\]: missing field 'max_output"),
        ([{**GOOD, "priority": 1}], r"\[0\]: unknown field 'priority'"),
        ([{**GOOD, "max_output_tokens": 0}], r"\[0\]: request 'r0': field 'max_output_tokens' must be .*, got 0"),
        ([{**GOOD, "arrival_time": -1}], r"field 'arrival_time'.*-1"),
        ([{**GOOD, "arrival_time": "soon"}], r"field 'arrival_time'"),
        ([{**GOOD, "prompt_token_ids": [1, -5]}], r"field 'prompt_token_ids'\[1\].*-5"),
        ([{**GOOD, "prompt_token_ids": [1, 2.5]}], r"field 'prompt_token_ids'\[1\].*2.5"),
        ([{**GOOD, "prompt_token_ids": []}], r"field 'prompt_token_ids' must be a non-empty list"),
        ([{**GOOD, "request_id": 5}], r"\[0\]: field 'request_id'"),
        ([{**GOOD, "cache_salt": 3}], r"field 'cache_salt' must be a UTF-8 str or null"),
        ([{**GOOD, "branch_points": [2]}], r"request 'r0': field: branch point 2 is not a position in \(0, 2\)"),
        ([GOOD, GOOD], r"entry \[1\]: duplicate request_id 'r0'"),
        ([{**GOOD, "max_output_tokens": 1e11}], r"field 'max_output_tokens' must be a.* int.*, got 100000000000.0"),
        ([{**GOOD, "max_output_tokens": True}], r"field 'max_output_tokens' must be a.* int.*, got True"),
        ([{**GOOD, "arrival_time": 10**400}], r"field 'arrival_time' must be a finite number >= 0, got 1000"),
        ([{**GOOD, "prompt_token_ids": [1, 10**300]}], r"field 'prompt_token_ids'\[1\] must be a token id"),
        ([{**GOOD, "prompt_token_ids": "12"}], r"field 'prompt_token_ids' must be a non-empty list"),
        ([{**GOOD, "request_id": ""}], r"field 'request_id' must be a non-empty UTF-8 str"),
        (
            '[{"request_id": "\\ud800", "arrival_time": 0, "prompt_token_ids": [1], "max_output_tokens": 1}]',
            r"field 'request_id' must be a non-empty UTF-8 str, got '\\ud800'",
        ),
        ([{**GOOD, "lora_name": ["x"]}], r"field 'lora_name' must be a UTF-8 str or null"),
        (
            '[{"request_id": "r", "arrival_time": 0, "prompt_token_ids": [1'
            + "0" * 5000
            + '], "max_output_tokens": 1}]',
            "cannot read the JSON: Exceeds the limit",
        ),
        ("[" * 100_000 + "]" * 100_000, "cannot read the JSON: maximum recursion depth"),
        ("[NaN]", r"entry \[0\]: must be an object"),
        ("", "not valid JSON"),
    ],
)
def test_bad_trace_files_give_typed_errors_naming_the_field(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(TraceError, match=match) as err:
        load_trace(path)
    assert str(path) in str(err.value)
    assert isinstance(err.value, JaxkvError) and isinstance(err.value, ValueError)


def test_a_trace_file_that_is_not_utf8_is_a_trace_error(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'[{"request_id": "caf\xe9", "arrival_time": 0, "prompt_token_ids": [1], "max_output_tokens": 1}]')
    with pytest.raises(TraceError, match=r"latin1.json: not UTF-8 text: byte b'\\xe9' at offset 20"):
        load_trace(path)


def test_a_trace_asking_for_10_to_the_11_output_tokens_loads_and_replays(tmp_path):
    path = tmp_path / "long.json"
    path.write_text(json.dumps([{**GOOD, "max_output_tokens": 10**11}]))
    (req,) = load_trace(path)
    assert req.max_output_tokens == 10**11
    result = Simulator(make_manager(20, FULL, max_model_len=64)).run([req])
    assert result.num_capped == 1 and len(result.outputs["r0"]) == 62


# --------------------------------------------------------------------- CLI
def simulate(*args: str) -> subprocess.CompletedProcess:
    return run_script("simulate.py", *args, timeout=120)


CLI_FLAGS = (
    "--preset=tiny-hybrid",
    "--memory=2MiB",
    "--max_model_len=512",
    "--max_num_batched_tokens=128",
    "--num_conversations=8",
    "--system_prompt_len=64",
    "--user_turn_len=8,32",
    "--output_len=4,16",
    "--progress_every=50",
)


@pytest.mark.subprocess
def test_script_runs_end_to_end_and_replays_its_saved_trace(tmp_path):
    out, trace = tmp_path / "result.json", tmp_path / "trace.json"
    first = simulate(*CLI_FLAGS, f"--out={out}", f"--save_trace={trace}")
    assert first.returncode == 0, first.stderr
    for text in ("KV cache plan", "step      50", "prefix hit rate", "host us/step", "wall time"):
        assert text in first.stdout
    report = json.loads(out.read_text())
    assert report["result"]["num_finished"] == report["result"]["num_requests"] == 24
    assert report["result"]["prompt_hit_rate"] > 0
    assert report["flags"]["preset"] == "tiny-hybrid"

    out2 = tmp_path / "again.json"
    second = simulate(*CLI_FLAGS, f"--trace={trace}", "--noprefix_caching", f"--out={out2}")
    assert second.returncode == 0, second.stderr
    again = json.loads(out2.read_text())["result"]
    assert again["prompt_hit_rate"] == 0
    assert again["outputs_digest"] == report["result"]["outputs_digest"]


@pytest.mark.subprocess
def test_script_reports_bad_input_in_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    result = simulate(*CLI_FLAGS, f"--trace={bad}")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        (
            f"simulate.py: error: {bad}: entry [0]: must be an object with fields "
            "request_id, arrival_time, prompt_token_ids, max_output_tokens, got 1"
        )
    ]


def _trace_file(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


LONG_PROMPT_TRACE = json.dumps([{**GOOD, "prompt_token_ids": [1] * 512}]).encode()

# Each: (extra flags, a function of tmp_path giving more flags, what stderr's one line must hold).
BAD_CLI = {
    # 300 GiB of tiny-hybrid is 19.7M blocks of 16 KiB: over the 2**24 cap (before: built and ran).
    "too many blocks": (["--memory=300GiB"], None, "--memory=300GiB: the plan has 19,660,800 blocks"),
    "unreadable size": (["--memory=lots"], None, "cannot read memory size 'lots'"),
    "zero size": (["--memory=0"], None, "memory size must be positive, got '0'"),
    "negative size": (["--memory=-4MiB"], None, "cannot read memory size '-4MiB'"),
    "zero max_num_seqs": (["--max_num_seqs=0"], None, "flag --max_num_seqs=0: 0 is not a positive integer"),
    "old flag name": (["--max_num_running=4"], None, "Unknown command line flag 'max_num_running'"),
    "negative seed": (["--seed=-1"], None, "flag --seed=-1"),
    "bad range": (["--user_turn_len=32,8"], None, "--user_turn_len must be lo,hi with 1 <= lo <= hi"),
    "non-ASCII digits": (["--output_len=\u00b2,3"], None, "--output_len must be lo,hi"),
    "infinite step": (["--step_ms=inf"], None, "--step_ms must be a finite number > 0"),
    "huge system prompt": (["--system_prompt_len=10000000000"], None, "--system_prompt_len=10000000000 + "),
    "huge outputs": (["--output_len=1,10000000000"], None, "--output_len hi=10000000000 exceeds --max_model_len=512"),
    "positional": (["extra"], None, "unexpected arguments: extra"),
    "missing trace": (["--trace=/nonexistent/trace.json"], None, "No such file or directory"),
    "non-UTF-8 trace": (
        [],
        lambda tmp: [f"--trace={_trace_file(tmp, 'b.json', bytes([0xFF, 0x5B, 0x5D]))}"],
        "not UTF-8 text: byte b'\\xff' at offset 0",
    ),
    "trace with a 5000-digit int": (
        [],
        lambda tmp: [f"--trace={_trace_file(tmp, 'd.json', b'[' + b'7' * 5000 + b']')}"],
        "cannot read the JSON",
    ),
    "prompt too long": (
        [],
        lambda tmp: [f"--trace={_trace_file(tmp, 'p.json', LONG_PROMPT_TRACE)}"],
        "'r0' has a 512-token prompt; max_model_len=512",
    ),
}


@pytest.mark.subprocess
@pytest.mark.parametrize("case", list(BAD_CLI))
def test_script_refuses_bad_input_in_one_line_with_status_2(tmp_path, case):
    flags, more, expected = BAD_CLI[case]
    result = simulate(*CLI_FLAGS, *flags, *(more(tmp_path) if more else []))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("simulate.py: error: "), lines
    assert expected in lines[0]


@pytest.mark.subprocess
def test_script_caps_a_trace_request_at_max_model_len(tmp_path):
    trace = _trace_file(tmp_path, "t.json", json.dumps([{**GOOD, "max_output_tokens": 10**11}]).encode())
    out = tmp_path / "out.json"
    result = simulate(*CLI_FLAGS, f"--trace={trace}", f"--out={out}")
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())["result"]
    assert report["num_capped"] == 1 and report["num_generated_tokens"] == 510


@pytest.mark.subprocess
def test_script_plots_usage_and_hit_rate_over_time(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    result = simulate(*CLI_FLAGS, f"--plot={png}")
    assert result.returncode == 0, result.stderr
    assert f"wrote {png}" in result.stdout
    assert "step      50" in result.stdout  # sampling for the plot keeps the progress lines
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.subprocess
def test_script_refuses_a_plot_without_matplotlib_before_the_run(tmp_path, monkeypatch):
    blocker = tmp_path / "no_matplotlib" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    monkeypatch.setenv("PYTHONPATH", str(blocker.parent))
    result = simulate(*CLI_FLAGS, f"--plot={tmp_path / 'sim.png'}")
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["simulate.py: error: --plot needs matplotlib: pip install 'jaxkv[plots]'"]
    assert result.stdout == "" and not (tmp_path / "sim.png").exists()
