"""Llama (Llama-3 RoPE scaling included) and Qwen3 (q/k norm) decoders from Hugging Face configs.

A model holds its config and its weights, a flat dict keyed by the checkpoint's own
tensor names (``model.layers.0.self_attn.q_proj.weight``...), so loading is a table
(:mod:`jaxkv.models.checkpoint`) and the forward reads the names it needs. Two
forwards over the same weights:

- :meth:`Llama.forward`: one step over a ragged batch against the paged KV cache, each
  layer writing its K/V and attending through it (:func:`jaxkv.models.layers.paged_attention`;
  the window comes from the cache's spec of the layer);
- :meth:`Llama.dense`: whole sequences without a cache, the oracle of the paged path.

Layer ``i`` holds cache under the name ``model.layers.<i>``. A layer listed as
``sliding_attention`` in the config's ``layer_types`` (Qwen3 with ``use_sliding_window``)
is a :class:`~jaxkv.specs.SlidingWindowSpec` of ``sliding_window`` tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxkv.device.cache import KVCache
from jaxkv.device.mesh import MODEL_AXIS
from jaxkv.device.metadata import StepMetadata
from jaxkv.models import layers
from jaxkv.models.layers import AttentionShape, Rope, UnsupportedConfigError
from jaxkv.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec

Params = dict[str, jax.Array]
Attend = Callable[[int, jax.Array, jax.Array, jax.Array], jax.Array]
"""``attend(layer_index, q, k, v) -> out``: the attention of one layer, dense or paged."""

COLUMN = PartitionSpec(MODEL_AXIS, None)
"""An ``(out, in)`` weight split by output features (whole heads per device)."""
ROW = PartitionSpec(None, MODEL_AXIS)
"""An ``(out, in)`` weight split by input features (XLA sums the partial products)."""
SPLIT = PartitionSpec(MODEL_AXIS)
"""A bias of a column-split projection."""
REPLICATED = PartitionSpec()

SLIDING = "sliding_attention"
FULL = "full_attention"


def legacy_rope_parameters(config: Mapping[str, Any], default_theta: float) -> dict[str, Any]:
    """``rope_parameters`` of a config in the older form: ``rope_theta``, ``rope_scaling``
    (its ``rope_type`` and factors; Llama-3.x ships ``llama3`` here) and a top-level
    ``partial_rotary_factor``."""
    parameters = {"rope_type": "default", "rope_theta": config.get("rope_theta", default_theta)}
    if "partial_rotary_factor" in config:
        parameters["partial_rotary_factor"] = config["partial_rotary_factor"]
    return parameters | (config.get("rope_scaling") or {})


class Llama:
    """A Llama-family decoder (``LlamaForCausalLM``) built from a Hugging Face ``config.json`` dict.

    ``params`` is empty until :mod:`jaxkv.models.checkpoint` fills it with
    :meth:`tensor_shapes`' tensors. The object is a static argument of a jitted step
    (hashed by identity); the forwards read weights only from their ``params`` argument.
    """

    qk_norm: ClassVar[bool] = False
    unit_offset_norms: ClassVar[bool] = False
    post_norms: ClassVar[bool] = False

    def __init__(self, config: Mapping[str, Any], dtype: Any) -> None:
        self.config = dict(config)
        self.dtype = jnp.dtype(dtype)
        c = self.config
        self.architecture = (c.get("architectures") or [type(self).__name__])[0]
        self.name = f"{self.architecture} ({c['num_hidden_layers']} layers, hidden {c['hidden_size']})"
        self.vocab_size: int = c["vocab_size"]
        self.hidden_size: int = c["hidden_size"]
        self.num_layers: int = c["num_hidden_layers"]
        self.num_heads: int = c["num_attention_heads"]
        self.num_kv_heads: int = c.get("num_key_value_heads") or self.num_heads
        self.head_dim: int = c.get("head_dim") or self.hidden_size // self.num_heads
        self.intermediate_size: int = c["intermediate_size"]
        self.eps: float = c.get("rms_norm_eps", 1e-6)
        self.act: str = c.get("hidden_act") or c.get("hidden_activation") or "silu"
        layers.activation(self.act)  # an unknown activation is refused when the model is built
        self.tied: bool = bool(c.get("tie_word_embeddings", False))
        self.layer_types: list[str] = list(c.get("layer_types") or [FULL] * self.num_layers)
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown or len(self.layer_types) != self.num_layers:
            raise UnsupportedConfigError(
                f"layer_types must name {self.num_layers} layers, each {SLIDING!r} or {FULL!r}; got {self.layer_types}"
            )
        self.params: Params = {}

    # Per-architecture hooks -------------------------------------------------------

    def rope_parameters(self, layer_type: str) -> Mapping[str, Any]:
        """The ``rope_parameters`` of a layer type (one dict for all layers here); from a
        config saved before transformers 5 (the Hub's), ``rope_theta`` with ``rope_scaling``."""
        return self.config.get("rope_parameters") or legacy_rope_parameters(self.config, 10_000.0)

    def attention_shape(self, index: int) -> AttentionShape:
        """Heads, scale, window and soft cap of layer ``index``."""
        window = self.config.get("sliding_window") if self.layer_types[index] == SLIDING else None
        return AttentionShape(self.num_heads, self.num_kv_heads, self.head_dim, 1 / math.sqrt(self.head_dim), window)

    def embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        """The input embeddings of ``tokens``."""
        return params["model.embed_tokens.weight"][tokens]

    def logits(self, params: Params, x: jax.Array) -> jax.Array:
        """Float32 logits of final hidden states ``x``."""
        head = params["model.embed_tokens.weight" if self.tied else "lm_head.weight"]
        return layers.linear(self.norm(x, params["model.norm.weight"]), head).astype(jnp.float32)

    # The model --------------------------------------------------------------------

    def norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        return layers.rms_norm(x, weight, self.eps, unit_offset=self.unit_offset_norms)

    def rope(self, index: int) -> Rope:
        return Rope.from_config(self.rope_parameters(self.layer_types[index]), self.head_dim)

    def layer_name(self, index: int) -> str:
        return f"model.layers.{index}"

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by name, with its shape."""
        c, h, d = self.config, self.hidden_size, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = self.layer_name(i)
            shapes |= {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (self.num_heads * d, h),
                f"{p}.self_attn.k_proj.weight": (self.num_kv_heads * d, h),
                f"{p}.self_attn.v_proj.weight": (self.num_kv_heads * d, h),
                f"{p}.self_attn.o_proj.weight": (h, self.num_heads * d),
                f"{p}.mlp.gate_proj.weight": (self.intermediate_size, h),
                f"{p}.mlp.up_proj.weight": (self.intermediate_size, h),
                f"{p}.mlp.down_proj.weight": (h, self.intermediate_size),
            }
            if c.get("attention_bias"):
                shapes |= {
                    f"{p}.self_attn.q_proj.bias": (self.num_heads * d,),
                    f"{p}.self_attn.k_proj.bias": (self.num_kv_heads * d,),
                    f"{p}.self_attn.v_proj.bias": (self.num_kv_heads * d,),
                    f"{p}.self_attn.o_proj.bias": (h,),
                }
            if c.get("mlp_bias"):
                raise UnsupportedConfigError(f"{self.architecture} with mlp_bias=true is not built")
            if self.qk_norm:
                shapes |= {f"{p}.self_attn.q_norm.weight": (d,), f"{p}.self_attn.k_norm.weight": (d,)}
            if self.post_norms:
                shapes |= {
                    f"{p}.pre_feedforward_layernorm.weight": (h,),
                    f"{p}.post_feedforward_layernorm.weight": (h,),
                }
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def partition_specs(self) -> dict[str, PartitionSpec]:
        """Megatron-style tensor parallelism: q/k/v and gate/up split by output features
        (whole heads per device), o and down by input features, the rest replicated."""
        specs = {}
        for name, shape in self.tensor_shapes().items():
            part = name.rsplit(".", 2)[-2]
            if part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                specs[name] = COLUMN if len(shape) == 2 else SPLIT
            elif part in ("o_proj", "down_proj") and len(shape) == 2:
                specs[name] = ROW
            else:
                specs[name] = REPLICATED
        return specs

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        """The KV cache spec of every layer, in model order."""
        specs: dict[str, KVCacheSpec] = {}
        for i in range(self.num_layers):
            kw = {"num_kv_heads": self.num_kv_heads, "head_size": self.head_dim, "dtype": self.dtype.name}
            window = self.attention_shape(i).window
            specs[self.layer_name(i)] = (
                FullAttentionSpec(**kw) if window is None else SlidingWindowSpec(**kw, sliding_window=window)
            )
        return specs

    def _residual(self, params: Params, prefix: str, norm: str, x: jax.Array, out: jax.Array) -> jax.Array:
        """``x + out``, ``out`` first normed by ``{prefix}.{norm}`` when the model has post-norms."""
        return x + (self.norm(out, params[f"{prefix}.{norm}.weight"]) if self.post_norms else out)

    def _layer(self, params: Params, index: int, x: jax.Array, positions: jax.Array, attend: Attend) -> jax.Array:
        """One decoder layer: pre-norm attention then pre-norm gated MLP, with residuals."""
        p = self.layer_name(index)
        shape = self.attention_shape(index)
        q, k, v = layers.qkv(
            self.norm(x, params[f"{p}.input_layernorm.weight"]),
            params,
            f"{p}.self_attn",
            shape,
            self.rope(index),
            positions,
            norm_eps=self.eps if self.qk_norm else None,
            unit_offset=self.unit_offset_norms,
        )
        out = layers.output(attend(index, q, k, v), params, f"{p}.self_attn")
        if self.post_norms:
            x = self._residual(params, p, "post_attention_layernorm", x, out)
            h = self.norm(x, params[f"{p}.pre_feedforward_layernorm.weight"])
            return self._residual(
                params, p, "post_feedforward_layernorm", x, layers.gated_mlp(h, params, f"{p}.mlp", self.act)
            )
        x = x + out
        h = self.norm(x, params[f"{p}.post_attention_layernorm.weight"])
        return x + layers.gated_mlp(h, params, f"{p}.mlp", self.act)

    def dense(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Logits ``(B, L, vocab)`` of whole sequences ``tokens (B, L)`` from position 0, no cache."""
        positions = jnp.arange(tokens.shape[1])
        x = self.embed(params, tokens)
        for i in range(self.num_layers):
            x = self._layer(
                params, i, x, positions, lambda i, q, k, v: layers.dense_attention(q, k, v, self.attention_shape(i))
            )
        return self.logits(params, x)

    def forward(
        self, params: Params, cache: KVCache, meta: StepMetadata, *, impl: str | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Float32 logits ``(S, vocab)`` at ``meta.logits_indices`` of a ragged batch, and the updated cache."""
        state = {"cache": cache}

        def attend(index: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
            out, state["cache"] = layers.paged_attention(
                q, k, v, state["cache"], self.layer_name(index), meta, self.attention_shape(index), impl
            )
            return out

        x = self.embed(params, meta.input_ids)
        for i in range(self.num_layers):
            x = self._layer(params, i, x, meta.positions, attend)
        return self.logits(params, x[meta.logits_indices]), state["cache"]


class Qwen3(Llama):
    """Qwen3 (``Qwen3ForCausalLM``): Llama with RMSNorm on each head's q and k before RoPE."""

    qk_norm = True
