"""The model a tool serves, from ``--checkpoint`` or ``--model``, and what it prints about it."""

import pytest
from hf_checkpoints import save_tiny_checkpoint

from jaxkv.models.checkpoint import ContextLengthError
from jaxkv.models.loading import load_model
from jaxkv.models.tiny import TinyLM


def test_a_named_tiny_model_is_seeded_and_named_as_asked():
    loaded = load_model(None, "tiny-qwen3-next", dtype="bfloat16", seed=3)
    assert isinstance(loaded.model, TinyLM) and loaded.name == "tiny-qwen3-next"
    assert loaded.attention_dtype == "bfloat16", "the attention KV's dtype, not the recurrent states' float32"
    other_seed = load_model(None, "tiny-qwen3-next", dtype="bfloat16", seed=4).model
    assert not (other_seed.params["embed_tokens.weight"] == loaded.model.params["embed_tokens.weight"]).all()


def test_a_checkpoint_wins_over_the_model_name_and_names_its_architecture(tmp_path):
    save_tiny_checkpoint("llama", tmp_path)
    loaded = load_model(str(tmp_path), "tiny-hybrid", dtype=None, seed=0)
    assert loaded.name == f"{tmp_path}: {loaded.model.name}" and not isinstance(loaded.model, TinyLM)
    assert loaded.attention_dtype == "float32"


def test_a_checkpoint_is_refused_past_its_positions(tmp_path):
    save_tiny_checkpoint("qwen3", tmp_path)  # max_position_embeddings 512
    with pytest.raises(ContextLengthError, match="max_model_len=513"):
        load_model(str(tmp_path), "tiny-hybrid", dtype=None, seed=0, max_model_len=513)
