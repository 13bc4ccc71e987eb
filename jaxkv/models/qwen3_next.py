"""Qwen3-Next (``Qwen3NextForCausalLM``) from a Hugging Face config: Gated DeltaNet and
gated full attention in the pattern of its ``layer_types`` (3 : 1 in the released
models), each followed by a sparse MoE with a sigmoid-gated shared expert (or a dense
MLP on ``mlp_only_layers``).

- Full attention: q/k RMSNorm, partial rotary (``partial_rotary_factor`` of each head
  in ``rope_parameters``), an output gate ``sigmoid(g)`` from the q projection's second
  half per head.
- Gated DeltaNet (:mod:`jaxkv.models.delta_net`): ``in_proj_qkvz`` is stored grouped by
  key head (``[q | k | v | z]`` of each key head, its ``Hv / Hk`` value heads
  together); the forward regroups it into the convolution's ``[q | k | v]`` channels.
  Its output passes a gated RMSNorm (``norm(o) * silu(z)``, a plain-weighted norm).
- Every other RMSNorm is zero-centred: scaled by ``1 + weight``.
- The MoE (:mod:`jaxkv.models.moe`): softmax top-k router, SwiGLU experts as grouped
  matmuls; the checkpoint stores experts one by one, and setting :attr:`Qwen3Next.params`
  stacks them once (``...mlp.experts.gate_proj (E, D, F)``...).

Weights are the checkpoint's own tensors by name (see :mod:`jaxkv.models.checkpoint`).
Layer ``i`` holds cache under ``model.layers.<i>``: a full-attention layer a
:class:`~jaxkv.specs.FullAttentionSpec`, a Gated DeltaNet layer a
:class:`~jaxkv.specs.MambaSpec` of its conv state ``(C, K-1)`` (model dtype) and its
float32 delta-rule state ``(Hv, dk, dv)`` (as the ``qwen3-next-80b`` preset declares).
Not built: the multi-token-prediction head (``mtp.*`` tensors; transformers skips it too).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxkv.device.metadata import StepMetadata
from jaxkv.device.state_cache import HybridCache, read_layer_state, write_layer_state
from jaxkv.models import layers, moe
from jaxkv.models.delta_net import dense_delta_net, ragged_delta_net, seq_of_token
from jaxkv.models.layers import AttentionShape, Rope, UnsupportedConfigError
from jaxkv.models.llama import COLUMN, REPLICATED, ROW, Params
from jaxkv.specs import FullAttentionSpec, KVCacheSpec, MambaSpec

Mixer = Callable[[int, jax.Array], jax.Array]
"""``mix(layer_index, normed_x) -> out``: a layer's token mixer, dense or against the cache."""

_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")

LINEAR = "linear_attention"
FULL = "full_attention"


