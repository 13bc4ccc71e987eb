"""The stored oracle (``tests/oracle/``) is what transformers computes: the live comparison,
run where transformers and torch are installed (``pytest -m oracle``, as CI does)."""

from __future__ import annotations

import numpy as np
import pytest
from hf_checkpoints import FAMILIES, Reference, oracle
from safetensors.numpy import load_file

pytestmark = [pytest.mark.oracle, pytest.mark.slow]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOGITS_ATOL = 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_the_stored_logits_and_continuations_are_transformers_own(family):
    stored = oracle.ORACLE_DIR / family
    model = transformers.AutoModelForCausalLM.from_pretrained(stored, attn_implementation="eager").float().eval()
    now = oracle.references(model)
    with np.load(stored / "reference.npz") as npz:
        assert sorted(npz.files) == sorted(now)
        for name, value in now.items():
            if name.startswith(("prompt_", "greedy_", "dense_tokens")):
                assert np.array_equal(npz[name], value), name
            else:
                np.testing.assert_allclose(npz[name], value, atol=LOGITS_ATOL, err_msg=name)
    assert Reference.load(stored / "reference.npz").continuations


@pytest.mark.parametrize("family", FAMILIES)
def test_the_script_regenerates_the_stored_weights(family, tmp_path):
    oracle.save_tiny_checkpoint(family, tmp_path)
    stored, regenerated = (
        load_file(oracle.ORACLE_DIR / family / "model.safetensors"),
        load_file(tmp_path / "model.safetensors"),
    )
    assert stored.keys() == regenerated.keys()
    assert all(np.array_equal(stored[name], regenerated[name]) for name in stored)
