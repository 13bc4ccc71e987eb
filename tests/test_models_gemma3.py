"""Gemma-3 text against transformers on a tiny random checkpoint (5 local : 1 global, window 8)."""

from __future__ import annotations

import pytest
from hf_checkpoints import DENSE_ATOL, ENGINE_ATOL, dense_difference, host_tier, serve_against_transformers

from jaxkv.device.mesh import model_mesh
from jaxkv.models.gemma3 import Gemma3
from jaxkv.models.layers import UnsupportedConfigError
from jaxkv.specs import FullAttentionSpec, SlidingWindowSpec


def test_dense_logits_match_transformers_past_the_window(tmp_path):
    assert dense_difference("gemma3", tmp_path) < DENSE_ATOL


def _config(**overrides):
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 6,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "sliding_window": 4,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
        **overrides,
    }


def test_layer_types_give_five_windowed_layers_to_one_full():
    specs = list(Gemma3(_config(), "bfloat16").layer_specs().values())
    assert specs[:5] == [SlidingWindowSpec(num_kv_heads=1, head_size=8, dtype="bfloat16", sliding_window=4)] * 5
    assert specs[5] == FullAttentionSpec(num_kv_heads=1, head_size=8, dtype="bfloat16")


def test_tied_embeddings_mean_no_lm_head_tensor():
    assert "lm_head.weight" not in Gemma3(_config(), "float32").tensor_shapes()


def test_a_layer_type_without_rope_parameters_is_refused():
    model = Gemma3(_config(rope_parameters={"full_attention": {"rope_theta": 1e6}}), "float32")
    with pytest.raises(UnsupportedConfigError, match="sliding_attention"):
        model.rope(0)


@pytest.mark.slow
def test_engine_matches_transformers_through_prefix_hits_preemption_and_the_host_tier(tmp_path):
    seen = serve_against_transformers("gemma3", tmp_path, memory_bytes=205_000, offload=host_tier())
    assert seen["max_abs_diff"] < ENGINE_ATOL
    assert seen["cached"][1] > seen["cached"][0] > 0
    assert seen["preemptions"] > 0 and seen["host_loaded_tokens"] > 0


@pytest.mark.slow
def test_engine_on_a_two_device_mesh_matches_transformers(tmp_path):
    seen = serve_against_transformers("gemma3", tmp_path, memory_bytes=1 << 20, mesh=model_mesh(2))
    assert seen["max_abs_diff"] < ENGINE_ATOL
    assert seen["cached"][1] > seen["cached"][0] > 0


def test_a_hub_config_without_layer_types_or_rope_parameters_reads_the_older_fields():
    hub = _config(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
    del hub["layer_types"], hub["rope_parameters"]
    saved = _config()
    saved["rope_parameters"]["full_attention"] = {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}
    hub_model, saved_model = Gemma3(hub, "float32"), Gemma3(saved, "float32")
    assert hub_model.layer_specs() == saved_model.layer_specs()
    assert [hub_model.rope(i) for i in range(6)] == [saved_model.rope(i) for i in range(6)]
