"""Tiny decoder models with seeded random weights, paged and dense, built on :mod:`jaxkv.models.layers`.

Three architectures, all small enough to serve on a CPU in seconds:

- ``tiny-llama``: Llama-like: full attention with GQA, RoPE, RMSNorm, SwiGLU MLP;
- ``tiny-hybrid``: Gemma-3-like: sliding-window : full attention = 5 : 1 (window 32),
  QK-norm, pre- and post-norms, GeGLU MLP, a larger RoPE base for the global layers,
  scaled embeddings, and Gemma-2's attention and final logit soft-caps. Its layer specs
  are exactly the ``tiny-hybrid`` preset.
- ``tiny-qwen3-next``: Qwen3-Next-like: Gated DeltaNet (linear attention,
  :mod:`jaxkv.models.delta_net`) : full attention = 3 : 1, QK-norm. Its recurrent
  layers keep their state in a :class:`~jaxkv.device.state_cache.HybridCache` (state rows, or
  units of KV pages with ``shared_pages``); the step reads and writes where
  :class:`~jaxkv.device.metadata.StateMetadata` says.

The weights are a flat dict of arrays named in the Hugging Face style
(``layers.0.self_attn.q_proj.weight``, ``(out, in)``), as the checkpoint architectures
(:mod:`jaxkv.models.llama`...) hold theirs; :func:`init_params` draws them from a seed
(the same seed, the same weights). Every model has two forwards over the same weights:

- :meth:`TinyLM.forward` (the :class:`~jaxkv.models.protocol.ServedModel` step): a
  ragged batch (decodes first, then prefill chunks) against the paged KV cache; each
  attention layer writes its new K/V and attends by its name
  (:func:`jaxkv.models.layers.paged_attention`), the cache and the step metadata
  supplying its window and block table;
- :meth:`TinyLM.dense`: plain causal attention over whole sequences (window-masked in
  window layers) and the delta rule from zero state, no cache: the correctness oracle
  of the paged path.

Tensor parallelism (Megatron-style, :meth:`TinyLM.partition_specs`): the attention
q/k/v and MLP gate/up projections are column-parallel (split by output features, so
each device computes whole heads of its own KV heads), the attention and MLP output
projections row-parallel (split by input features; XLA sums the partial products).
Embeddings, norms, the LM head and the Gated DeltaNet layers are replicated;
:mod:`jaxkv.device.mesh` places the weights.

Layer ``i`` is named ``layers.<i>``, as in :mod:`jaxkv.presets`, so
``plan_kv_cache(config.layer_specs(), ...)`` plans the cache the model reads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxkv.device.cache import KVCache
from jaxkv.device.metadata import StepMetadata
from jaxkv.device.state_cache import HybridCache, read_layer_state, write_layer_state
from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int
from jaxkv.models import layers
from jaxkv.models.delta_net import dense_delta_net, ragged_delta_net, seq_of_token
from jaxkv.models.layers import AttentionShape, Rope
from jaxkv.models.llama import COLUMN, REPLICATED, ROW, Params
from jaxkv.models.protocol import DenseModel
from jaxkv.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

DTYPES = ("float32", "bfloat16")
NORM_EPS = 1e-6
Mixer = Callable[[int, jax.Array], jax.Array]
"""``mix(layer_index, normed_x) -> out``: a layer's token mixer, dense or against the cache."""


