"""Checkpoint directories written with json and safetensors alone (no torch): random
weights of the shapes a config implies, for the loader's checks and refusals."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from jaxkv.models.checkpoint import builder_of, language_model_config

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
    "max_position_embeddings": 128,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0},
    "tie_word_embeddings": False,
}


def random_weights(config: Mapping[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights of every tensor ``config``'s model reads, by jaxkv's names."""
    model = builder_of(config)(language_model_config(config), "float32")
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0, 0.1, shape).astype(np.float32) for name, shape in model.tensor_shapes().items()}


def write_checkpoint(
    directory: Path,
    config: Mapping[str, Any] = TINY_LLAMA,
    weights: Mapping[str, np.ndarray] | None = None,
    *,
    rename: Callable[[str], str] = lambda name: name,
) -> dict[str, np.ndarray]:
    """Write ``config.json`` and one ``model.safetensors`` of ``weights`` (random ones by
    default) under their names ``rename`` d; returns the weights by jaxkv's names."""
    weights = dict(weights if weights is not None else random_weights(config))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({rename(name): value for name, value in weights.items()}, str(directory / "model.safetensors"))
    return weights
