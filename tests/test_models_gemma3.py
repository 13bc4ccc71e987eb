"""Gemma-3 text against transformers on a tiny random checkpoint (5 local : 1 global, window 8)."""

from __future__ import annotations

import numpy as np
import pytest
from hf_checkpoints import DENSE_ATOL, ENGINE_ATOL, WINDOW, dense_difference, serve_against_transformers
from synthetic_checkpoints import write_checkpoint

from jaxkv.device.mesh import model_mesh
from jaxkv.models.checkpoint import load_pretrained
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


def _multimodal(text_config):
    """A ``Gemma3ForConditionalGeneration`` config around ``text_config`` (vision sizes unread)."""
    vision = {"hidden_size": 32, "num_hidden_layers": 1, "image_size": 28, "patch_size": 14}
    return {"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text_config, "vision_config": vision}


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_a_multimodal_checkpoint_serves_its_language_model_as_the_text_only_one(tmp_path, prefix):
    text = _config(vocab_size=64, max_position_embeddings=256)
    weights = write_checkpoint(tmp_path / "text", text)
    vision_tower = {"vision_tower.encoder.layers.0.mlp.fc1.weight": np.ones((4, 4), np.float32)}
    write_checkpoint(
        tmp_path / "mm",
        _multimodal({k: v for k, v in text.items() if k != "architectures"}),
        weights | vision_tower,
        rename=lambda name: prefix + name.removeprefix("model.") if name.startswith("model.") else name,
    )
    alone, inside = load_pretrained(tmp_path / "text"), load_pretrained(tmp_path / "mm", max_model_len=256)
    assert inside.name == alone.name and not any(n.startswith("vision_tower") for n in inside.params)
    tokens = np.random.default_rng(0).integers(0, 64, (1, 20))
    assert np.array_equal(
        np.asarray(inside.dense(inside.params, tokens)), np.asarray(alone.dense(alone.params, tokens))
    )


def test_a_hub_text_config_naming_only_some_sizes_takes_transformers_defaults():
    hub = {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "sliding_window": 1024}
    model = Gemma3({**hub, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}, "bfloat16")
    assert (model.num_heads, model.num_kv_heads, model.head_dim, model.vocab_size) == (8, 4, 256, 262_208)
    assert model.attention_shape(0).window == 1024 and model.attention_shape(5).window is None


@pytest.mark.oracle
@pytest.mark.slow
def test_a_multimodal_checkpoint_saved_by_transformers_matches_its_logits(tmp_path):
    """transformers' ``Gemma3ForConditionalGeneration`` (saved with its vision tower) against
    jaxkv's text model; its forward does not soft-cap the final logits, so the tiny text
    config sets ``final_logit_softcapping`` to null, as the released configs do."""
    import torch
    import transformers
    from hf_checkpoints import hf_logits, tiny

    torch.manual_seed(0)
    text = tiny.tiny_config("gemma3")
    text.final_logit_softcapping = None
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = transformers.Gemma3Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4
    )
    config._attn_implementation = "eager"
    hf = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for name, tensor in hf.named_parameters():
            tensor.copy_(torch.randn_like(tensor) * (0.3 if "norm" in name else 0.1))
    hf = hf.float().eval()
    hf.save_pretrained(str(tmp_path))
    model = load_pretrained(tmp_path)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, 5 * WINDOW).tolist()
    ours = np.asarray(model.dense(model.params, np.asarray([tokens]))[0])
    assert np.abs(ours - hf_logits(hf, tokens)).max() < DENSE_ATOL