class ModelConfigError(JaxkvError, ValueError):
    """A model config, name or input that cannot describe or drive a model."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a :class:`TinyLM`.

    ``activation`` is a Hugging Face activation name (:data:`jaxkv.models.layers.ACTIVATIONS`).
    ``windows[i]`` is layer i's sliding window in tokens (a query at position p sees
    kv positions ``p - window < kv_pos <= p``), or None for full attention.
    ``recurrent[i]`` (empty: none) makes layer i a Gated DeltaNet of ``delta_heads``
    heads of ``delta_key_dim`` x ``delta_value_dim`` state and a ``conv_kernel`` causal
    convolution (its window must be None).
    """

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    windows: tuple[int | None, ...]
    rope_theta: float = 10_000.0
    local_rope_theta: float = 10_000.0
    activation: str = "silu"
    qk_norm: bool = False
    post_norms: bool = False
    scale_embeddings: bool = False
    attn_soft_cap: float | None = None
    final_soft_cap: float | None = None
    dtype: str = "float32"
    recurrent: tuple[bool, ...] = ()
    delta_heads: int = 4
    delta_key_dim: int = 32
    delta_value_dim: int = 32
    conv_kernel: int = 4

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "mlp_dim",
            "delta_heads",
            "delta_key_dim",
            "delta_value_dim",
        ):
            value = getattr(self, name)
            check_int(name, value, minimum=1, error=ModelConfigError)
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.windows or any(w is not None and (not isinstance(w, int) or w <= 0) for w in self.windows):
            raise ModelConfigError(f"windows must be a non-empty tuple of ints > 0 or None, got {self.windows!r}")
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"unknown dtype {self.dtype!r}; valid: {', '.join(DTYPES)}")
        if self.activation not in layers.ACTIVATIONS:
            raise ModelConfigError(f"unknown activation {self.activation!r}; valid: {', '.join(layers.ACTIVATIONS)}")
        check_int("conv_kernel", self.conv_kernel, minimum=2, error=ModelConfigError)
        if self.recurrent and (
            len(self.recurrent) != len(self.windows)
            or any(r not in (True, False) for r in self.recurrent)
            or any(r and w is not None for r, w in zip(self.recurrent, self.windows, strict=True))
        ):
            raise ModelConfigError(
                f"recurrent must be empty or one bool per layer, windows None where True; got "
                f"recurrent={self.recurrent!r}, windows={self.windows!r}"
            )

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(f"layers.{i}" for i in range(self.num_layers))

    def is_recurrent(self, index: int) -> bool:
        return bool(self.recurrent) and self.recurrent[index]

    @property
    def conv_dim(self) -> int:
        """Channels of a Gated DeltaNet's convolution: q, k and v of every head."""
        return self.delta_heads * (2 * self.delta_key_dim + self.delta_value_dim)

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        """The KV cache spec of every layer, in model order (input of ``plan_kv_cache``);
        a recurrent layer's state is its conv window (model dtype) and its float32 delta-rule state."""
        state = MambaSpec(
            shapes=(
                (self.conv_kernel - 1, self.conv_dim),
                (self.delta_heads, self.delta_key_dim, self.delta_value_dim),
            ),
            dtypes=(self.dtype, "float32"),
            mamba_type="gated_delta_net",
        )

        def attention(window: int | None) -> KVCacheSpec:
            if window is None:
                return FullAttentionSpec(num_kv_heads=self.num_kv_heads, head_size=self.head_dim, dtype=self.dtype)
            return SlidingWindowSpec(
                num_kv_heads=self.num_kv_heads, head_size=self.head_dim, dtype=self.dtype, sliding_window=window
            )

        return {
            name: state if self.is_recurrent(i) else attention(window)
            for i, (name, window) in enumerate(zip(self.layer_names, self.windows, strict=True))
        }


class _Sizes(TypedDict):
    """The size fields of a :class:`ModelConfig`."""

    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int


_TINY_SIZES: _Sizes = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "mlp_dim": 256,
}
"""Sizes every tiny model shares (they differ in layer kinds, norms and caps)."""

MODEL_CONFIGS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        **_TINY_SIZES,
        windows=(None,) * 4,
        rope_theta=500_000.0,
    ),
    "tiny-hybrid": ModelConfig(
        **_TINY_SIZES,
        windows=tuple(None if (i + 1) % 6 == 0 else 32 for i in range(6)),
        rope_theta=1_000_000.0,
        local_rope_theta=10_000.0,
        activation="gelu_pytorch_tanh",
        qk_norm=True,
        post_norms=True,
        scale_embeddings=True,
        attn_soft_cap=50.0,
        final_soft_cap=30.0,
    ),
    "tiny-qwen3-next": ModelConfig(
        **_TINY_SIZES,
        windows=(None,) * 8,
        recurrent=(True, True, True, False) * 2,
        rope_theta=10_000_000.0,
        qk_norm=True,
    ),
}


MESH_MODEL_CONFIGS: dict[str, ModelConfig] = {
    f"{name}-kv8": dataclasses.replace(MODEL_CONFIGS[name], num_heads=8, num_kv_heads=8, head_dim=16)
    for name in MODEL_CONFIGS
}
"""The tiny models with 8 KV heads of 16 (the same hidden size), so their KV cache splits
over up to 8 devices (:mod:`jaxkv.device.mesh`); the tiny models' 2 KV heads split over
at most 2."""

