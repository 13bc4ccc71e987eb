"""The runnable examples run as a user runs them and show what they claim."""

import re

import pytest
from script_runs import run_script

pytestmark = pytest.mark.subprocess  # the examples run as scripts


def test_own_model_is_served_with_prefix_hits_preemption_and_the_host_tier_and_matches_its_dense_forward():
    done = run_script("own_model.py", folder="examples")
    assert done.returncode == 0, done.stderr
    preemptions, cached, loaded = map(
        int, re.search(r"preemptions (\d+), cached (\d+), loaded from host (\d+)", done.stdout).groups()
    )
    assert preemptions > 0 and cached > 0 and loaded > 0, done.stdout
    assert "tokens identical to the dense forward: yes" in done.stdout
