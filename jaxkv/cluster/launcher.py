"""Start the processes of one ``jax.distributed`` cluster on this machine, and watch them.

:func:`launch` runs ``num_processes`` copies of a command, each told its role through
the environment (:class:`ProcessRole`: a free coordinator port on 127.0.0.1, the count
and its process id) and, on CPU, how many devices XLA should make of the host
(``--xla_force_host_platform_device_count``). Process 0 prints to this terminal
(unbuffered, so progress shows as it comes); the others write to log files, whose end
is shown when that process fails. When any process fails, or on Ctrl-C, every other
one is stopped: a multi-process step waits for all its processes, so the survivors
would otherwise hang.

Host only (no JAX): the copies join the cluster themselves
(:func:`jaxkv.cluster.distributed.join`).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int

CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_cpu_device_count(xla_flags: str, count: int) -> str:
    """``xla_flags`` asking XLA for ``count`` host-platform devices (an earlier count replaced)."""
    kept = re.sub(rf"{CPU_DEVICE_COUNT_FLAG}=\S*", "", xla_flags).split()
    return " ".join([*kept, f"{CPU_DEVICE_COUNT_FLAG}={count}"])


ENV_COORDINATOR = "JAXKV_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXKV_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXKV_PROCESS_ID"
STOP_GRACE_S = 5.0
"""How long a stopped process gets to exit after SIGTERM before SIGKILL."""
LOG_TAIL_CHARS = 4000


class LaunchError(JaxkvError, ValueError):
    """A launch asked for something that cannot run, or a malformed role in the environment."""


@dataclass(frozen=True)
class ProcessRole:
    """One process's place in the cluster, as :func:`launch` hands it down."""

    coordinator_address: str
    num_processes: int
    process_id: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ProcessRole | None:
        """The role :func:`launch` set in ``env``; None for a process it did not start."""
        if ENV_PROCESS_ID not in env:
            return None
        try:
            role = cls(env[ENV_COORDINATOR], int(env[ENV_NUM_PROCESSES]), int(env[ENV_PROCESS_ID]))
        except (KeyError, ValueError) as err:
            raise LaunchError(f"malformed process role in the environment: {err}") from None
        if not 0 <= role.process_id < role.num_processes:
            raise LaunchError(f"{ENV_PROCESS_ID}={role.process_id} is not in [0, {role.num_processes})")
        return role

    def env(self) -> dict[str, str]:
        return {
            ENV_COORDINATOR: self.coordinator_address,
            ENV_NUM_PROCESSES: str(self.num_processes),
            ENV_PROCESS_ID: str(self.process_id),
        }


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(command: Sequence[str], num_processes: int, *, cpu_devices_per_process: int | None = None) -> int:
    """Run ``num_processes`` copies of ``command`` as one cluster; their exit status.

    0 when every process exits 0; else the status of the first that failed (128 + the
    signal for one killed by a signal), every other process stopped. Ctrl-C stops all
    and raises ``KeyboardInterrupt``. ``cpu_devices_per_process`` sets XLA's host
    device count of each process (CPU clusters; None leaves ``XLA_FLAGS`` as it is).
    """
    check_int("num_processes", num_processes, minimum=1, error=LaunchError)
    if cpu_devices_per_process is not None:
        check_int("cpu_devices_per_process", cpu_devices_per_process, minimum=1, error=LaunchError)
    if not command:
        raise LaunchError("launch needs a command")
    address = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="jaxkv-launch-") as logs:
        procs: list[subprocess.Popen] = []
        try:
            for pid in range(num_processes):
                env = dict(os.environ, PYTHONUNBUFFERED="1", **ProcessRole(address, num_processes, pid).env())
                if cpu_devices_per_process is not None:
                    env["XLA_FLAGS"] = with_cpu_device_count(env.get("XLA_FLAGS", ""), cpu_devices_per_process)
                if pid == 0:
                    procs.append(subprocess.Popen(list(command), env=env))
                    continue
                with open(os.path.join(logs, f"process-{pid}.log"), "w") as log:
                    procs.append(subprocess.Popen(list(command), env=env, stdout=log, stderr=subprocess.STDOUT))
            return _wait(procs, logs)
        finally:
            _stop(procs)


def _wait(procs: Sequence[subprocess.Popen], logs: str) -> int:
    """Poll until all exit 0 (0) or one fails (its status, its log's end on stderr)."""
    while True:
        codes = [p.poll() for p in procs]
        failures = [(i, c) for i, c in enumerate(codes) if c is not None and c != 0]
        if failures:
            failed, code = failures[0]
            if failed:
                with open(os.path.join(logs, f"process-{failed}.log")) as f:
                    tail = f.read()[-LOG_TAIL_CHARS:]
                print(f"--- process {failed} exited with status {code}; its output ends:\n{tail}", file=sys.stderr)
            return code if code > 0 else 128 - code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def _stop(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM every process still running, then SIGKILL those not gone after the grace."""
    running = [p for p in procs if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