GPU_MODEL_CONFIGS: dict[str, ModelConfig] = {
    "llama-1b": ModelConfig(
        vocab_size=32_000,
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        mlp_dim=8192,
        windows=(None,) * 16,
        rope_theta=500_000.0,
        dtype="bfloat16",
    ),
}
"""Benchmark models sized for an accelerator (``llama-1b``: ~1.1e9 parameters, Llama-3.2-1B
shaped), so a step measures compute, not launch overhead. Kept apart from
:data:`MODEL_CONFIGS` (every model there serves on a CPU in seconds, and CPU runs such
as the soak iterate over it); :func:`get_model_config` finds all three dicts."""


def model_names() -> tuple[str, ...]:
    """Every named model: the tiny ones, their 8-KV-head variants, then the GPU-sized ones."""
    return (*MODEL_CONFIGS, *MESH_MODEL_CONFIGS, *GPU_MODEL_CONFIGS)


def get_model_config(name: str, *, dtype: str | None = None) -> ModelConfig:
    """The config of a named model (see :data:`MODEL_CONFIGS`, :data:`MESH_MODEL_CONFIGS`,
    :data:`GPU_MODEL_CONFIGS`); ``dtype`` overrides its weights', activations' and cache's dtype."""
    try:
        config = {**MODEL_CONFIGS, **MESH_MODEL_CONFIGS, **GPU_MODEL_CONFIGS}[name]
    except (KeyError, TypeError):
        raise ModelConfigError(f"unknown model {name!r}; valid models: {', '.join(model_names())}") from None
    return config if dtype is None else dataclasses.replace(config, dtype=dtype)


Init = Callable[[jax.Array, tuple[int, ...]], jax.Array]
"""``init(key, shape) -> float32 array``: how one weight is drawn."""


def _normal(fan_in: int) -> Init:
    """Normal weights of variance ``1 / fan_in`` (LeCun's), so activations keep their scale."""
    return lambda key, shape: jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5


