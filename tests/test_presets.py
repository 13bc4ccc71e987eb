"""Presets: real architectures with their public config numbers."""

from collections import Counter

import pytest

from jaxkv.presets import (
    NEMOTRON_H_8B_PATTERN,
    UnknownPresetError,
    gated_delta_net_spec,
    get_preset,
    list_presets,
    mamba1_spec,
    mamba2_spec,
)
from jaxkv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)

REQUIRED = [
    "llama-3.1-8b",
    "gemma-3-27b",
    "gpt-oss-120b",
    "llama-4-scout",
    "deepseek-v3",
    "jamba-1.5-mini",
    "nemotron-h-8b",
    "qwen3-next-80b",
]


def kinds(specs) -> Counter:
    return Counter(type(s).__name__ for s in specs.values())


def layer_indices(specs, cls) -> list[int]:
    return [int(name.split(".")[1]) for name, s in specs.items() if isinstance(s, cls)]


def test_the_required_architectures_are_listed():
    assert set(REQUIRED) <= set(list_presets())
    assert list_presets() == sorted(list_presets())


@pytest.mark.parametrize("name", list_presets())
def test_layer_names_are_in_model_order(name):
    indices = [int(n.removeprefix("layers.")) for n in get_preset(name)]
    assert indices == sorted(indices) and len(set(indices)) == len(indices)


def test_each_call_returns_a_fresh_dict():
    first = get_preset("tiny-hybrid")
    first.clear()
    assert len(get_preset("tiny-hybrid")) == 6


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(UnknownPresetError) as info:
        get_preset("llama-5")
    message = str(info.value)
    assert "'llama-5'" in message
    assert all(name in message for name in REQUIRED)
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_llama_3_1_8b_is_32_full_layers_of_8_heads():
    specs = get_preset("llama-3.1-8b")
    assert kinds(specs) == {"FullAttentionSpec": 32}
    assert set(specs.values()) == {FullAttentionSpec(num_kv_heads=8, head_size=128)}


def test_gemma_3_27b_has_five_local_layers_per_global_one():
    specs = get_preset("gemma-3-27b")
    assert kinds(specs) == {"SlidingWindowSpec": 52, "FullAttentionSpec": 10}
    assert layer_indices(specs, FullAttentionSpec) == list(range(5, 62, 6))
    assert {s.sliding_window for s in specs.values() if isinstance(s, SlidingWindowSpec)} == {1024}
    assert {s.bytes_per_token for s in specs.values()} == {2 * 16 * 128 * 2}


def test_gpt_oss_120b_alternates_sliding_128_and_full():
    specs = get_preset("gpt-oss-120b")
    assert kinds(specs) == {"SlidingWindowSpec": 18, "FullAttentionSpec": 18}
    assert layer_indices(specs, SlidingWindowSpec) == list(range(0, 36, 2))
    assert specs["layers.0"] == SlidingWindowSpec(num_kv_heads=8, head_size=64, sliding_window=128)


def test_llama_4_scout_has_three_chunked_layers_per_global_one():
    specs = get_preset("llama-4-scout")
    assert kinds(specs) == {"ChunkedLocalAttentionSpec": 36, "FullAttentionSpec": 12}
    assert layer_indices(specs, FullAttentionSpec) == list(range(3, 48, 4))
    chunked = {s for s in specs.values() if isinstance(s, ChunkedLocalAttentionSpec)}
    assert {s.attention_chunk_size for s in chunked} == {8192}


def test_deepseek_v3_is_61_mla_layers_of_1152_bytes_per_token():
    specs = get_preset("deepseek-v3")
    assert kinds(specs) == {"MLASpec": 61}
    assert set(specs.values()) == {MLASpec(kv_lora_rank=512, qk_rope_head_dim=64)}
    assert specs["layers.0"].bytes_per_token == 1152


def test_jamba_1_5_mini_has_attention_every_eighth_layer_from_4():
    specs = get_preset("jamba-1.5-mini")
    assert kinds(specs) == {"MambaSpec": 28, "FullAttentionSpec": 4}
    assert layer_indices(specs, FullAttentionSpec) == [4, 12, 20, 28]
    mamba = specs["layers.0"]
    assert mamba.shapes == ((8192, 3), (8192, 16))
    assert mamba.dtypes == ("bfloat16", "float32")
    assert mamba.state_bytes == 573440


def test_nemotron_h_8b_keeps_only_cached_layers_of_its_52():
    assert len(NEMOTRON_H_8B_PATTERN) == 52
    specs = get_preset("nemotron-h-8b")
    assert kinds(specs) == {"MambaSpec": 24, "FullAttentionSpec": 4}
    assert layer_indices(specs, FullAttentionSpec) == [7, 18, 29, 40]
    assert "layers.1" not in specs  # an MLP layer: no cache
    mamba = specs["layers.0"]
    # conv over x, B, C: 8192 + 2 * 8 * 128 channels; SSM (heads, head_dim, d_state).
    assert mamba.shapes == ((10240, 3), (128, 64, 128))
    assert mamba.state_bytes == 10240 * 3 * 2 + 128 * 64 * 128 * 4


def test_qwen3_next_80b_has_three_gated_delta_net_layers_per_full_one():
    specs = get_preset("qwen3-next-80b")
    assert kinds(specs) == {"MambaSpec": 36, "FullAttentionSpec": 12}
    assert layer_indices(specs, FullAttentionSpec) == list(range(3, 48, 4))
    linear = specs["layers.0"]
    assert linear.mamba_type == "gated_delta_net"
    # conv over q, k, v: 2 * 16 * 128 + 32 * 128; recurrent state per V head.
    assert linear.shapes == ((8192, 3), (32, 128, 128))
    assert specs["layers.3"] == FullAttentionSpec(num_kv_heads=2, head_size=256)


def test_state_builders_follow_the_published_formulas():
    assert mamba1_spec(d_inner=16, d_conv=4, d_state=8).shapes == ((16, 3), (16, 8))
    m2 = mamba2_spec(d_inner=64, n_groups=2, d_state=16, n_heads=4, head_dim=16, d_conv=4)
    assert m2.shapes == ((64 + 2 * 2 * 16, 3), (4, 16, 16))
    gdn = gated_delta_net_spec(num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=16, conv_kernel=4)
    assert gdn.shapes == ((2 * 16 + 64, 3), (4, 8, 16))
    assert all(isinstance(s, MambaSpec) for s in (m2, gdn))
