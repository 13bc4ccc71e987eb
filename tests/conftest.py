"""Fixtures shared by every test: deterministic token runs and the seeded random generator
(helpers live in modules of their own: kv_configs.py, paged_batches.py, script_runs.py).

The CPU backend gets 8 devices (tensor-parallel tests build meshes of 1, 2, 4 and 8 of
them); the flag must be set before jax is first imported, hence here, first. Everything
else keeps running on ``jax.devices()[0]``, the default device.
"""

import os
import pathlib

os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()

import secrets

import pytest
from paged_batches import SeededRng


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
