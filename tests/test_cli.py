"""What the command-line tools share: help exits 0 everywhere, the plots extra is named
when matplotlib is missing."""

import logging
import shutil
import subprocess
import sys

import pytest
from absl import flags
from script_runs import REPO, run_script

from jaxkv.commands import cli

SCRIPTS = sorted(path.name for path in (REPO / "scripts").glob("*.py"))


def private_flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_integer("count", 1, "how many", flag_values=fv)
    return fv


@pytest.mark.parametrize("arg", ["--help", "-h", "--helpshort", "--helpfull"])
def test_help_prints_the_flags_on_stdout_and_exits_0(arg, capsys):
    with pytest.raises(SystemExit) as info:
        cli.flags_parser("tool", private_flags())(["tool", arg])
    assert info.value.code == 0
    out, err = capsys.readouterr()
    assert "--count: how many" in out and err == ""


def test_a_bad_flag_is_still_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.flags_parser("tool", private_flags())(["tool", "--count=x"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("tool: error: ")


def test_plots_without_matplotlib_are_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as info:
        cli.pyplot("tool")
    assert info.value.code == 2
    assert capsys.readouterr().err == f"tool: error: {cli.PLOTS_MISSING}\n"


@pytest.mark.subprocess
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help_with_status_0(script):
    result = run_script(script, "--help", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "flags:" in result.stdout and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("arg", "spelled"),
    [
        ("--max-model-len=8", "--max_model_len=8"),
        ("--no-prefix-caching", "--noprefix_caching"),
        ("--max_model_len=8", "--max_model_len=8"),
        ("--unknown-flag=1", "--unknown-flag=1"),  # left for absl to refuse by its own name
        ("-v", "-v"),
        ("--memory=a-b", "--memory=a-b"),  # values keep their dashes
    ],
)
def test_dashed_flag_names_are_spelled_as_defined(arg, spelled):
    fv = flags.FlagValues()
    flags.DEFINE_integer("max_model_len", 1, "", flag_values=fv)
    flags.DEFINE_boolean("prefix_caching", True, "", flag_values=fv)
    flags.DEFINE_string("memory", "", "", flag_values=fv)
    assert cli.underscored(arg, fv) == spelled


def test_the_flags_parser_takes_both_spellings():
    both = ["--max-model-len=64", "--max_model_len=64"]
    parsed = []
    for arg in both:
        fv = flags.FlagValues()
        flags.DEFINE_integer("max_model_len", 1, "", flag_values=fv)
        cli.flags_parser("tool", fv)(["tool", arg])
        parsed.append(fv.max_model_len)
    assert parsed == [64, 64]


def test_parsing_flags_quiets_jaxs_backend_probe():
    logger = logging.getLogger(cli.JAX_BACKEND_PROBE_LOGGER)
    logger.setLevel(logging.NOTSET)
    cli.flags_parser("tool", private_flags())(["tool"])
    assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING)


@pytest.mark.subprocess
@pytest.mark.parametrize("command", ["jaxkv-plan", "jaxkv-serve", "jaxkv-simulate"])
def test_the_installed_console_scripts_answer_help_and_refuse_in_one_line(command):
    path = shutil.which(command)
    if path is None:
        pytest.skip(f"{command} is not installed (pip install -e . puts it on PATH)")
    helped = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "--memory" in helped.stdout, helped.stderr[-2000:]
    refused = subprocess.run([path, "--memory=x"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1].startswith(("jaxkv.commands.plan: error: ", f"{command}: error: "))
