"""Fixtures shared by every test: deterministic token runs and the seeded random generator
(helpers live in modules of their own: kv_configs.py, paged_batches.py, script_runs.py).

The CPU backend gets 8 devices (tensor-parallel tests build meshes of 1, 2, 4 and 8 of
them); the flag must be set before jax is first imported, hence here, first. Everything
else keeps running on ``jax.devices()[0]``, the default device. The README's command runs
the suite in two pytest-xdist workers (whole files each: module fixtures build once); on an
accelerator they share it, so a worker does not preallocate most of its memory.
"""

import gc
import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
if "PYTEST_XDIST_WORKER" in os.environ:  # workers share one accelerator: none may take most of its memory
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import secrets

import pytest
from paged_batches import SeededRng

MEMORY_MAPS_BEFORE_CLEARING = 30_000
"""XLA's CPU backend maps ~1,200 memory regions for one engine's compiled programs and keeps
them while JAX's caches hold the programs; past ``vm.max_map_count`` (65,530 by default)
the next compile segfaults, so a whole run in one process must release them now and then."""


def _num_memory_maps() -> int:
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:  # no procfs: nothing to count
        return 0


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """After a test that leaves many memory maps behind, clear JAX's caches (the tests'
    engines are gone; the next test compiles what it needs)."""
    yield
    if "jax" in sys.modules and _num_memory_maps() > MEMORY_MAPS_BEFORE_CLEARING:
        sys.modules["jax"].clear_caches()
        gc.collect()


@pytest.fixture
def tokens():
    """Deterministic distinct token runs: tokens(start, n)."""
    return lambda start, n: list(range(start, start + n))


@pytest.fixture
def rng() -> SeededRng:
    """Fresh random inputs for every case (JAXKV_TEST_SEED replays one)."""
    return SeededRng(int(os.environ.get("JAXKV_TEST_SEED", secrets.randbits(32))))


MEASURED_SLOW = frozenset(
    line.strip()
    for line in (pathlib.Path(__file__).parent / "slow_tests.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
)
"""Tests measured at 1 s or more without a marker of their own (``slow_tests.txt``)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid in MEASURED_SLOW:
            item.add_marker(pytest.mark.slow)
