"""Nemotron-H (``NemotronHForCausalLM``) from a Hugging Face config: a stack of single-mixer
blocks, ``x + mixer(norm(x))``, each a Mamba-2 mixer, attention, an MLP or a sparse MoE
as its ``layers_block_type`` lists them (older configs: ``hybrid_override_pattern``,
``M`` / ``*`` / ``-`` / ``E``).

- Mamba-2 (:mod:`jaxkv.models.mamba2`), its time step clipped below at
  ``time_step_min`` as transformers' whole-sequence path does (its one-token path does
  not clip; this model clips both, so a served sequence and the dense oracle agree).
- Attention: grouped-query, no positional encoding (the Mamba layers carry order).
- MLP: ``down(relu(up(x))^2)``.
- MoE (:mod:`jaxkv.models.moe`): sigmoid router with a score-correction bias and
  group-limited top-k, squared-ReLU experts (optionally through a latent projection),
  plus a shared expert; setting :attr:`NemotronH.params` stacks the experts, stored one
  by one, once.

Weights are the checkpoint's own tensors by name (``backbone.`` prefix). Block ``i``
holds cache under ``backbone.layers.<i>`` when it is a Mamba-2 block (a
:class:`~jaxkv.specs.MambaSpec` of its conv state ``(C, K-1)``, model dtype, and its
float32 SSM state ``(H, P, N)``, as the ``nemotron-h-8b`` preset declares) or an
attention block (:class:`~jaxkv.specs.FullAttentionSpec`); MLP and MoE blocks hold none.
Not built: the multi-token-prediction layers (``mtp.*``, ``num_nextn_predict_layers``;
transformers skips them too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxkv.device.metadata import StepMetadata
from jaxkv.device.state_cache import HybridCache, read_layer_state, write_layer_state
from jaxkv.models import layers, mamba2, moe
from jaxkv.models.delta_net import seq_of_token
from jaxkv.models.layers import AttentionShape, UnsupportedConfigError
from jaxkv.models.llama import COLUMN, REPLICATED, ROW, Params
from jaxkv.specs import FullAttentionSpec, KVCacheSpec, MambaSpec

Mixer = Callable[[int, jax.Array], jax.Array]
"""``mix(block_index, normed_x) -> out``: a block's Mamba-2 or attention mixer, dense or against the cache."""

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
"""``hybrid_override_pattern`` characters to block types."""

_MAMBA_PARTS = {
    "in_proj": "in_proj.weight",
    "conv_bias": "conv1d.bias",
    "dt_bias": "dt_bias",
    "a_log": "A_log",
    "d": "D",
    "norm": "norm.weight",
}
"""Mamba-2 mixer weights taken as stored (``in_proj``/``out_proj`` transposed, conv reshaped)."""


def relu2(x: jax.Array) -> jax.Array:
    """Squared ReLU, Nemotron-H's MLP activation."""
    return jnp.square(jax.nn.relu(x))


