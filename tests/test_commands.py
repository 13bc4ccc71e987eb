"""The commands as library modules (jaxkv.commands.serve and .simulate): importing them sets
nothing (no environment, no global absl flag, no JAX), each keeps its flags in a registry
of its own, ``run()`` asks XLA for the CPU devices before JAX starts, ``--help`` shows the
program as it was started, and a missing jax is one line naming the extra to install."""

import json
import os

import pytest
from absl import flags
from script_runs import run_python_without

from jaxkv.commands import cli, serve, simulate
from jaxkv.device.jax_support import JAX_MISSING

COMMANDS = ["jaxkv.commands.cli", "jaxkv.commands.plan", "jaxkv.commands.serve", "jaxkv.commands.simulate"]


@pytest.mark.subprocess
def test_importing_every_command_together_changes_nothing():
    code = (
        "import os, sys\n"
        "from absl import flags\n"
        "sys.argv = ['serve.py', '--num_devices=4', '--no-prefix-caching']\n"
        "environ, defined = dict(os.environ), sorted(flags.FLAGS)\n"
        f"for name in {COMMANDS!r}: __import__(name)\n"
        "print(dict(os.environ) == environ, sorted(flags.FLAGS) == defined, flags.FLAGS.is_parsed())\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))\n"
    )
    result = run_python_without((), code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True True False", "[]"]


@pytest.mark.parametrize("command", [serve, simulate], ids=["serve", "simulate"])
def test_each_command_defines_its_flags_in_a_registry_of_its_own(command):
    first = command.define_flags()  # imports what the flags list (JAX too, for serve: absl's logging flags)
    defined = sorted(flags.FLAGS)
    second = command.define_flags()  # again: no DuplicateFlagError
    assert first is not second and sorted(first) == sorted(second)
    assert sorted(flags.FLAGS) == defined and "prefix_caching" not in flags.FLAGS


@pytest.mark.parametrize("command", [serve, simulate], ids=["serve", "simulate"])
@pytest.mark.parametrize("arg", ["--noprefix_caching", "--no-prefix-caching"])
def test_both_commands_turn_prefix_caching_off_with_one_spelling(command, arg):
    fv = command.define_flags()
    assert fv["prefix_caching"].default is True
    cli.flags_parser("prog", fv)(["prog", arg])
    assert fv.prefix_caching is False


@pytest.mark.parametrize("command", [serve, simulate], ids=["serve", "simulate"])
def test_the_old_no_prefix_caching_spelling_is_refused_in_one_line(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.flags_parser("prog", command.define_flags())(["prog", "--no_prefix_caching"])
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("prog: error: Unknown command line flag 'no_prefix_caching'")


def test_serve_lets_the_backend_pick_the_implementation_by_default():
    assert serve.define_flags()["impl"].default == "auto"


def test_serve_run_asks_xla_for_the_cpu_devices_before_parsing(monkeypatch, capsys):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    with pytest.raises(SystemExit) as info:
        serve.run(["serve.py", "--num_devices=3", "--help"])
    assert info.value.code == 0
    assert "--xla_force_host_platform_device_count=3" in os.environ["XLA_FLAGS"]
    capsys.readouterr()


@pytest.mark.parametrize(
    ("command", "argv0", "example"),
    [
        (serve, "/usr/local/bin/jaxkv-serve", "\n    jaxkv-serve --noprefix_caching --out /tmp/serve.json\n"),
        (serve, "scripts/serve.py", "\n    python3 scripts/serve.py --noprefix_caching --out /tmp/serve.json\n"),
        (simulate, "/opt/venv/bin/jaxkv-simulate", "\n    jaxkv-simulate --trace my_trace.json --noprefix_caching\n"),
        (
            simulate,
            "scripts/simulate.py",
            "\n    python3 scripts/simulate.py --trace my_trace.json --noprefix_caching\n",
        ),
    ],
)
def test_help_shows_the_program_as_it_was_started(command, argv0, example, capsys):
    with pytest.raises(SystemExit) as info:
        command.run([argv0, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert example in out and "--[no]prefix_caching: reuse cached prefix blocks" in out
    assert ("scripts/" in out) == argv0.startswith("scripts/")


@pytest.mark.subprocess
def test_serve_without_jax_is_one_line_naming_the_extra():
    code = "from jaxkv.commands import serve\nserve.run(['serve.py', '--num_devices=2'])\n"
    result = run_python_without(("jax", "jaxlib"), code)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"serve.py: error: {JAX_MISSING} (no module named 'jax')"]
    assert result.stdout == ""


def test_simulate_reports_every_flag_it_ran_with(tmp_path, capsys):
    out = tmp_path / "sim.json"
    simulate.run(
        [
            "simulate.py",
            "--preset=tiny-hybrid",
            "--memory=2MiB",
            "--max_model_len=256",
            "--max_num_batched_tokens=64",
            "--num_conversations=2",
            "--turns_per_conversation=1",
            "--system_prompt_len=32",
            "--user_turn_len=8,16",
            "--output_len=2,4",
            "--noprefix_caching",
            f"--out={out}",
        ]
    )
    assert f"wrote {out}" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["flags"]["prefix_caching"] is False and report["flags"]["preset"] == "tiny-hybrid"
    assert report["result"]["prompt_hit_rate"] == 0
