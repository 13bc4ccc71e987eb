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


def run_python_without(hidden: tuple[str, ...], code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Python ``code`` run in a fresh interpreter from the repository root in which the
    top-level packages ``hidden`` cannot be imported (a meta-path finder answers for them
    as a machine without them would): its status and captured text output."""
    finder = (
        "import importlib.abc, sys\n"
        "class Hidden(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {hidden!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Hidden())\n"
    )
    return subprocess.run(
        [sys.executable, "-c", finder + code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=repo_env(),
        timeout=timeout,
        check=False,
    )
