"""Imports run one way: the host core imports no JAX, and nothing below serving imports it."""

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxkv"

HOST_MODULES = [
    "jaxkv.errors",
    "jaxkv.ints",
    "jaxkv.specs",
    "jaxkv.presets",
    "jaxkv.planner",
    "jaxkv.hashing",
    "jaxkv.free_queue",
    "jaxkv.pool",
    "jaxkv.single_type",
    "jaxkv.coordinator",
    "jaxkv.manager",
    "jaxkv.offload",
    "jaxkv.offload.catalog",
    "jaxkv.offload.policies",
    "jaxkv.serving",
    "jaxkv.serving.scheduler",
    "jaxkv.serving.lockstep",
    "jaxkv.serving.launcher",
    "jaxkv.serving.simulator",
    "jaxkv.serving.router",  # a router process need not carry JAX
]


def test_the_host_side_imports_no_jax():
    code = (
        f"import sys\nfor m in {HOST_MODULES!r}: __import__(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def imported_jaxkv_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxkv"):
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("jaxkv"))
    return names


@pytest.mark.parametrize("below", ["offload", "pallas"])
def test_nothing_below_serving_imports_serving(below):
    for path in (PACKAGE / below).rglob("*.py"):
        assert not {m for m in imported_jaxkv_modules(path) if m.startswith("jaxkv.serving")}, path


def test_the_host_core_imports_neither_serving_nor_offload():
    core = ["specs", "presets", "planner", "hashing", "free_queue", "pool", "single_type", "coordinator", "manager"]
    for name in core:
        bad = {m for m in imported_jaxkv_modules(PACKAGE / f"{name}.py") if m.split(".")[1] in ("serving", "offload")}
        assert not bad, (name, bad)
