"""Llama (Llama-3 RoPE scaling) and Qwen3 (q/k norm) against transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
from hf_checkpoints import DENSE_ATOL, ENGINE_ATOL, dense_difference, serve_against_transformers

from jaxkv.device.mesh import model_mesh
from jaxkv.models.layers import Rope, UnsupportedConfigError
from jaxkv.models.llama import Llama


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_dense_logits_match_transformers(family, tmp_path):
    assert dense_difference(family, tmp_path) < DENSE_ATOL


def test_llama3_scaling_keeps_short_wavelengths_divides_long_ones_and_blends_between():
    parameters = {"rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    plain = Rope.from_config({"rope_type": "default", **parameters}, 16).inv_freq
    scaled = Rope.from_config({"rope_type": "llama3", "original_max_position_embeddings": 64, **parameters}, 16)
    ratios = [s / p for s, p in zip(scaled.inv_freq, plain, strict=True)]
    assert ratios[0] == 1.0 and ratios[-1] == pytest.approx(1 / 8)
    assert any(1 / 8 < r < 1 for r in ratios)


def test_an_unbuilt_rope_type_is_refused_by_name():
    with pytest.raises(UnsupportedConfigError, match="yarn"):
        Rope.from_config({"rope_type": "yarn", "rope_theta": 1e4}, 16)


def test_layer_types_mark_sliding_layers_in_the_cache_specs():
    config = {
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "sliding_window": 4,
        "layer_types": ["full_attention", "sliding_attention"],
    }
    specs = Llama(config, "float32").layer_specs()
    assert [getattr(s, "sliding_window", None) for s in specs.values()] == [None, 4]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_on_a_two_device_mesh_matches_transformers(family, tmp_path):
    seen = serve_against_transformers(family, tmp_path, memory_bytes=1 << 20, mesh=model_mesh(2))
    assert seen["max_abs_diff"] < ENGINE_ATOL
    assert seen["cached"][1] > seen["cached"][0] > 0


def test_a_hub_config_with_rope_scaling_gets_the_same_rope_as_rope_parameters():
    scaling = {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    sizes = {
        "vocab_size": 32,
        "hidden_size": 128,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    hub = Llama({**sizes, "rope_theta": 500_000.0, "rope_scaling": {"rope_type": "llama3", **scaling}}, "float32")
    saved = Llama({**sizes, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500_000.0, **scaling}}, "float32")
    assert hub.rope(0) == saved.rope(0) != Llama({**sizes, "rope_theta": 500_000.0}, "float32").rope(0)
