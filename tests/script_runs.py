"""Running this repository's scripts in a subprocess, as a user would from its root."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def repo_env() -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def run_script(name: str, *args: str, timeout: float = 300, folder: str = "scripts") -> subprocess.CompletedProcess:
    """``<folder>/<name>`` (a script, or an example with ``folder="examples"``) run with
    ``args``: its status and captured text output."""
    return subprocess.run(
        [sys.executable, str(REPO / folder / name), *args],
        capture_output=True,
        text=True,
        env=repo_env(),
        timeout=timeout,
        check=False,
    )
