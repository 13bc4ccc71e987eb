"""jaxkv.commands.plan's command line and the helpers the scripts share: sizes, device memory, one-line errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from absl import flags

from jaxkv.commands.cli import (
    DeviceMemoryError,
    SizeError,
    check_fits_device,
    device_memory_bytes,
    exit_error,
    flags_parser,
    is_int_range,
    parse_size,
    request_cpu_devices,
)
from jaxkv.commands.plan import main
from jaxkv.errors import JaxkvError

REPO = Path(__file__).resolve().parents[1]
GOOD = ["jaxkv.commands.plan", "--preset=tiny-hybrid", "--memory=4MiB", "--max_model_len=512"]


class FakeDevice:
    def __init__(self, stats, platform="gpu"):
        self.stats, self.platform = stats, platform

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats

    def __str__(self):
        return f"{self.platform}:0"


# ------------------------------------------------------------------ sizes
def test_sizes_read_petabytes_and_refuse_literals_too_long_to_convert():
    assert parse_size("1PiB") == 1 << 50 and parse_size("2pb") == 2 * 10**15
    for bad in ("1" + "0" * 5000, "0." + "0" * 5000 + "1", "\u0661\u0662", "1e400"):
        with pytest.raises(SizeError, match="cannot read memory size"):
            parse_size(bad)
    with pytest.raises(SizeError, match="must be a str such as '16GiB', got 5"):
        parse_size(5)
    assert issubclass(SizeError, JaxkvError) and issubclass(SizeError, ValueError)


def test_int_ranges_are_two_ascii_ints_in_order():
    assert is_int_range(["1", "2"]) and is_int_range([" 3", "3 "])
    for bad in (["2", "1"], ["0", "1"], ["1"], ["1", "2", "3"], ["\u00b2", "3"], ["1", "9" * 40], ["-1", "2"]):
        assert not is_int_range(bad), bad


# ---------------------------------------------------------- device memory
def test_device_memory_is_the_bytes_limit_else_ram_on_cpu():
    assert device_memory_bytes(FakeDevice({"bytes_limit": 80 << 30})) == (80 << 30, "gpu:0 bytes_limit")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert device_memory_bytes(FakeDevice(None, "cpu")) == (ram, "cpu:0 physical RAM")
    assert device_memory_bytes(FakeDevice(RuntimeError("no stats"), "cpu"))[0] == ram
    assert device_memory_bytes(FakeDevice(None, "tpu")) is None


def test_a_budget_over_the_device_memory_is_refused_naming_both():
    small = FakeDevice({"bytes_limit": 8 << 30})
    message = (
        r"--memory=16GB budget of 16,000,000,000 bytes \(14.9 GiB\) exceeds "
        r"the device memory: 8,589,934,592 bytes \(8.0 GiB\) \(gpu:0 bytes_limit\)"
    )
    with pytest.raises(DeviceMemoryError, match=message):
        check_fits_device(16 * 10**9, small, name="--memory=16GB")
    check_fits_device(8 << 30, small)
    check_fits_device(1 << 60, FakeDevice(None, "tpu"))  # unknown memory: nothing to compare with
    with pytest.raises(DeviceMemoryError, match="physical RAM"):
        check_fits_device(1 << 60, FakeDevice(None, "cpu"))
    assert issubclass(DeviceMemoryError, SizeError)


# ------------------------------------------------------------ one-line exits
def test_exit_error_prints_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        exit_error("prog.py", ValueError("first line\nsecond line"))
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "prog.py: error: first line\n"


def test_flags_parser_turns_absl_errors_into_one_line(capsys):
    fv = flags.FlagValues()
    flags.DEFINE_integer("count", 1, "a count", lower_bound=1, flag_values=fv)
    parse = flags_parser("prog.py", fv)
    assert parse(["prog.py", "--count=3"]) == ["prog.py"] and fv.count == 3
    for argv, message in (
        (["prog.py", "--count=0"], "prog.py: error: flag --count=0: 0 is not a positive integer\n"),
        (["prog.py", "--count=x"], "prog.py: error: flag --count=x: invalid literal for int() with base 10: 'x'\n"),
        (["prog.py", "--nope"], "prog.py: error: Unknown command line flag 'nope'\n"),
        (["prog.py", "stray"], "prog.py: error: unexpected arguments: stray\n"),
    ):
        fv.unparse_flags()
        with pytest.raises(SystemExit) as exit_:
            parse(argv)
        assert exit_.value.code == 2 and capsys.readouterr().err == message


# --------------------------------------------------------------------- CLI
@pytest.mark.parametrize(
    ("args", "message", "status"),
    [
        (["--memory=0"], "memory size must be positive, got '0'", 2),
        (["--memory=-1GiB"], "cannot read memory size '-1GiB'", 2),
        (["--memory=" + "9" * 5000], "cannot read memory size '99999", 2),
        (["--max_model_len=0"], "max_model_len must be a positive int, got 0", 2),
        (["--max-model-len=-5"], "max_model_len must be a positive int, got -5", 2),
        (["--block_size=0"], "block_size must be a positive int, got 0", 2),
        (["--max_num_batched_tokens=-1"], "max_num_batched_tokens must be a positive int, got -1", 2),
        (["--max_model_len=lots"], "flag --max_model_len=lots: invalid literal for int()", 2),
        (["--layout=diagonal"], "flag --layout=diagonal: value should be one of <cross_layer|per_layer>", 2),
        (["--preset=nope"], "'nope'", 2),
        (["stray"], "unexpected arguments: stray", 2),
        (["--memory=1KiB"], "memory_bytes=1024 holds 0 blocks", 2),  # a plan that cannot be made
    ],
)
def test_cli_refuses_bad_flags_in_one_line(capsys, args, message, status):
    assert main([*GOOD, *args]) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxkv.commands.plan: error: ") and message in err


@pytest.mark.subprocess
def test_cli_plans_a_petabyte_and_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-m", "jaxkv.commands.plan", "--preset=gemma-3-27b", "--memory=1PiB", "--max-model-len=8192"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "num_blocks" in out.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "jaxkv.commands.plan", "--preset=gemma-3-27b", "--memory=1PiB", "--max-model-len=x"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        check=False,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


# ------------------------------------------------------------ state pool
NEMOTRON = ["jaxkv.commands.plan", "--preset=nemotron-h-8b", "--memory=16GiB", "--max-model-len=32768"]


def test_cli_plans_a_state_pool_and_prints_the_split(capsys):
    assert main([*NEMOTRON, "--state-layout=state_pool", "--checkpoint-memory=1GiB"]) == 0
    out = capsys.readouterr().out
    assert "mamba2 (state pool)" in out and "hash block size 16 tokens" in out
    assert "25 live x 97.41 MiB" in out and "10 checkpoint(s)" in out
    assert "of 16.00 GiB; prefix-cache granularity (hash block size) 16 tokens" in out
    assert main([*NEMOTRON, "--state_layout=state_pool", "--max_num_seqs=8"]) == 0
    assert "8 live x" in capsys.readouterr().out
    assert main([*NEMOTRON, "--state_layout=attention_pages"]) == 0
    assert "hash block size 1040 tokens" in capsys.readouterr().out


def test_cli_prints_what_one_memory_holds_without_extra_flags(capsys):
    assert main(NEMOTRON) == 0
    out = capsys.readouterr().out
    assert "mamba2 (shared pages)" in out and "hash block size 16 tokens" in out
    assert "a state (97.41 MiB" in out and "takes 390 block(s)" in out and "max concurrency 26" in out


@pytest.mark.parametrize(
    ("args", "message", "status"),
    [
        (
            ["--state_layout=pages"],
            "flag --state_layout=pages: value should be one of <auto|attention_pages|state_pool|shared_pages>",
            2,
        ),
        (["--max_num_seqs=4"], "max_num_seqs=4 and checkpoint_bytes=0 size a state pool", 2),
        (["--checkpoint_memory=1GiB"], "checkpoint_bytes=1073741824 size a state pool", 2),
        (["--state_layout=state_pool", "--max_num_seqs=0"], "max_num_seqs must be a positive int, got 0", 2),
        (["--state_layout=state_pool", "--checkpoint_memory=lots"], "cannot read memory size 'lots'", 2),
        (["--state_layout=state_pool", "--checkpoint_memory=16GiB"], "checkpoint_bytes=17179869184", 2),
    ],
)
def test_cli_refuses_bad_state_pool_flags_in_one_line(capsys, args, message, status):
    assert main([*NEMOTRON, *args]) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxkv.commands.plan: error: ") and message in err


def test_num_devices_in_argv_sets_the_cpu_device_count_unless_one_is_set(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--a=1")
    request_cpu_devices(["serve.py", "--num_devices", "4"])
    assert os.environ["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=4"
    request_cpu_devices(["serve.py", "--num_devices=2"])  # a count already set wins
    assert os.environ["XLA_FLAGS"].endswith("count=4")
    monkeypatch.setenv("XLA_FLAGS", "")
    request_cpu_devices(["serve.py", "--num_devices=x"])  # left for the flag parser to refuse
    assert os.environ["XLA_FLAGS"] == ""
