"""The device side refuses a jax outside the tested range (and names the extra to install
when jax is missing), and pyproject states the same range."""

import pathlib
import tomllib

import pytest
from script_runs import run_python_without

from jaxkv.device import jax_support
from jaxkv.device.jax_support import UnsupportedJaxError, check_jax_version, release
from jaxkv.errors import JaxkvError

PYPROJECT = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"


def test_release_reads_plain_and_pre_release_versions():
    assert release("0.10.2") == (0, 10, 2)
    assert release("0.11.0rc1") == (0, 11, 0)
    assert release("0.11.2.dev20260101")[:3] == (0, 11, 2)


@pytest.mark.parametrize("version", ["0.10.2", "0.10.9", "0.11.0", "0.11.2"])
def test_tested_versions_pass(version, monkeypatch):
    monkeypatch.delenv(jax_support.ALLOW_UNTESTED_ENV, raising=False)
    check_jax_version(version)


@pytest.mark.parametrize("version", ["0.4.38", "0.10.1", "0.12.0", "1.0.0", "not-a-version"])
def test_untested_versions_are_refused_by_name(version, monkeypatch):
    monkeypatch.delenv(jax_support.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedJaxError, match="jax") as info:
        check_jax_version(version)
    assert version in str(info.value)
    assert isinstance(info.value, JaxkvError) and isinstance(info.value, ImportError)


def test_the_escape_hatch_lets_an_untested_version_through(monkeypatch):
    monkeypatch.setenv(jax_support.ALLOW_UNTESTED_ENV, "1")
    check_jax_version("0.12.0")


def test_pyproject_states_the_range_the_check_enforces():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    oldest = ".".join(map(str, jax_support.OLDEST_JAX))
    first_untested = ".".join(map(str, jax_support.FIRST_UNTESTED_JAX))
    for extra, package in (("device", "jax"), ("cuda", "jax[cuda12]"), ("tpu", "jax[tpu]")):
        assert extras[extra] == [f"{package}>={oldest},<{first_untested}"]


@pytest.mark.subprocess
@pytest.mark.parametrize("module", ["jaxkv.device", "jaxkv.device.cache", "jaxkv.device.ops", "jaxkv.pallas.reference"])
def test_without_jax_the_device_side_names_the_extra_to_install(module):
    code = (
        "from jaxkv.errors import ExtraNotInstalledError\n"
        f"try:\n    import {module}\n"
        "except ExtraNotInstalledError as err:\n"
        "    print(isinstance(err, ImportError), err.name)\n    print(err)\n"
    )
    result = run_python_without(("jax", "jaxlib"), code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "True jax",
        f"{jax_support.JAX_MISSING} (no module named 'jax')",
    ]
