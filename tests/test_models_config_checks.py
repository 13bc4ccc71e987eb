"""A checkpoint's config, dtype and max_model_len checked before anything is built, and
its weights as they are read: every refusal typed and named (no torch needed)."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic_checkpoints import TINY_LLAMA, random_weights, write_checkpoint

from jaxkv.errors import JaxkvError
from jaxkv.models.checkpoint import BadWeightsError, CheckpointError, ContextLengthError, load_pretrained
from jaxkv.models.config_checks import check_max_model_len, max_positions


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY_LLAMA)


def _with_config(directory, weights, **changes):
    write_checkpoint(directory, {**TINY_LLAMA, **changes}, weights)
    return directory


def test_a_billion_layers_is_refused_by_name_before_anything_is_built(tmp_path, weights):
    with pytest.raises(CheckpointError, match=r"num_hidden_layers=1000000000 must be a positive int <= 4,096"):
        load_pretrained(_with_config(tmp_path, weights, num_hidden_layers=1_000_000_000))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_attention_heads", 0),
        ("hidden_size", -16),
        ("vocab_size", "64"),
        ("head_dim", True),
        ("intermediate_size", 3.5),
    ],
)
def test_a_size_that_is_not_a_positive_int_is_named(tmp_path, weights, field, value):
    with pytest.raises(CheckpointError, match=rf"{field}={value!r}"):
        load_pretrained(_with_config(tmp_path, weights, **{field: value}))


@pytest.mark.parametrize("dtype", ["int8", "bool", "foo", "uint32", "complex64"])
def test_only_a_float_dtype_is_accepted(tmp_path, weights, dtype):
    with pytest.raises(CheckpointError, match=rf"dtype '{dtype}' is not a float dtype"):
        load_pretrained(_with_config(tmp_path, weights), dtype=dtype)


def test_a_float_dtype_casts(tmp_path, weights):
    model = load_pretrained(_with_config(tmp_path, weights), dtype="float16")
    assert {v.dtype.name for v in model.params.values()} == {"float16"}


def test_max_model_len_beyond_max_position_embeddings_is_refused_by_name(tmp_path, weights):
    directory = _with_config(tmp_path, weights)
    assert load_pretrained(directory, max_model_len=128).num_layers == 2
    with pytest.raises(ContextLengthError, match=r"max_model_len=129 exceeds the 128 positions"):
        load_pretrained(directory, max_model_len=129)


def test_a_rope_scaling_that_stretches_the_original_length_extends_the_limit():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    assert max_positions({"max_position_embeddings": 8192, "rope_parameters": llama3}) == 65_536
    assert max_positions({"max_position_embeddings": 131_072, "rope_parameters": llama3}) == 131_072
    gemma = {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "linear", "factor": 8.0}}
    assert max_positions({"max_position_embeddings": 4096, "rope_parameters": gemma}) == 4096, "no original length"
    assert max_positions({"text_config": {"max_position_embeddings": 32}}) == 32
    assert max_positions({}) is None
    check_max_model_len({"max_position_embeddings": 8192, "rope_scaling": llama3}, 65_536)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_weights_are_refused_naming_the_tensor(tmp_path, weights, bad):
    broken = {**weights, "model.layers.1.mlp.up_proj.weight": weights["model.layers.1.mlp.up_proj.weight"].copy()}
    broken["model.layers.1.mlp.up_proj.weight"][3, 5] = bad
    write_checkpoint(tmp_path, TINY_LLAMA, broken)
    with pytest.raises(BadWeightsError, match=r"model.safetensors: tensor 'model.layers.1.mlp.up_proj.weight' holds"):
        load_pretrained(tmp_path)


def test_a_weight_that_overflows_the_cast_is_refused(tmp_path, weights):
    broken = {**weights, "model.norm.weight": np.full(16, 1e6, np.float32)}
    write_checkpoint(tmp_path, TINY_LLAMA, broken)
    with pytest.raises(BadWeightsError, match=r"'model.norm.weight' holds NaN or Inf \(as float16\)"):
        load_pretrained(tmp_path, dtype="float16")


_ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.integers(1 << 30, 1 << 40),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(0, 3), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
    # (deeper nesting than the decoder recursion allows: test_models_checkpoint_files)
    st.integers(1, 8).map(lambda depth: json.loads("[" * depth * 50 + "]" * depth * 50)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(sorted(TINY_LLAMA)), st.one_of(st.just("<delete>"), _ODD_VALUES)), max_size=3
    )
)
def test_a_mutated_config_loads_or_is_refused_with_a_typed_error(tmp_path_factory, weights, edits):
    config = dict(TINY_LLAMA)
    for field, value in edits:
        if value == "<delete>":
            config.pop(field, None)
        else:
            config[field] = value
    directory = tmp_path_factory.mktemp("mutated")
    write_checkpoint(directory, TINY_LLAMA, weights)
    (directory / "config.json").write_text(json.dumps(config))
    with contextlib.suppress(JaxkvError):  # any other exception fails the test
        load_pretrained(directory, max_model_len=64)
