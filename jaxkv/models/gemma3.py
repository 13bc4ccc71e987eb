"""Gemma-3 text (``Gemma3ForCausalLM``) from a Hugging Face config: :class:`~jaxkv.models.llama.Llama`
with Gemma's differences.

- sliding-window and full attention layers as the config's ``layer_types`` says (5 : 1
  in the released models; configs without it: every ``sliding_window_pattern``-th layer
  full), each kind with its own ``rope_parameters`` (local and global RoPE bases; the
  global one may be ``linear``-scaled);
- RMSNorms scaled by ``1 + weight`` (float32), on q and k per head as well, and
  post-norms after attention and after the MLP besides the pre-norms;
- embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the weights' dtype);
- attention scaled by ``query_pre_attn_scalar ** -0.5``; the final logits soft-capped
  when ``final_logit_softcapping`` is set; tied embeddings by default.

``attn_logit_softcapping`` is not applied, as in transformers' Gemma-3 (the field is in
the config, a Gemma-2 leftover, but its attention never reads it; the released configs
set it to null).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.models import layers
from jaxkv.models.layers import AttentionShape, UnsupportedConfigError
from jaxkv.models.llama import FULL, SLIDING, Llama, Params, legacy_rope_parameters

HUB_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131_072,
    "sliding_window": 4096,
}
"""transformers' ``Gemma3TextConfig`` defaults of fields the Hub's multimodal configs leave
out of ``text_config`` (``google/gemma-3-4b-it`` names only the sizes that differ)."""


class Gemma3(Llama):
    """A Gemma-3 text decoder; weights and cache names as :class:`~jaxkv.models.llama.Llama`'s."""

    qk_norm = True
    unit_offset_norms = True
    post_norms = True

    def __init__(self, config: Mapping[str, Any], dtype: Any) -> None:
        config = {"tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh", **HUB_TEXT_DEFAULTS, **config}
        if not config.get("layer_types") and "num_hidden_layers" in config:
            pattern = config.get("sliding_window_pattern", 6)
            config["layer_types"] = [SLIDING if (i + 1) % pattern else FULL for i in range(config["num_hidden_layers"])]
        if config.get("use_bidirectional_attention"):
            raise UnsupportedConfigError("Gemma-3 with use_bidirectional_attention=true (an encoder) is not built")
        super().__init__(config, dtype)

    def rope_parameters(self, layer_type: str) -> Mapping[str, Any]:
        """Each layer kind's own ``rope_parameters`` (local and global bases); from a config
        saved before transformers 5 (the Hub's), ``rope_theta`` with ``rope_scaling`` for the
        global layers and ``rope_local_base_freq`` for the local ones."""
        c = self.config
        parameters = c.get("rope_parameters") or {
            FULL: legacy_rope_parameters(c, 1_000_000.0),
            SLIDING: {"rope_type": "default", "rope_theta": c.get("rope_local_base_freq", 10_000.0)},
        }
        if layer_type not in parameters:
            raise UnsupportedConfigError(
                f"rope_parameters has no entry for {layer_type!r} (it needs {SLIDING!r} and {FULL!r})"
            )
        return parameters[layer_type]

    def attention_shape(self, index: int) -> AttentionShape:
        c = self.config
        window = c["sliding_window"] if self.layer_types[index] == SLIDING else None
        scale = c.get("query_pre_attn_scalar", self.head_dim) ** -0.5
        return AttentionShape(self.num_heads, self.num_kv_heads, self.head_dim, scale, window)

    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        table = params["model.embed_tokens.weight"]
        return table[tokens] * jnp.asarray(self.hidden_size**0.5, table.dtype)

    def logits(self, params: Params, x: jax.Array) -> jax.Array:
        return layers.soft_cap(super().logits(params, x), self.config.get("final_logit_softcapping"))