class NemotronH:
    """A Nemotron-H model built from a Hugging Face ``config.json`` dict; ``params`` is
    empty until :mod:`jaxkv.models.checkpoint` fills it with :meth:`tensor_shapes`' tensors."""

    def __init__(self, config: Mapping[str, Any], dtype: Any) -> None:
        c = self.config = dict(config)
        self.dtype = jnp.dtype(dtype)
        types = c.get("layers_block_type") or [PATTERN.get(ch, ch) for ch in c.get("hybrid_override_pattern", "")]
        if not types or set(types) - {MAMBA, ATTENTION, MLP, MOE}:
            raise UnsupportedConfigError(
                f"layers_block_type must list block types out of {sorted(PATTERN.values())}; got {types!r}"
            )
        if c.get("mlp_hidden_act", "relu2") != "relu2" or c.get("mamba_hidden_act", "silu") != "silu":
            raise UnsupportedConfigError("Nemotron-H is built with mlp_hidden_act='relu2' and mamba_hidden_act='silu'")
        if c.get("use_bias") or c.get("mlp_bias") or c.get("attention_bias") or not c.get("use_conv_bias", True):
            raise UnsupportedConfigError("Nemotron-H is built with projection biases off and the conv bias on")
        if c.get("sliding_window"):
            raise UnsupportedConfigError(
                f"Nemotron-H is built with full attention; got sliding_window={c['sliding_window']!r}"
            )
        self.block_types: list[str] = list(types)
        self.num_layers = len(types)
        self.name = f"NemotronHForCausalLM ({self.num_layers} blocks, hidden {c['hidden_size']})"
        self.vocab_size: int = c["vocab_size"]
        self.hidden_size: int = c["hidden_size"]
        self.eps: float = c.get("layer_norm_epsilon", 1e-5)
        self.tied = bool(c.get("tie_word_embeddings", False))
        head_dim = c.get("head_dim") or self.hidden_size // c["num_attention_heads"]
        self.attention = AttentionShape(
            c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"], head_dim, head_dim**-0.5
        )
        self.mamba = mamba2.Mamba2Dims(
            num_heads=c["mamba_num_heads"],
            head_dim=c["mamba_head_dim"],
            num_groups=c["n_groups"],
            state_size=c["ssm_state_size"],
            conv_kernel=c["conv_kernel"],
            norm_eps=self.eps,
            dt_min=float(c.get("time_step_min", 0.0)),
        )
        self._params: Params = {}

    @property
    def params(self) -> Params:
        """The weights by checkpoint name, each MoE block's experts stacked (see :mod:`jaxkv.models.moe`)."""
        return self._params

    @params.setter
    def params(self, loaded: Params) -> None:
        for i, kind in enumerate(self.block_types):
            if kind == MOE:
                prefix = f"{self.layer_name(i)}.mixer.experts"
                loaded = moe.stack_experts(loaded, prefix, self.config["n_routed_experts"], ("up_proj", "down_proj"))
        self._params = loaded

    def layer_name(self, index: int) -> str:
        return f"backbone.layers.{index}"

    # Weights ----------------------------------------------------------------------

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by name, with its shape."""
        c, h, a, m = self.config, self.hidden_size, self.attention, self.mamba
        shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (self.vocab_size, h)}
        for i, kind in enumerate(self.block_types):
            p = self.layer_name(i)
            x = f"{p}.mixer"
            shapes[f"{p}.norm.weight"] = (h,)
            if kind == MAMBA:
                shapes |= {
                    f"{x}.in_proj.weight": (m.inner + m.conv_dim + m.num_heads, h),
                    f"{x}.conv1d.weight": (m.conv_dim, 1, m.conv_kernel),
                    f"{x}.conv1d.bias": (m.conv_dim,),
                    f"{x}.dt_bias": (m.num_heads,),
                    f"{x}.A_log": (m.num_heads,),
                    f"{x}.D": (m.num_heads,),
                    f"{x}.norm.weight": (m.inner,),
                    f"{x}.out_proj.weight": (h, m.inner),
                }
            elif kind == ATTENTION:
                shapes |= {
                    f"{x}.q_proj.weight": (a.num_heads * a.head_dim, h),
                    f"{x}.k_proj.weight": (a.num_kv_heads * a.head_dim, h),
                    f"{x}.v_proj.weight": (a.num_kv_heads * a.head_dim, h),
                    f"{x}.o_proj.weight": (h, a.num_heads * a.head_dim),
                }
            elif kind == MLP:
                shapes |= _mlp_shapes(x, h, c["intermediate_size"])
            else:
                experts, latent = c["n_routed_experts"], c.get("moe_latent_size") or h
                shapes |= {f"{x}.gate.weight": (experts, h), f"{x}.gate.e_score_correction_bias": (experts,)}
                shapes |= _mlp_shapes(f"{x}.shared_experts", h, c["moe_shared_expert_intermediate_size"])
                for e in range(experts):
                    shapes |= _mlp_shapes(f"{x}.experts.{e}", latent, c["moe_intermediate_size"])
                if c.get("moe_latent_size"):
                    shapes |= {f"{x}.fc1_latent_proj.weight": (latent, h), f"{x}.fc2_latent_proj.weight": (h, latent)}
        shapes["backbone.norm_f.weight"] = (h,)
        if not self.tied:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def partition_specs(self) -> dict[str, PartitionSpec]:
        """Attention q/k/v and MLP/expert ``up`` split by output features, ``o`` and
        ``down`` by input features, stacked experts by their hidden units; Mamba-2 mixers,
        routers, norms, embeddings and the LM head replicated. Keyed as :attr:`params`
        (the checkpoint's names before loading)."""
        shapes = {n: w.shape for n, w in self.params.items()} if self.params else self.tensor_shapes()
        specs = {}
        for name, shape in shapes.items():
            part = name.rsplit(".", 2)[-2]
            attention = ".mixer.q_proj" in name or ".mixer.k_proj" in name or ".mixer.v_proj" in name
            if ".experts." in name and len(shape) == 3:
                specs[name] = moe.stacked_partition(name.rsplit(".", 1)[-1])
            elif len(shape) == 2 and (attention or part == "up_proj"):
                specs[name] = COLUMN
            elif len(shape) == 2 and part in ("o_proj", "down_proj"):
                specs[name] = ROW
            else:
                specs[name] = REPLICATED
        return specs

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        """The KV cache spec of every Mamba-2 and attention block, in model order."""
        m = self.mamba
        state = MambaSpec(
            shapes=((m.conv_dim, m.conv_kernel - 1), (m.num_heads, m.head_dim, m.state_size)),
            dtypes=(self.dtype.name, "float32"),
            mamba_type="mamba2",
        )
        full = FullAttentionSpec(
            num_kv_heads=self.attention.num_kv_heads, head_size=self.attention.head_dim, dtype=self.dtype.name
        )
        kinds = {MAMBA: state, ATTENTION: full}
        return {self.layer_name(i): kinds[t] for i, t in enumerate(self.block_types) if t in kinds}

    # Blocks -----------------------------------------------------------------------

    def _mamba_params(self, params: Params, index: int) -> dict[str, jax.Array]:
        """Block ``index``'s Mamba-2 weights in :mod:`jaxkv.models.mamba2`'s layout."""
        x = f"{self.layer_name(index)}.mixer"
        weights = {key: params[f"{x}.{name}"] for key, name in _MAMBA_PARTS.items()}
        weights["in_proj"] = weights["in_proj"].T
        weights["conv_weight"] = params[f"{x}.conv1d.weight"][:, 0, :].T
        weights["out_proj"] = params[f"{x}.out_proj.weight"].T
        return weights

    def _attention_inputs(self, params: Params, index: int, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        a, lead, p = self.attention, x.shape[:-1], f"{self.layer_name(index)}.mixer"
        q = layers.linear(x, params[f"{p}.q_proj.weight"]).reshape(*lead, a.num_heads, a.head_dim)
        k = layers.linear(x, params[f"{p}.k_proj.weight"]).reshape(*lead, a.num_kv_heads, a.head_dim)
        v = layers.linear(x, params[f"{p}.v_proj.weight"]).reshape(*lead, a.num_kv_heads, a.head_dim)
        return q, k, v

    def _moe(self, params: Params, index: int, x: jax.Array) -> jax.Array:
        c, p = self.config, f"{self.layer_name(index)}.mixer"
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = moe.sigmoid_group_top_k(
            layers.linear(flat.astype(jnp.float32), params[f"{p}.gate.weight"].astype(jnp.float32)),
            c["num_experts_per_tok"],
            bias=params[f"{p}.gate.e_score_correction_bias"],
            num_groups=c.get("n_group", 1),
            top_groups=c.get("topk_group", 1),
            normalize=bool(c.get("norm_topk_prob", True)),
            scale=float(c.get("routed_scaling_factor", 1.0)),
        )
        up, down = params[f"{p}.experts.up_proj"], params[f"{p}.experts.down_proj"]
        latent = c.get("moe_latent_size")
        routed_in = layers.linear(flat, params[f"{p}.fc1_latent_proj.weight"]) if latent else flat
        routed = moe.routed_experts(routed_in, experts, weights, up, down, relu2)
        if latent:
            routed = layers.linear(routed, params[f"{p}.fc2_latent_proj.weight"])
        return (routed + _mlp(params, f"{p}.shared_experts", flat)).reshape(x.shape)

    def _blocks(self, params: Params, x: jax.Array, attend: Mixer, recur: Mixer) -> jax.Array:
        for i, kind in enumerate(self.block_types):
            p = self.layer_name(i)
            h = layers.rms_norm(x, params[f"{p}.norm.weight"], self.eps)
            if kind == MAMBA:
                out = recur(i, h)
            elif kind == ATTENTION:
                out = attend(i, h)
            elif kind == MLP:
                out = _mlp(params, f"{p}.mixer", h)
            else:
                out = self._moe(params, i, h)
            x = x + out
        return x

    def logits(self, params: Params, x: jax.Array) -> jax.Array:
        head = params["backbone.embeddings.weight" if self.tied else "lm_head.weight"]
        normed = layers.rms_norm(x, params["backbone.norm_f.weight"], self.eps)
        return layers.linear(normed, head).astype(jnp.float32)

    # Forwards ---------------------------------------------------------------------

    def dense(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Logits ``(B, L, vocab)`` of whole sequences ``tokens (B, L)`` from zero state, no
        cache: the oracle of :meth:`forward`."""

        def attend(index: int, x: jax.Array) -> jax.Array:
            out = layers.dense_attention(*self._attention_inputs(params, index, x), self.attention)
            return layers.output(out, params, f"{self.layer_name(index)}.mixer")

        def recur(index: int, x: jax.Array) -> jax.Array:
            return mamba2.dense_mixer(self._mamba_params(params, index), x, self.mamba)[0]

        return self.logits(params, self._blocks(params, params["backbone.embeddings.weight"][tokens], attend, recur))

    def forward(
        self, params: Params, cache: HybridCache, meta: StepMetadata, *, impl: str | None = None
    ) -> tuple[jax.Array, HybridCache]:
        """Float32 logits ``(S, vocab)`` at ``meta.logits_indices`` of a ragged batch and the
        updated cache: attention through the paged KV cache, each Mamba-2 block resuming
        every sequence from its state rows (``meta.states_of(layer)``)."""
        state = {"cache": cache}
        owner = seq_of_token(meta.cu_q_lens, meta.num_seqs, meta.input_ids.shape[0])

        def attend(index: int, x: jax.Array) -> jax.Array:
            name = self.layer_name(index)
            q, k, v = self._attention_inputs(params, index, x)
            out, kv = layers.paged_attention(q, k, v, state["cache"].kv, name, meta, self.attention, impl)
            state["cache"] = dataclasses.replace(state["cache"], kv=kv)
            return layers.output(out, params, f"{name}.mixer")

        def recur(index: int, x: jax.Array) -> jax.Array:
            name = self.layer_name(index)
            rows = meta.states_of(name)
            conv, ssm = read_layer_state(state["cache"], name, rows)
            out, conv, ssm = mamba2.ragged_mixer(
                self._mamba_params(params, index), x, owner, conv.swapaxes(1, 2), ssm, self.mamba
            )
            state["cache"] = write_layer_state(state["cache"], name, rows, (conv.swapaxes(1, 2), ssm))
            return out

        x = self._blocks(params, params["backbone.embeddings.weight"][meta.input_ids], attend, recur)
        return self.logits(params, x[meta.logits_indices]), state["cache"]


def _mlp_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    """A squared-ReLU MLP's two projections under ``prefix``."""
    return {f"{prefix}.up_proj.weight": (width, hidden), f"{prefix}.down_proj.weight": (hidden, width)}


def _mlp(params: Params, prefix: str, x: jax.Array) -> jax.Array:
    """``down(relu(up(x))^2)`` from ``{prefix}.up_proj.weight`` and ``{prefix}.down_proj.weight``."""
    return layers.linear(
        relu2(layers.linear(x, params[f"{prefix}.up_proj.weight"])), params[f"{prefix}.down_proj.weight"]
    )
