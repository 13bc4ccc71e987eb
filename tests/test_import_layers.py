"""Imports run one way (DESIGN.md): shared (errors, specs, presets, planner) -> core (the
host-side manager) -> device, pallas -> offload, interop -> models -> serving -> cluster, fleet ->
benchmarks, commands. The shared modules and the core import no JAX."""

import ast
import pathlib
import subprocess
import sys

import pytest
from script_runs import run_python_without

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxkv"

SHARED = ["errors", "ints", "specs", "presets", "plan_summary", "planner"]
"""The modules the package root keeps: what the host core and the device side both use."""

# The layer of each top-level name under jaxkv; a module may import its own layer and below.
LAYERS = {
    **dict.fromkeys(SHARED, 0),
    "core": 1,
    "device": 2,
    "pallas": 2,
    "offload": 3,
    "interop": 3,
    "models": 4,
    "serving": 5,
    "cluster": 6,
    "fleet": 6,
    "server": 6,
    "benchmarks": 7,
    "commands": 7,
}

HOST_CORE = [f"jaxkv.core.{path.stem}" for path in sorted((PACKAGE / "core").glob("*.py")) if path.stem != "__init__"]

HOST_MODULES = [
    *(f"jaxkv.{name}" for name in SHARED),
    "jaxkv.core",
    *HOST_CORE,
    "jaxkv.commands.cli",
    "jaxkv.commands.plan",
    "jaxkv.commands.serve",  # JAX only inside run(), after XLA's CPU device count is set
    "jaxkv.commands.simulate",
    "jaxkv.offload",
    "jaxkv.offload.catalog",
    "jaxkv.offload.policies",
    "jaxkv.serving",
    "jaxkv.serving.scheduler",
    "jaxkv.serving.outputs",
    "jaxkv.serving.input_processor",
    "jaxkv.serving.output_processor",
    "jaxkv.server.openai_api",  # names the result types without loading the engine
    "jaxkv.serving.simulator",
    "jaxkv.serving.stats",
    "jaxkv.serving.metrics",  # an exporter process need not carry JAX
    "jaxkv.serving.request_metrics",
    "jaxkv.cluster",
    "jaxkv.cluster.lockstep",
    "jaxkv.cluster.launcher",
    "jaxkv.fleet",
    "jaxkv.fleet.router",  # a router process need not carry JAX
]


@pytest.mark.subprocess
def test_the_host_side_imports_no_jax():
    code = (
        f"import sys\nfor m in {HOST_MODULES!r}: __import__(m)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def imported_jaxkv_modules(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("jaxkv"):
            names.update([node.module] if node.module != "jaxkv" else (f"jaxkv.{a.name}" for a in node.names))
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("jaxkv"))
    return names


def top_level(path_or_module: str) -> str:
    return path_or_module.split(".")[1]


def every_module():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts == ("__init__",):
            continue
        yield path, parts[0]


def test_every_module_has_a_layer():
    assert {name for _, name in every_module()} <= set(LAYERS)


def test_the_root_keeps_only_the_shared_modules():
    assert sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__") == sorted(SHARED)


@pytest.mark.parametrize("path,name", list(every_module()), ids=lambda v: str(v).split("jaxkv/")[-1])
def test_imports_run_one_way(path, name):
    above = {m for m in imported_jaxkv_modules(path) if m != "jaxkv" and LAYERS[top_level(m)] > LAYERS[name]}
    assert not above, f"{path} imports from a layer above it: {sorted(above)}"


def test_cluster_and_fleet_do_not_import_each_other():
    for path, name in every_module():
        other = {"cluster": "fleet", "fleet": "cluster"}.get(name)
        if other:
            assert not {m for m in imported_jaxkv_modules(path) if top_level(m) == other}, path


@pytest.mark.subprocess
def test_the_host_side_imports_with_jax_absent():
    """A router or scheduler process installs jaxkv without extras: no jax."""
    code = (
        "import importlib.abc, sys\n"
        "class Absent(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('jax', 'jaxlib'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Absent())\n"
        f"for m in {HOST_MODULES!r}: __import__(m)\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.subprocess
def test_the_public_names_come_from_jaxkv_and_only_the_device_ones_load_jax():
    code = (
        "import sys, jaxkv\n"
        "jax = lambda: sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib'))\n"
        "host = [jaxkv.KVCacheManager, jaxkv.Request, jaxkv.plan_kv_cache, jaxkv.get_preset, jaxkv.JaxkvError]\n"
        "print(jax() == [])\n"
        "print(all(getattr(jaxkv, name) is not None for name in jaxkv.__all__), 'jax' in jax())\n"
        "print(jaxkv.device.ops.paged_attention.__module__, jaxkv.Engine.__module__)\n"
        "try:\n    jaxkv.Engin\nexcept AttributeError as err:\n    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == [
        "True",
        "True True",
        "jaxkv.device.ops jaxkv.serving.engine",
        "module 'jaxkv' has no attribute 'Engin'",
    ]


@pytest.mark.subprocess
def test_a_device_name_without_jax_names_the_extra_to_install():
    code = (
        "import jaxkv\n"
        "from jaxkv.errors import ExtraNotInstalledError\n"
        "print(jaxkv.KVCacheManager.__name__)\n"
        "try:\n    jaxkv.Engine\nexcept ExtraNotInstalledError as err:\n    print(err)\n"
    )
    result = run_python_without(("jax", "jaxlib"), code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "KVCacheManager",
        "jaxkv.Engine needs pip install 'jaxkv[serving]' (no module named 'jax')",
    ]
