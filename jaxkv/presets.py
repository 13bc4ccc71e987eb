"""Real model architectures as layer specs, from their public HuggingFace configs.

``get_preset(name)`` returns ``{"layers.<i>": spec}`` in model order, one entry per
layer that has a cache (MLP-only layers, as in Nemotron-H, are left out; the index
stays the model's layer index). Specs are unsharded: tensor parallelism divides heads
later, in the device cache.

State dtypes of recurrent layers: the convolution state is bfloat16 and the SSM /
recurrent state is float32 (:data:`CONV_STATE_DTYPE`, :data:`SSM_STATE_DTYPE`). The
SSM state accumulates over the whole sequence, so it is kept in full precision, as
Qwen3.5's config asks (``mamba_ssm_dtype: float32``); vLLM's default would be the
model dtype (bfloat16), which halves the state.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxkv.errors import JaxkvError
from jaxkv.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLASpec,
    SlidingWindowSpec,
)

CONV_STATE_DTYPE = "bfloat16"
SSM_STATE_DTYPE = "float32"


class UnknownPresetError(JaxkvError, KeyError, ValueError):
    """No preset has this name."""

    def __str__(self) -> str:
        return str(self.args[0])


def mamba1_spec(*, d_inner: int, d_conv: int, d_state: int) -> MambaSpec:
    """Mamba-1 layer: conv state (d_inner, d_conv - 1), SSM state (d_inner, d_state)."""
    return MambaSpec(
        shapes=((d_inner, d_conv - 1), (d_inner, d_state)),
        dtypes=(CONV_STATE_DTYPE, SSM_STATE_DTYPE),
        mamba_type="mamba1",
    )


def mamba2_spec(*, d_inner: int, n_groups: int, d_state: int, n_heads: int, head_dim: int, d_conv: int) -> MambaSpec:
    """Mamba-2 layer: conv over x, B and C; SSM state (n_heads, head_dim, d_state)."""
    return MambaSpec(
        shapes=((d_inner + 2 * n_groups * d_state, d_conv - 1), (n_heads, head_dim, d_state)),
        dtypes=(CONV_STATE_DTYPE, SSM_STATE_DTYPE),
        mamba_type="mamba2",
    )


def gated_delta_net_spec(
    *, num_k_heads: int, num_v_heads: int, k_head_dim: int, v_head_dim: int, conv_kernel: int
) -> MambaSpec:
    """Gated delta-net (Qwen3-Next linear attention): conv over q, k, v; state per V head."""
    key_dim = num_k_heads * k_head_dim
    value_dim = num_v_heads * v_head_dim
    return MambaSpec(
        shapes=((2 * key_dim + value_dim, conv_kernel - 1), (num_v_heads, k_head_dim, v_head_dim)),
        dtypes=(CONV_STATE_DTYPE, SSM_STATE_DTYPE),
        mamba_type="gated_delta_net",
    )


def _layers(kinds: list[KVCacheSpec | None]) -> dict[str, KVCacheSpec]:
    return {f"layers.{i}": spec for i, spec in enumerate(kinds) if spec is not None}


def _llama_3_1_8b() -> dict[str, KVCacheSpec]:
    # meta-llama/Llama-3.1-8B: num_hidden_layers 32, num_key_value_heads 8,
    # hidden_size 4096 / num_attention_heads 32 -> head_dim 128.
    return _layers([FullAttentionSpec(num_kv_heads=8, head_size=128)] * 32)


def _gemma_3_27b() -> dict[str, KVCacheSpec]:
    # google/gemma-3-27b text_config: num_hidden_layers 62, num_key_value_heads 16,
    # head_dim 128, sliding_window 1024, sliding_window_pattern 6: layer i is global
    # when (i + 1) % 6 == 0 -> 10 full, 52 sliding.
    full = FullAttentionSpec(num_kv_heads=16, head_size=128)
    local = SlidingWindowSpec(num_kv_heads=16, head_size=128, sliding_window=1024)
    return _layers([full if (i + 1) % 6 == 0 else local for i in range(62)])


def _gpt_oss_120b() -> dict[str, KVCacheSpec]:
    # openai/gpt-oss-120b: num_hidden_layers 36, num_key_value_heads 8, head_dim 64,
    # sliding_window 128, layer_types alternate sliding_attention / full_attention
    # starting with sliding.
    full = FullAttentionSpec(num_kv_heads=8, head_size=64)
    local = SlidingWindowSpec(num_kv_heads=8, head_size=64, sliding_window=128)
    return _layers([local if i % 2 == 0 else full for i in range(36)])


def _llama_4_scout() -> dict[str, KVCacheSpec]:
    # meta-llama/Llama-4-Scout-17B-16E text_config: num_hidden_layers 48,
    # num_key_value_heads 8, head_dim 128, attention_chunk_size 8192,
    # no_rope_layers [1, 1, 1, 0] * 12: the NoPE layers (every 4th) attend globally.
    full = FullAttentionSpec(num_kv_heads=8, head_size=128)
    local = ChunkedLocalAttentionSpec(num_kv_heads=8, head_size=128, attention_chunk_size=8192)
    return _layers([full if (i + 1) % 4 == 0 else local for i in range(48)])


def _deepseek_v3() -> dict[str, KVCacheSpec]:
    # deepseek-ai/DeepSeek-V3: num_hidden_layers 61, kv_lora_rank 512,
    # qk_rope_head_dim 64 -> 576 cached values per token per layer.
    return _layers([MLASpec(kv_lora_rank=512, qk_rope_head_dim=64)] * 61)


def _jamba_1_5_mini() -> dict[str, KVCacheSpec]:
    # ai21labs/AI21-Jamba-1.5-Mini: num_hidden_layers 32, attn_layer_period 8,
    # attn_layer_offset 4 (attention at 4, 12, 20, 28), num_key_value_heads 8,
    # hidden_size 4096 / num_attention_heads 32 -> head_dim 128; Mamba-1 with
    # mamba_expand 2 (d_inner 8192), mamba_d_state 16, mamba_d_conv 4.
    attention = FullAttentionSpec(num_kv_heads=8, head_size=128)
    mamba = mamba1_spec(d_inner=2 * 4096, d_conv=4, d_state=16)
    return _layers([attention if i % 8 == 4 else mamba for i in range(32)])


NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
"""hybrid_override_pattern of nvidia/Nemotron-H-8B-Base-8K: M Mamba-2, * attention, - MLP."""


def _nemotron_h_8b() -> dict[str, KVCacheSpec]:
    # nvidia/Nemotron-H-8B-Base-8K: num_hidden_layers 52 (24 Mamba-2, 24 MLP,
    # 4 attention at 7, 18, 29, 40); num_key_value_heads 8, head_dim 128;
    # hidden_size 4096, expand 2 (d_inner 8192), mamba_num_heads 128,
    # mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv_kernel 4.
    attention = FullAttentionSpec(num_kv_heads=8, head_size=128)
    mamba = mamba2_spec(d_inner=2 * 4096, n_groups=8, d_state=128, n_heads=128, head_dim=64, d_conv=4)
    by_char: dict[str, KVCacheSpec | None] = {"M": mamba, "*": attention, "-": None}
    return _layers([by_char[c] for c in NEMOTRON_H_8B_PATTERN])


def _qwen3_next_80b() -> dict[str, KVCacheSpec]:
    # Qwen/Qwen3-Next-80B-A3B: num_hidden_layers 48, full_attention_interval 4
    # (layer i is full when (i + 1) % 4 == 0); full attention num_key_value_heads 2,
    # head_dim 256; linear attention linear_num_key_heads 16, linear_num_value_heads
    # 32, linear_key_head_dim 128, linear_value_head_dim 128, linear_conv_kernel_dim 4.
    full = FullAttentionSpec(num_kv_heads=2, head_size=256)
    linear = gated_delta_net_spec(num_k_heads=16, num_v_heads=32, k_head_dim=128, v_head_dim=128, conv_kernel=4)
    return _layers([full if (i + 1) % 4 == 0 else linear for i in range(48)])


def _tiny_hybrid() -> dict[str, KVCacheSpec]:
    # Test/demo model: 5 sliding (window 32) : 1 full, 2 KV heads of 64, float32.
    full = FullAttentionSpec(num_kv_heads=2, head_size=64, dtype="float32")
    local = SlidingWindowSpec(num_kv_heads=2, head_size=64, dtype="float32", sliding_window=32)
    return _layers([full if (i + 1) % 6 == 0 else local for i in range(6)])


def _tiny_mamba_hybrid() -> dict[str, KVCacheSpec]:
    # Test/demo model: 3 Mamba-2 : 1 full attention, 8 layers. Attention pages are
    # 4 KiB at block 16 and the state is 4.6 KiB, so blocks grow to 32 tokens and
    # states are padded.
    attention = FullAttentionSpec(num_kv_heads=2, head_size=16, dtype="float32")
    mamba = mamba2_spec(d_inner=64, n_groups=1, d_state=16, n_heads=4, head_dim=16, d_conv=4)
    return _layers([attention if (i + 1) % 4 == 0 else mamba for i in range(8)])


_PRESETS: dict[str, Callable[[], dict[str, KVCacheSpec]]] = {
    "llama-3.1-8b": _llama_3_1_8b,
    "gemma-3-27b": _gemma_3_27b,
    "gpt-oss-120b": _gpt_oss_120b,
    "llama-4-scout": _llama_4_scout,
    "deepseek-v3": _deepseek_v3,
    "jamba-1.5-mini": _jamba_1_5_mini,
    "nemotron-h-8b": _nemotron_h_8b,
    "qwen3-next-80b": _qwen3_next_80b,
    "tiny-hybrid": _tiny_hybrid,
    "tiny-mamba-hybrid": _tiny_mamba_hybrid,
}


def list_presets() -> list[str]:
    """Names accepted by :func:`get_preset`, sorted."""
    return sorted(_PRESETS)


def get_preset(name: str) -> dict[str, KVCacheSpec]:
    """A fresh ``{layer_name: spec}`` dict for the named architecture, in model order."""
    try:
        build = _PRESETS[name]
    except (KeyError, TypeError):
        raise UnknownPresetError(f"unknown preset {name!r}; valid presets: {', '.join(list_presets())}") from None
    return build()
