"""The launcher starts N copies of a command with their roles, and stops them all when one fails."""

import json
import os
import sys
import textwrap

import pytest

from jaxkv.cluster.launcher import LaunchError, ProcessRole, launch, with_cpu_device_count


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_every_process_gets_its_role_and_device_count(tmp_path):
    code = f"""
        import json, os
        from jaxkv.cluster.launcher import ProcessRole
        role = ProcessRole.from_env()
        path = {str(tmp_path)!r} + f"/{{role.process_id}}.json"
        json.dump([role.coordinator_address, role.num_processes, os.environ["XLA_FLAGS"]], open(path, "w"))
        """
    assert launch(python(code), 3, cpu_devices_per_process=4) == 0
    seen = [json.loads((tmp_path / f"{p}.json").read_text()) for p in range(3)]
    assert len({address for address, _, _ in seen}) == 1
    assert all(n == 3 and flags.endswith("--xla_force_host_platform_device_count=4") for _, n, flags in seen)


def test_a_failing_process_stops_the_others_and_gives_its_status(tmp_path, capfd):
    pid_file = tmp_path / "sleeper.pid"
    code = f"""
        import os, sys, time
        if os.environ["JAXKV_PROCESS_ID"] == "1":
            while not os.path.exists({str(pid_file)!r}):
                time.sleep(0.01)
            print("process 1 gives up")
            sys.exit(3)
        open({str(pid_file)!r} + ".tmp", "w").write(str(os.getpid()))
        os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
        time.sleep(600)
        """
    assert launch(python(code), 2) == 3
    sleeper = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(sleeper, 0)
    assert "process 1 exited with status 3; its output ends:\nprocess 1 gives up" in capfd.readouterr().err


def test_a_process_killed_by_a_signal_exits_128_plus_the_signal():
    assert launch(python("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), 1) == 128 + 9


def test_roles_come_only_from_a_launch_and_malformed_ones_are_refused():
    assert ProcessRole.from_env({}) is None
    role = ProcessRole("127.0.0.1:1234", 2, 1)
    assert ProcessRole.from_env(role.env()) == role
    with pytest.raises(LaunchError, match="JAXKV_PROCESS_ID=2 is not in"):
        ProcessRole.from_env({**role.env(), "JAXKV_PROCESS_ID": "2"})
    with pytest.raises(LaunchError, match="malformed"):
        ProcessRole.from_env({"JAXKV_PROCESS_ID": "0"})


@pytest.mark.parametrize(
    "args, kwargs, needle",
    [
        ((["true"], 0), {}, "num_processes"),
        ((["true"], 2), {"cpu_devices_per_process": 0}, "cpu_devices_per_process"),
        (([], 2), {}, "needs a command"),
    ],
)
def test_a_bad_launch_is_refused_before_anything_starts(args, kwargs, needle):
    with pytest.raises(LaunchError, match=needle):
        launch(*args, **kwargs)


def test_the_device_count_replaces_an_earlier_one_and_keeps_other_flags():
    assert with_cpu_device_count("--a=1 --xla_force_host_platform_device_count=2 --b", 8) == (
        "--a=1 --b --xla_force_host_platform_device_count=8"
    )
