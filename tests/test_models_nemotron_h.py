"""Nemotron-H (Mamba-2, attention, MLP and MoE blocks in its pattern) against transformers
on a tiny random checkpoint."""

from __future__ import annotations

import pytest
from hf_checkpoints import ENGINE_ATOL, dense_difference, serve_against_transformers

from jaxkv.device.mesh import model_mesh
from jaxkv.models.checkpoint import load_pretrained
from jaxkv.models.layers import UnsupportedConfigError
from jaxkv.models.nemotron_h import NemotronH
from jaxkv.presets import NEMOTRON_H_8B_PATTERN, get_preset

DENSE_ATOL = 1e-4
"""Float32 logits of the dense forward against transformers' (max seen: 3e-6; transformers
runs the SSD in its chunked form, jaxkv as a scan)."""

NEMOTRON_H_8B = {
    "vocab_size": 131072,
    "hidden_size": 4096,
    "hybrid_override_pattern": NEMOTRON_H_8B_PATTERN,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 21504,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "n_groups": 8,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "time_step_limit": [0.0, float("inf")],
}
"""The parts of nvidia/Nemotron-H-8B-Base-8K's config.json that shape its cache (the Hub
file's pattern string, not transformers' saved ``layers_block_type``)."""


def test_dense_logits_match_transformers_with_the_experts_stacked_on_load(tmp_path):
    assert dense_difference("nemotron_h", tmp_path) < DENSE_ATOL
    model = load_pretrained(tmp_path)
    assert not [name for name in model.params if ".experts.0." in name]
    assert model.partition_specs().keys() == model.params.keys()


@pytest.mark.slow
def test_served_logits_match_transformers_and_a_second_pass_hits_on_a_2_device_mesh(tmp_path):
    run = serve_against_transformers("nemotron_h", tmp_path, memory_bytes=8 << 20, mesh=model_mesh(2))
    assert run["max_abs_diff"] < ENGINE_ATOL
    assert run["cached"][0] < run["cached"][1]  # the second pass resumes from 16-token state checkpoints


def test_the_8b_config_declares_the_cache_of_the_preset_and_mlp_blocks_hold_none():
    specs = NemotronH(NEMOTRON_H_8B, "bfloat16").layer_specs()
    preset = get_preset("nemotron-h-8b")
    assert [name.removeprefix("backbone.") for name in specs] == list(preset)
    assert list(specs.values()) == list(preset.values())


def test_an_unknown_block_type_or_a_sliding_window_is_refused_by_name():
    with pytest.raises(UnsupportedConfigError, match="'X'"):
        NemotronH({**NEMOTRON_H_8B, "hybrid_override_pattern": "M*X"}, "float32")
    with pytest.raises(UnsupportedConfigError, match="sliding_window=1024"):
        NemotronH({**NEMOTRON_H_8B, "sliding_window": 1024}, "float32")
