"""Qwen3-Next (Gated DeltaNet : gated full attention, partial rotary, MoE with a shared
expert) against transformers on a tiny random checkpoint."""

from __future__ import annotations

import pytest
from hf_checkpoints import ENGINE_ATOL, dense_difference, serve_against_transformers

from jaxkv.device.mesh import model_mesh
from jaxkv.models.checkpoint import load_pretrained
from jaxkv.models.layers import UnsupportedConfigError
from jaxkv.models.qwen3_next import Qwen3Next
from jaxkv.presets import get_preset

DENSE_ATOL = 1e-4
"""Float32 logits of the dense forward against transformers' (max seen: 2e-5; transformers
runs the delta rule in its chunked form, jaxkv as a scan)."""

QWEN3_NEXT_80B = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
}
"""The parts of Qwen/Qwen3-Next-80B-A3B-Instruct's config.json that shape its cache."""


def test_dense_logits_match_transformers_with_the_experts_stacked_on_load(tmp_path):
    assert dense_difference("qwen3_next", tmp_path) < DENSE_ATOL
    model = load_pretrained(tmp_path)
    assert not [name for name in model.params if ".experts.0." in name]
    assert model.partition_specs().keys() == model.params.keys()


@pytest.mark.slow
def test_served_logits_match_transformers_and_a_second_pass_hits_on_a_2_device_mesh(tmp_path):
    run = serve_against_transformers("qwen3_next", tmp_path, memory_bytes=8 << 20, mesh=model_mesh(2))
    assert run["max_abs_diff"] < ENGINE_ATOL
    assert run["cached"][0] < run["cached"][1]  # the second pass resumes from 16-token state checkpoints


def test_the_80b_config_declares_the_cache_of_the_preset():
    specs = Qwen3Next(QWEN3_NEXT_80B, "bfloat16").layer_specs()
    preset = get_preset("qwen3-next-80b")
    assert list(specs.values()) == list(preset.values())
    assert Qwen3Next(QWEN3_NEXT_80B, "bfloat16").rope.rotary_dim == 64


def test_an_unknown_layer_type_is_refused_by_name():
    with pytest.raises(UnsupportedConfigError, match="sliding_attention"):
        Qwen3Next({**QWEN3_NEXT_80B, "num_hidden_layers": 1, "layer_types": ["sliding_attention"]}, "float32")
