"""Tiny random Hugging Face checkpoints and transformers' logits: the oracle of the model tests.

The checkpoints are those of ``scripts/save_tiny_checkpoint.py`` (one home for their
configs); tests that use this module skip without transformers and torch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "save_tiny_checkpoint.py"
_spec = importlib.util.spec_from_file_location("save_tiny_checkpoint", _SCRIPT)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

FAMILIES: tuple[str, ...] = tiny.FAMILIES
WINDOW: int = tiny.WINDOW
save_tiny_checkpoint = tiny.save_tiny_checkpoint


def hf_logits(model: Any, tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits ``(L, vocab)`` of one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


DENSE_ATOL = 1e-4
"""Float32 logits of jaxkv's dense forward against transformers' (max seen: ~4e-6)."""


def dense_difference(family: str, directory: Path, length: int = 40, seed: int = 0) -> float:
    """Save a tiny ``family`` checkpoint to ``directory``, load it with jaxkv, and return the
    largest difference between jaxkv's dense logits and transformers' over a random sequence."""
    import jax.numpy as jnp

    from jaxkv.models.checkpoint import load_pretrained

    hf = save_tiny_checkpoint(family, directory)
    model = load_pretrained(directory)
    tokens = np.random.default_rng(seed).integers(0, model.vocab_size, length).tolist()
    ours = np.asarray(model.dense(model.params, jnp.asarray([tokens]))[0])
    return float(np.abs(ours - hf_logits(hf, tokens)).max())