def _ones(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jnp.ones(shape, jnp.float32)


def _fixed(values: np.ndarray) -> Init:
    """The same ``values`` whatever the seed."""
    return lambda key, shape: jnp.asarray(values, jnp.float32)


class Weight(NamedTuple):
    """One weight of a tiny model: its shape, how it is drawn and how it splits over a mesh."""

    shape: tuple[int, ...]
    init: Init
    partition: PartitionSpec = REPLICATED
    float32: bool = False
    """Kept in float32 whatever the model's dtype (the Gated DeltaNet's decay rates)."""


def _projection(out: int, fan_in: int, partition: PartitionSpec = REPLICATED) -> Weight:
    """A bias-free ``(out, in)`` projection."""
    return Weight((out, fan_in), _normal(fan_in), partition)


def _norm(dim: int) -> Weight:
    return Weight((dim,), _ones)


def weight_table(config: ModelConfig) -> dict[str, Weight]:
    """Every weight of a :class:`TinyLM` of ``config`` by name, in the order the seed draws them."""
    c, h = config, config.hidden_size
    table = {"embed_tokens.weight": Weight((c.vocab_size, h), _normal(h))}
    for i, p in enumerate(c.layer_names):
        table[f"{p}.input_layernorm.weight"] = _norm(h)
        table |= (
            _delta_net_weights(c, f"{p}.linear_attn") if c.is_recurrent(i) else _attention_weights(c, f"{p}.self_attn")
        )
        table[f"{p}.post_attention_layernorm.weight"] = _norm(h)
        if c.post_norms:
            table[f"{p}.pre_feedforward_layernorm.weight"] = _norm(h)
            table[f"{p}.post_feedforward_layernorm.weight"] = _norm(h)
        table |= {
            f"{p}.mlp.gate_proj.weight": _projection(c.mlp_dim, h, COLUMN),
            f"{p}.mlp.up_proj.weight": _projection(c.mlp_dim, h, COLUMN),
            f"{p}.mlp.down_proj.weight": _projection(h, c.mlp_dim, ROW),
        }
    return table | {"norm.weight": _norm(h), "lm_head.weight": _projection(c.vocab_size, h)}


def _attention_weights(c: ModelConfig, prefix: str) -> dict[str, Weight]:
    """q/k/v column-parallel (whole heads per device), o row-parallel, and the QK-norms."""
    h, q_width, kv_width = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    table = {
        f"{prefix}.q_proj.weight": _projection(q_width, h, COLUMN),
        f"{prefix}.k_proj.weight": _projection(kv_width, h, COLUMN),
        f"{prefix}.v_proj.weight": _projection(kv_width, h, COLUMN),
        f"{prefix}.o_proj.weight": _projection(h, q_width, ROW),
    }
    if c.qk_norm:
        table |= {f"{prefix}.q_norm.weight": _norm(c.head_dim), f"{prefix}.k_norm.weight": _norm(c.head_dim)}
    return table


def _delta_net_weights(c: ModelConfig, prefix: str) -> dict[str, Weight]:
    """A Gated DeltaNet's projections, causal conv ``(K, C)`` and decay parameters (replicated).

    Per-head decay rates ``exp(A_log)`` in [1, 16] (as Mamba-2 initialises A) and a
    time-step bias of -2, the same for every seed."""
    h, heads, value_width = c.hidden_size, c.delta_heads, c.delta_heads * c.delta_value_dim
    return {
        f"{prefix}.qkv_proj.weight": _projection(c.conv_dim, h),
        f"{prefix}.conv.weight": Weight((c.conv_kernel, c.conv_dim), _normal(c.conv_kernel)),
        f"{prefix}.decay_proj.weight": _projection(heads, h),
        f"{prefix}.beta_proj.weight": _projection(heads, h),
        f"{prefix}.A_log": Weight((heads,), _fixed(np.log(np.linspace(1.0, 16.0, heads))), float32=True),
        f"{prefix}.dt_bias": Weight((heads,), _fixed(np.full(heads, -2.0)), float32=True),
        f"{prefix}.z_proj.weight": _projection(value_width, h),
        f"{prefix}.norm.weight": _norm(c.delta_value_dim),
        f"{prefix}.out_proj.weight": _projection(h, value_width),
    }


def init_params(config: ModelConfig, seed: int) -> Params:
    """The weights of a :class:`TinyLM` of ``config``: weight ``n`` of :func:`weight_table` drawn
    from ``fold_in(key(seed), n)``, so the same seed gives the same weights."""
    key = jax.random.key(check_int("seed", seed, minimum=0, error=ModelConfigError))
    return {
        name: weight.init(jax.random.fold_in(key, n), weight.shape).astype(
            "float32" if weight.float32 else config.dtype
        )
        for n, (name, weight) in enumerate(weight_table(config).items())
    }


class TinyLM:
    """A decoder-only LM built from a :class:`ModelConfig`, weights drawn from ``seed``.

    A :class:`~jaxkv.models.protocol.ServedModel` whose :attr:`params` are
    :func:`init_params`' dict. Two TinyLMs are equal when their configs are (their
    forwards are the same function of ``params``), so engines of one architecture share
    compiled steps whatever the weights.
    """

    def __init__(self, config: ModelConfig, *, seed: int = 0, name: str = "tiny") -> None:
        self.config = config
        self.name = name
        self.params: Params = init_params(config, seed)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TinyLM) and type(other) is type(self) and other.config == self.config

    def __hash__(self) -> int:
        return hash((type(self), self.config))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        """The cache spec of every layer (:meth:`ModelConfig.layer_specs`)."""
        return self.config.layer_specs()

    def partition_specs(self) -> dict[str, PartitionSpec]:
        """:attr:`params`' partition specs (column- and row-parallel projections on
        :data:`~jaxkv.device.mesh.MODEL_AXIS`, the rest replicated; see :func:`weight_table`)."""
        return {name: weight.partition for name, weight in weight_table(self.config).items()}

    # Layers -----------------------------------------------------------------------

    def attention_shape(self, index: int) -> AttentionShape:
        """Heads, scale, window and soft cap of attention layer ``index``."""
        c = self.config
        return AttentionShape(
            c.num_heads, c.num_kv_heads, c.head_dim, 1 / math.sqrt(c.head_dim), c.windows[index], c.attn_soft_cap
        )

    def _norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        return layers.rms_norm(x, weight, NORM_EPS)

    def _qkv(
        self, params: Params, index: int, x: jax.Array, positions: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q ``(..., T, QH, D)``, k and v ``(..., T, KVH, D)`` of attention layer ``index``,
        QK-normed if the model is, then rotated (a local RoPE base in window layers)."""
        c = self.config
        theta = c.rope_theta if c.windows[index] is None else c.local_rope_theta
        return layers.qkv(
            x,
            params,
            f"{c.layer_names[index]}.self_attn",
            self.attention_shape(index),
            Rope.from_config({"rope_theta": theta}, c.head_dim),
            positions,
            norm_eps=NORM_EPS if c.qk_norm else None,
        )

    def _delta_inputs(self, params: Params, p: str, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The convolution's input ``[q | k | v] (..., C)``, and per token and head the log
        decay ``g < 0`` and the step ``beta``, float32."""
        raw = layers.linear(x, params[f"{p}.decay_proj.weight"]).astype(jnp.float32) + params[f"{p}.dt_bias"]
        decay = -jnp.exp(params[f"{p}.A_log"]) * jax.nn.softplus(raw)
        beta = jax.nn.sigmoid(layers.linear(x, params[f"{p}.beta_proj.weight"]).astype(jnp.float32))
        return layers.linear(x, params[f"{p}.qkv_proj.weight"]), decay, beta

    def _delta_output(self, params: Params, p: str, x: jax.Array, out: jax.Array) -> jax.Array:
        """Gated RMSNorm ``norm(out) * silu(z)`` of the heads' outputs ``(..., H, dv)``, then ``out_proj``."""
        c = self.config
        gate = layers.linear(x, params[f"{p}.z_proj.weight"]).reshape(*x.shape[:-1], c.delta_heads, c.delta_value_dim)
        gated = self._norm(out.astype(x.dtype), params[f"{p}.norm.weight"]) * jax.nn.silu(gate)
        return layers.linear(gated.reshape(*x.shape[:-1], -1), params[f"{p}.out_proj.weight"])

    def _layers(self, params: Params, x: jax.Array, attend: Mixer, recur: Mixer) -> jax.Array:
        """Every decoder layer: pre-norm token mixer then pre-norm gated MLP, with residuals
        (each block's output normed first when the model has Gemma's post-norms)."""
        c = self.config
        for i, p in enumerate(c.layer_names):
            mix = recur if c.is_recurrent(i) else attend
            out = mix(i, self._norm(x, params[f"{p}.input_layernorm.weight"]))
            if c.post_norms:
                x = x + self._norm(out, params[f"{p}.post_attention_layernorm.weight"])
                h = self._norm(x, params[f"{p}.pre_feedforward_layernorm.weight"])
                x = x + self._norm(
                    layers.gated_mlp(h, params, f"{p}.mlp", c.activation),
                    params[f"{p}.post_feedforward_layernorm.weight"],
                )
            else:
                x = x + out
                h = self._norm(x, params[f"{p}.post_attention_layernorm.weight"])
                x = x + layers.gated_mlp(h, params, f"{p}.mlp", c.activation)
        return x

    def _embed(self, params: Params, tokens: jax.Array) -> jax.Array:
        x = params["embed_tokens.weight"][tokens]
        return x * math.sqrt(self.config.hidden_size) if self.config.scale_embeddings else x

    def _logits(self, params: Params, x: jax.Array) -> jax.Array:
        logits = layers.linear(self._norm(x, params["norm.weight"]), params["lm_head.weight"]).astype(jnp.float32)
        return layers.soft_cap(logits, self.config.final_soft_cap)

    # Forwards ---------------------------------------------------------------------

    def dense(self, params: Params, tokens: jax.Array) -> jax.Array:
        """Logits ``(B, L, vocab)`` of whole sequences ``tokens (B, L)`` from position 0 and
        zero state, no cache: the oracle of :meth:`forward`."""
        c = self.config
        positions = jnp.arange(tokens.shape[1])

        def attend(index: int, x: jax.Array) -> jax.Array:
            out = layers.dense_attention(*self._qkv(params, index, x, positions), self.attention_shape(index))
            return layers.output(out, params, f"{c.layer_names[index]}.self_attn")

        def recur(index: int, x: jax.Array) -> jax.Array:
            p = f"{c.layer_names[index]}.linear_attn"
            mixed, decay, beta = self._delta_inputs(params, p, x)
            out = dense_delta_net(mixed, decay, beta, params[f"{p}.conv.weight"], c.delta_heads, c.delta_key_dim)
            return self._delta_output(params, p, x, out)

        return self._logits(params, self._layers(params, self._embed(params, tokens), attend, recur))

    def forward(
        self, params: Params, cache: KVCache | HybridCache, meta: StepMetadata, *, impl: str | None = None
    ) -> tuple[jax.Array, KVCache | HybridCache]:
        """Float32 logits ``(S, vocab)`` at ``meta.logits_indices`` of a ragged batch, and the updated cache.

        Each layer finds its KV cache group in ``meta`` by its name; ``impl`` picks the
        :mod:`jaxkv.device.ops` implementation (None: the current setting). A model with
        recurrent layers takes a :class:`HybridCache`, each Gated DeltaNet resuming every
        sequence from its state (``meta.states_of(layer)``).
        """
        c = self.config
        recurrent = any(c.recurrent)
        if isinstance(cache, HybridCache) != recurrent:
            kind = "with" if recurrent else "without"
            raise ModelConfigError(f"a model {kind} recurrent layers got a {type(cache).__name__}")
        state: dict[str, KVCache | HybridCache] = {"cache": cache}
        owner = seq_of_token(meta.cu_q_lens, meta.num_seqs, meta.input_ids.shape[0])

        def attend(index: int, x: jax.Array) -> jax.Array:
            name = c.layer_names[index]
            q, k, v = self._qkv(params, index, x, meta.positions)
            cache = state["cache"]
            kv = cache.kv if isinstance(cache, HybridCache) else cache
            out, kv = layers.paged_attention(q, k, v, kv, name, meta, self.attention_shape(index), impl)
            state["cache"] = dataclasses.replace(cache, kv=kv) if isinstance(cache, HybridCache) else kv
            return layers.output(out, params, f"{name}.self_attn")

        def recur(index: int, x: jax.Array) -> jax.Array:
            name, p = c.layer_names[index], f"{c.layer_names[index]}.linear_attn"
            hybrid = state["cache"]
            assert isinstance(hybrid, HybridCache)
            rows = meta.states_of(name)
            conv, recurrent_state = read_layer_state(hybrid, name, rows)
            mixed, decay, beta = self._delta_inputs(params, p, x)
            out, conv, recurrent_state = ragged_delta_net(
                mixed,
                decay,
                beta,
                params[f"{p}.conv.weight"],
                owner,
                conv,
                recurrent_state,
                c.delta_heads,
                c.delta_key_dim,
            )
            state["cache"] = write_layer_state(hybrid, name, rows, (conv, recurrent_state))
            return self._delta_output(params, p, x, out)

        x = self._layers(params, self._embed(params, meta.input_ids), attend, recur)
        return self._logits(params, x[meta.logits_indices]), state["cache"]


def dense_greedy_generate(model: DenseModel, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` by ``model.dense`` (a
    :class:`~jaxkv.models.protocol.DenseModel`): the oracle of the engine.

    Recomputes every sequence in full each step, padded to one length (a multiple of
    64), so it compiles once per call.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ModelConfigError("dense_greedy_generate needs non-empty prompts")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ModelConfigError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    lengths = np.array([len(p) for p in prompts])
    width = -(-int(lengths.max() + max_new_tokens) // 64) * 64
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, prompt in zip(tokens, prompts, strict=True):
        row[: len(prompt)] = prompt

    @jax.jit
    def next_tokens(params: Any, tokens: jax.Array, last: jax.Array) -> jax.Array:
        logits = model.dense(params, tokens)
        return jnp.argmax(logits[jnp.arange(tokens.shape[0]), last], axis=-1).astype(jnp.int32)

    params = model.params
    for _ in range(max_new_tokens):
        new = np.asarray(next_tokens(params, tokens, lengths - 1))
        tokens[np.arange(len(prompts)), lengths] = new
        lengths += 1
    return [tokens[i, len(p) : len(p) + max_new_tokens].tolist() for i, p in enumerate(prompts)]