class Qwen3Next:
    """A Qwen3-Next decoder built from a Hugging Face ``config.json`` dict; ``params`` is
    empty until :mod:`jaxkv.models.checkpoint` fills it with :meth:`tensor_shapes`' tensors."""

    def __init__(self, config: Mapping[str, Any], dtype: Any) -> None:
        c = self.config = dict(config)
        self.dtype = jnp.dtype(dtype)
        self.name = f"Qwen3NextForCausalLM ({c['num_hidden_layers']} layers, hidden {c['hidden_size']})"
        self.vocab_size: int = c["vocab_size"]
        self.hidden_size: int = c["hidden_size"]
        self.num_layers: int = c["num_hidden_layers"]
        self.eps: float = c.get("rms_norm_eps", 1e-6)
        self.tied = bool(c.get("tie_word_embeddings", False))
        interval = c.get("full_attention_interval", 4)
        self.layer_types: list[str] = list(
            c.get("layer_types") or [FULL if (i + 1) % interval == 0 else LINEAR for i in range(self.num_layers)]
        )
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise UnsupportedConfigError(
                f"layer_types must name {self.num_layers} layers, each {LINEAR!r} or {FULL!r}; got {self.layer_types}"
            )
        if c.get("hidden_act", "silu") != "silu" or c.get("attention_bias"):
            raise UnsupportedConfigError("Qwen3-Next is built with hidden_act='silu' and no attention bias")
        self.head_dim: int = c.get("head_dim") or self.hidden_size // c["num_attention_heads"]
        self.attention = AttentionShape(
            c["num_attention_heads"], c["num_key_value_heads"], self.head_dim, 1 / math.sqrt(self.head_dim)
        )
        self.rope = Rope.from_config(
            c.get("rope_parameters")
            or {
                "rope_type": "default",
                "rope_theta": c.get("rope_theta", 10_000.0),
                "partial_rotary_factor": c.get("partial_rotary_factor", 0.25),
            },
            self.head_dim,
        )
        self.key_heads: int = c["linear_num_key_heads"]
        self.value_heads: int = c["linear_num_value_heads"]
        self.key_dim: int = c["linear_key_head_dim"]
        self.value_dim: int = c["linear_value_head_dim"]
        self.conv_kernel: int = c["linear_conv_kernel_dim"]
        if self.value_heads % self.key_heads:
            raise UnsupportedConfigError(
                f"linear_num_value_heads={self.value_heads} must be a multiple of linear_num_key_heads={self.key_heads}"
            )
        self.num_experts: int = c.get("num_experts", 0)
        sparse_step = c.get("decoder_sparse_step", 1)
        dense_only = set(c.get("mlp_only_layers") or ())
        self.sparse = [
            i not in dense_only and self.num_experts > 0 and (i + 1) % sparse_step == 0 for i in range(self.num_layers)
        ]
        self._params: Params = {}

    @property
    def params(self) -> Params:
        """The weights by checkpoint name, each MoE layer's experts stacked (see :mod:`jaxkv.models.moe`)."""
        return self._params

    @params.setter
    def params(self, loaded: Params) -> None:
        for i in range(self.num_layers):
            if self.sparse[i]:
                loaded = moe.stack_experts(loaded, f"{self.layer_name(i)}.mlp.experts", self.num_experts, _EXPERT_PARTS)
        self._params = loaded

    def layer_name(self, index: int) -> str:
        return f"model.layers.{index}"

    @property
    def conv_dim(self) -> int:
        """Channels of a Gated DeltaNet's convolution: q and k of every key head, v of every value head."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    # Weights ----------------------------------------------------------------------

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by name, with its shape."""
        c, h = self.config, self.hidden_size
        a = self.attention
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        value_width = self.value_heads * self.value_dim
        for i in range(self.num_layers):
            p = self.layer_name(i)
            shapes |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
            if self.layer_types[i] == FULL:
                shapes |= {
                    f"{p}.self_attn.q_proj.weight": (2 * a.num_heads * a.head_dim, h),
                    f"{p}.self_attn.k_proj.weight": (a.num_kv_heads * a.head_dim, h),
                    f"{p}.self_attn.v_proj.weight": (a.num_kv_heads * a.head_dim, h),
                    f"{p}.self_attn.o_proj.weight": (h, a.num_heads * a.head_dim),
                    f"{p}.self_attn.q_norm.weight": (a.head_dim,),
                    f"{p}.self_attn.k_norm.weight": (a.head_dim,),
                }
            else:
                la = f"{p}.linear_attn"
                shapes |= {
                    f"{la}.in_proj_qkvz.weight": (self.conv_dim + value_width, h),
                    f"{la}.in_proj_ba.weight": (2 * self.value_heads, h),
                    f"{la}.conv1d.weight": (self.conv_dim, 1, self.conv_kernel),
                    f"{la}.dt_bias": (self.value_heads,),
                    f"{la}.A_log": (self.value_heads,),
                    f"{la}.norm.weight": (self.value_dim,),
                    f"{la}.out_proj.weight": (h, value_width),
                }
            if self.sparse[i]:
                m, width = f"{p}.mlp", c["moe_intermediate_size"]
                shapes |= {f"{m}.gate.weight": (self.num_experts, h), f"{m}.shared_expert_gate.weight": (1, h)}
                shapes |= _mlp_shapes(f"{m}.shared_expert", h, c["shared_expert_intermediate_size"])
                for e in range(self.num_experts):
                    shapes |= _mlp_shapes(f"{m}.experts.{e}", h, width)
            else:
                shapes |= _mlp_shapes(f"{p}.mlp", h, c["intermediate_size"])
        shapes["model.norm.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def partition_specs(self) -> dict[str, PartitionSpec]:
        """Attention q/k/v and every MLP's gate/up split by output features (whole heads,
        whole hidden units per device), o and down by input features, stacked experts by
        their hidden units; the Gated DeltaNet layers, routers, norms, embeddings and LM
        head replicated. Keyed as :attr:`params` (the checkpoint's names before loading)."""
        shapes = {n: w.shape for n, w in self.params.items()} if self.params else self.tensor_shapes()
        specs = {}
        for name, shape in shapes.items():
            part = name.rsplit(".", 2)[-2]
            if ".experts." in name and len(shape) == 3:
                specs[name] = moe.stacked_partition(name.rsplit(".", 1)[-1])
            elif len(shape) == 2 and part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                specs[name] = COLUMN
            elif len(shape) == 2 and part in ("o_proj", "down_proj"):
                specs[name] = ROW
            else:
                specs[name] = REPLICATED
        return specs

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        """The KV cache spec of every layer, in model order (all of them hold cache)."""
        full = FullAttentionSpec(
            num_kv_heads=self.attention.num_kv_heads, head_size=self.head_dim, dtype=self.dtype.name
        )
        state = MambaSpec(
            shapes=((self.conv_dim, self.conv_kernel - 1), (self.value_heads, self.key_dim, self.value_dim)),
            dtypes=(self.dtype.name, "float32"),
            mamba_type="gated_delta_net",
        )
        return {self.layer_name(i): full if t == FULL else state for i, t in enumerate(self.layer_types)}

    # Layers -----------------------------------------------------------------------

    def norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        """Qwen3-Next's zero-centred RMSNorm (scaled by ``1 + weight``)."""
        return layers.rms_norm(x, weight, self.eps, unit_offset=True)

    def _attention_inputs(
        self, params: Params, p: str, x: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """q ``(..., T, QH, D)`` (normed, rotated), k (the same), v ``(..., T, KVH, D)`` and
        the output gate ``(..., T, QH D)``."""
        a, lead = self.attention, x.shape[:-1]
        query_gate = layers.linear(x, params[f"{p}.q_proj.weight"]).reshape(*lead, a.num_heads, 2 * a.head_dim)
        q, gate = jnp.split(query_gate, 2, axis=-1)
        k = layers.linear(x, params[f"{p}.k_proj.weight"]).reshape(*lead, a.num_kv_heads, a.head_dim)
        v = layers.linear(x, params[f"{p}.v_proj.weight"]).reshape(*lead, a.num_kv_heads, a.head_dim)
        q, k = self.norm(q, params[f"{p}.q_norm.weight"]), self.norm(k, params[f"{p}.k_norm.weight"])
        return self.rope(q, positions), self.rope(k, positions), v, gate.reshape(*lead, -1)

    def _attention_output(self, params: Params, p: str, out: jax.Array, gate: jax.Array) -> jax.Array:
        """``o_proj(out * sigmoid(gate))`` of the heads' outputs ``(..., T, QH, D)``."""
        flat = out.reshape(*out.shape[:-2], -1)
        return layers.linear(flat * jax.nn.sigmoid(gate), params[f"{p}.o_proj.weight"])

    def _delta_inputs(
        self, params: Params, p: str, x: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
        """The convolution's input ``[q | k | v] (..., C)``, the log decay and beta ``(..., Hv)``
        (float32), the output gate ``z (..., Hv, dv)`` and the conv weight ``(K, C)``."""
        lead, ratio = x.shape[:-1], self.value_heads // self.key_heads
        per_key = layers.linear(x, params[f"{p}.in_proj_qkvz.weight"]).reshape(*lead, self.key_heads, -1)
        qk_width, v_width = self.key_dim, ratio * self.value_dim
        q, k, v, z = jnp.split(per_key, [qk_width, 2 * qk_width, 2 * qk_width + v_width], axis=-1)
        mixed = jnp.concatenate([t.reshape(*lead, -1) for t in (q, k, v)], axis=-1)
        b, a = jnp.split(
            layers.linear(x, params[f"{p}.in_proj_ba.weight"]).reshape(*lead, self.key_heads, 2 * ratio), 2, -1
        )
        beta = jax.nn.sigmoid(b.reshape(*lead, self.value_heads).astype(jnp.float32))
        rate = jnp.exp(params[f"{p}.A_log"].astype(jnp.float32))
        step = a.reshape(*lead, self.value_heads).astype(jnp.float32) + params[f"{p}.dt_bias"].astype(jnp.float32)
        decay = -rate * jax.nn.softplus(step)
        conv_weight = params[f"{p}.conv1d.weight"][:, 0, :].T
        return mixed, decay, beta, z.reshape(*lead, self.value_heads, self.value_dim), conv_weight

    def _delta_output(self, params: Params, p: str, out: jax.Array, z: jax.Array) -> jax.Array:
        """Gated RMSNorm ``weight * norm(out) * silu(z)`` per value head, then ``out_proj``."""
        normed = layers.rms_norm(out.astype(z.dtype), params[f"{p}.norm.weight"], self.eps)
        gated = (normed.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(z.dtype)
        return layers.linear(gated.reshape(*gated.shape[:-2], -1), params[f"{p}.out_proj.weight"])

    def _mlp(self, params: Params, index: int, x: jax.Array) -> jax.Array:
        """The layer's feed-forward of ``x (..., D)``: the sparse MoE plus its gated shared
        expert, or a dense SwiGLU MLP."""
        m = f"{self.layer_name(index)}.mlp"
        if not self.sparse[index]:
            return layers.gated_mlp(x, params, m, "silu")
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = moe.softmax_top_k(
            layers.linear(flat, params[f"{m}.gate.weight"]),
            self.config["num_experts_per_tok"],
            normalize=bool(self.config.get("norm_topk_prob", True)),
        )
        e = f"{m}.experts"
        routed = moe.routed_experts(
            flat,
            experts,
            weights,
            params[f"{e}.up_proj"],
            params[f"{e}.down_proj"],
            jax.nn.silu,
            gate=params[f"{e}.gate_proj"],
        )
        shared = layers.gated_mlp(flat, params, f"{m}.shared_expert", "silu")
        shared = shared * jax.nn.sigmoid(layers.linear(flat, params[f"{m}.shared_expert_gate.weight"]))
        return (routed + shared).reshape(x.shape)

    def _layers(self, params: Params, x: jax.Array, attend: Mixer, recur: Mixer) -> jax.Array:
        """Every decoder layer: pre-norm token mixer then pre-norm feed-forward, with residuals."""
        for i in range(self.num_layers):
            p = self.layer_name(i)
            mix = attend if self.layer_types[i] == FULL else recur
            x = x + mix(i, self.norm(x, params[f"{p}.input_layernorm.weight"]))
            x = x + self._mlp(params, i, self.norm(x, params[f"{p}.post_attention_layernorm.weight"]))
        return x

    def logits(self, params: Params, x: jax.Array) -> jax.Array:
        head = params["model.embed_tokens.weight" if self.tied else "lm_head.weight"]
        return layers.linear(self.norm(x, params["model.norm.weight"]), head).astype(jnp.float32)

    # Forwards ---------------------------------------------------------------------

    def dense(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Logits ``(B, L, vocab)`` of whole sequences ``tokens (B, L)`` from position 0 and
        zero state, no cache: the oracle of :meth:`forward`."""
        positions = jnp.arange(tokens.shape[1])

        def attend(index: int, x: jax.Array) -> jax.Array:
            p = f"{self.layer_name(index)}.self_attn"
            q, k, v, gate = self._attention_inputs(params, p, x, positions)
            return self._attention_output(params, p, layers.dense_attention(q, k, v, self.attention), gate)

        def recur(index: int, x: jax.Array) -> jax.Array:
            p = f"{self.layer_name(index)}.linear_attn"
            mixed, decay, beta, z, conv_weight = self._delta_inputs(params, p, x)
            out = dense_delta_net(mixed, decay, beta, conv_weight, self.key_heads, self.key_dim, self.value_heads)
            return self._delta_output(params, p, out, z)

        return self.logits(params, self._layers(params, params["model.embed_tokens.weight"][tokens], attend, recur))

    def forward(
        self, params: Params, cache: HybridCache, meta: StepMetadata, *, impl: str | None = None
    ) -> tuple[jax.Array, HybridCache]:
        """Float32 logits ``(S, vocab)`` at ``meta.logits_indices`` of a ragged batch and the
        updated cache: attention through the paged KV cache, each Gated DeltaNet resuming
        every sequence from its state rows (``meta.states_of(layer)``)."""
        state = {"cache": cache}
        owner = seq_of_token(meta.cu_q_lens, meta.num_seqs, meta.input_ids.shape[0])

        def attend(index: int, x: jax.Array) -> jax.Array:
            name, p = self.layer_name(index), f"{self.layer_name(index)}.self_attn"
            q, k, v, gate = self._attention_inputs(params, p, x, meta.positions)
            out, kv = layers.paged_attention(q, k, v, state["cache"].kv, name, meta, self.attention, impl)
            state["cache"] = dataclasses.replace(state["cache"], kv=kv)
            return self._attention_output(params, p, out, gate)

        def recur(index: int, x: jax.Array) -> jax.Array:
            name, p = self.layer_name(index), f"{self.layer_name(index)}.linear_attn"
            rows = meta.states_of(name)
            conv, recurrent = read_layer_state(state["cache"], name, rows)
            mixed, decay, beta, z, conv_weight = self._delta_inputs(params, p, x)
            out, conv, recurrent = ragged_delta_net(
                mixed,
                decay,
                beta,
                conv_weight,
                owner,
                conv.swapaxes(1, 2),
                recurrent,
                self.key_heads,
                self.key_dim,
                num_value_heads=self.value_heads,
            )
            state["cache"] = write_layer_state(state["cache"], name, rows, (conv.swapaxes(1, 2), recurrent))
            return self._delta_output(params, p, out, z)

        x = self._layers(params, params["model.embed_tokens.weight"][meta.input_ids], attend, recur)
        return self.logits(params, x[meta.logits_indices]), state["cache"]


def _mlp_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    """A SwiGLU MLP's three projections under ``prefix``."""
    return {
        f"{prefix}.gate_proj.weight": (width, hidden),
        f"{prefix}.up_proj.weight": (width, hidden),
        f"{prefix}.down_proj.weight": (hidden, width),
    }
