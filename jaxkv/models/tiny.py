"""Tiny Flax NNX decoder models with seeded random weights, paged and dense.

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

Every model has two forwards over the same weights:

- :meth:`TinyLM.forward` (the :class:`~jaxkv.models.protocol.ServedModel` step): a
  ragged batch (decodes first, then prefill chunks) against the paged KV cache; each
  attention layer writes its new K/V with :func:`jaxkv.device.ops.write_kv` and attends with
  :func:`jaxkv.device.ops.paged_attention` by its name, the cache and the step metadata
  supplying its window and block table;
- :meth:`TinyLM.dense`: plain causal attention over whole sequences (window-masked in
  window layers) and the delta rule from zero state, no cache: the correctness oracle
  of the paged path.

Tensor parallelism (Megatron-style): the weights carry Flax NNX sharding annotations
over the mesh axis :data:`MODEL_AXIS`: the attention q/k/v and MLP gate/up projections
are column-parallel (split by output features, so each device computes whole heads of
its own KV heads), the attention and MLP output projections row-parallel (split by
input features; XLA sums the partial products). Embeddings, norms, the LM head and the
Gated DeltaNet layers are replicated. The annotations are metadata only (no mesh is
needed to build a model); :mod:`jaxkv.device.mesh` places the weights.

Layer ``i`` is named ``layers.<i>``, as in :mod:`jaxkv.presets`, so
``plan_kv_cache(config.layer_specs(), ...)`` plans the cache the model reads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.device import ops
from jaxkv.device.cache import KVCache
from jaxkv.device.mesh import MODEL_AXIS
from jaxkv.device.metadata import StepMetadata
from jaxkv.device.state_cache import HybridCache, read_layer_state, write_layer_state
from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int
from jaxkv.models.delta_net import dense_delta_net, ragged_delta_net, seq_of_token
from jaxkv.models.protocol import DenseModel
from jaxkv.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

_HIGHEST = jax.lax.Precision.HIGHEST
"""The mesh axis name in the weights' sharding annotations (a runner maps it to its mesh's axis)."""
COLUMN_PARALLEL = (None, MODEL_AXIS)
"""A ``(in, out)`` kernel split by output features."""
ROW_PARALLEL = (MODEL_AXIS, None)
"""A ``(in, out)`` kernel split by input features."""
ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu}
DTYPES = ("float32", "bfloat16")


class ModelConfigError(JaxkvError, ValueError):
    """A model config, name or input that cannot describe or drive a model."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a :class:`TinyLM`.

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
        if self.activation not in ACTIVATIONS:
            raise ModelConfigError(f"unknown activation {self.activation!r}; valid: {', '.join(ACTIVATIONS)}")
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
        activation="gelu",
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


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of ``x (..., T, heads, D)`` at ``positions (T,)`` (rotate-half form)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)``, or ``x`` when ``cap`` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def _matmul_precision(dtype: str) -> jax.lax.Precision | None:
    """Full precision for float32 models (GPUs default fp32 matmuls to TF32, which
    breaks the fp32 promise: identical tokens with and without the cache), the
    backend's default for narrower dtypes."""
    return _HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _linear(
    din: int, dout: int, dtype: str, rngs: nnx.Rngs, sharding: tuple[str | None, ...] | None = None
) -> nnx.Linear:
    """A bias-free projection; ``sharding`` (:data:`COLUMN_PARALLEL`, :data:`ROW_PARALLEL`)
    annotates its kernel, unplaced (no mesh needed here), or None: replicated."""
    init = nnx.initializers.lecun_normal()
    if sharding is not None:
        init = nnx.with_partitioning(init, sharding, eager_sharding=False)
    return nnx.Linear(
        din,
        dout,
        use_bias=False,
        dtype=dtype,
        param_dtype=dtype,
        precision=_matmul_precision(dtype),
        kernel_init=init,
        rngs=rngs,
    )


def _norm(dim: int, dtype: str, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(dim, epsilon=1e-6, dtype=dtype, param_dtype=dtype, rngs=rngs)


class Attention(nnx.Module):
    """One attention layer: projections, optional QK-norm, RoPE, then paged or dense attention."""

    def __init__(self, config: ModelConfig, index: int, rngs: nnx.Rngs) -> None:
        c = config
        self.name = c.layer_names[index]
        self.window = c.windows[index]
        self.theta = c.rope_theta if self.window is None else c.local_rope_theta
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.logit_cap = c.attn_soft_cap
        self.sm_scale = 1.0 / math.sqrt(c.head_dim)
        self.q_proj = _linear(c.hidden_size, c.num_heads * c.head_dim, c.dtype, rngs, COLUMN_PARALLEL)
        self.k_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.dtype, rngs, COLUMN_PARALLEL)
        self.v_proj = _linear(c.hidden_size, c.num_kv_heads * c.head_dim, c.dtype, rngs, COLUMN_PARALLEL)
        self.o_proj = _linear(c.num_heads * c.head_dim, c.hidden_size, c.dtype, rngs, ROW_PARALLEL)
        self.q_norm = _norm(c.head_dim, c.dtype, rngs) if c.qk_norm else None
        self.k_norm = _norm(c.head_dim, c.dtype, rngs) if c.qk_norm else None

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q ``(..., T, QH, D)``, k and v ``(..., T, H, D)`` with RoPE applied to q and k."""
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q, positions, self.theta), rope(k, positions, self.theta), v

    def paged(self, x: jax.Array, cache: KVCache, meta: StepMetadata, impl: str | None) -> tuple[jax.Array, KVCache]:
        """``x (T, hidden)`` of a ragged batch; writes this step's K/V, then attends through
        the cache (which supplies this layer's window and block table)."""
        q, k, v = self._qkv(x, meta.positions)
        cache = ops.write_kv(cache, self.name, k, v, meta, impl=impl)
        out = ops.paged_attention(q, cache, self.name, meta, sm_scale=self.sm_scale, soft_cap=self.logit_cap, impl=impl)
        return self.o_proj(out.reshape(x.shape[0], -1)), cache

    def dense(self, x: jax.Array) -> jax.Array:
        """``x (B, L, hidden)`` of whole sequences from position 0: causal (and window) masked."""
        length = x.shape[1]
        positions = jnp.arange(length, dtype=jnp.int32)
        q, k, v = self._qkv(x, positions)
        num_queries_per_kv = self.num_heads // self.num_kv_heads
        q = q.reshape(*q.shape[:2], self.num_kv_heads, num_queries_per_kv, self.head_dim).astype(jnp.float32)
        logits = jnp.einsum("blhgd,bmhd->bhglm", q, k.astype(jnp.float32), precision=_HIGHEST)
        logits = soft_cap(logits * self.sm_scale, self.logit_cap)
        mask = positions[None, :] <= positions[:, None]
        if self.window is not None:
            mask &= positions[None, :] > positions[:, None] - self.window
        probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
        out = jnp.einsum("bhglm,bmhd->blhgd", probs, v.astype(jnp.float32), precision=_HIGHEST)
        return self.o_proj(out.reshape(*x.shape[:2], -1).astype(x.dtype))


class GatedDeltaNet(nnx.Module):
    """One Gated DeltaNet layer: projections, causal conv + delta rule, gated RMSNorm, output."""

    def __init__(self, config: ModelConfig, index: int, rngs: nnx.Rngs) -> None:
        c = config
        self.name = c.layer_names[index]
        self.num_heads, self.key_dim, self.value_dim = c.delta_heads, c.delta_key_dim, c.delta_value_dim
        self.qkv_proj = _linear(c.hidden_size, c.conv_dim, c.dtype, rngs)
        scale = c.conv_kernel**-0.5
        self.conv_weight = nnx.Param(
            (jax.random.normal(rngs.params(), (c.conv_kernel, c.conv_dim)) * scale).astype(c.dtype)
        )
        self.decay_proj = _linear(c.hidden_size, c.delta_heads, c.dtype, rngs)
        self.beta_proj = _linear(c.hidden_size, c.delta_heads, c.dtype, rngs)
        # Per-head decay rates in [1, 16] (as Mamba-2 initialises A) and a time-step bias.
        self.a_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, c.delta_heads)).astype(jnp.float32))
        self.dt_bias = nnx.Param(jnp.full((c.delta_heads,), -2.0, jnp.float32))
        self.gate_proj = _linear(c.hidden_size, c.delta_heads * c.delta_value_dim, c.dtype, rngs)
        self.out_norm = _norm(c.delta_value_dim, c.dtype, rngs)
        self.o_proj = _linear(c.delta_heads * c.delta_value_dim, c.hidden_size, c.dtype, rngs)

    def _gates(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per token and head: the log decay ``g < 0`` and the step ``beta``, float32."""
        raw = self.decay_proj(x).astype(jnp.float32) + self.dt_bias[...]
        decay = -jnp.exp(self.a_log[...]) * jax.nn.softplus(raw)
        return decay, jax.nn.sigmoid(self.beta_proj(x).astype(jnp.float32))

    def _output(self, x: jax.Array, out: jax.Array) -> jax.Array:
        """Gated RMSNorm of the heads' outputs ``(..., H, dv)``, then the output projection."""
        gate = self.gate_proj(x).reshape(*x.shape[:-1], self.num_heads, self.value_dim)
        out = self.out_norm(out.astype(x.dtype)) * jax.nn.silu(gate)
        return self.o_proj(out.reshape(*x.shape[:-1], -1))

    def paged(self, x: jax.Array, cache: HybridCache, meta: StepMetadata) -> tuple[jax.Array, HybridCache]:
        """``x (T, hidden)`` of a ragged batch: each sequence resumes from its state (zeros
        when fresh) and its state after the step is written where it goes (a row or a unit)."""
        group = meta.states_of(self.name)
        conv, state = read_layer_state(cache, self.name, group)
        decay, beta = self._gates(x)
        owner = seq_of_token(meta.cu_q_lens, meta.num_seqs, x.shape[0])
        out, conv, state = ragged_delta_net(
            self.qkv_proj(x), decay, beta, self.conv_weight[...], owner, conv, state, self.num_heads, self.key_dim
        )
        cache = write_layer_state(cache, self.name, group, (conv, state))
        return self._output(x, out), cache

    def dense(self, x: jax.Array) -> jax.Array:
        """``x (B, L, hidden)`` of whole sequences from zero state."""
        decay, beta = self._gates(x)
        out = dense_delta_net(self.qkv_proj(x), decay, beta, self.conv_weight[...], self.num_heads, self.key_dim)
        return self._output(x, out)


class MLP(nnx.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU with silu, GeGLU with gelu)."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        c = config
        self.act = c.activation
        self.gate = _linear(c.hidden_size, c.mlp_dim, c.dtype, rngs, COLUMN_PARALLEL)
        self.up = _linear(c.hidden_size, c.mlp_dim, c.dtype, rngs, COLUMN_PARALLEL)
        self.down = _linear(c.mlp_dim, c.hidden_size, c.dtype, rngs, ROW_PARALLEL)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(ACTIVATIONS[self.act](self.gate(x)) * self.up(x))


class DecoderLayer(nnx.Module):
    """Pre-norm attention (or Gated DeltaNet) and MLP blocks with residuals (plus Gemma's
    post-norms if set)."""

    def __init__(self, config: ModelConfig, index: int, rngs: nnx.Rngs) -> None:
        c = config
        self.attn_norm = _norm(c.hidden_size, c.dtype, rngs)
        recurrent = c.is_recurrent(index)
        self.attn = None if recurrent else Attention(c, index, rngs)
        self.delta = GatedDeltaNet(c, index, rngs) if recurrent else None
        self.mlp_norm = _norm(c.hidden_size, c.dtype, rngs)
        self.mlp = MLP(c, rngs)
        self.post_attn_norm = _norm(c.hidden_size, c.dtype, rngs) if c.post_norms else None
        self.post_mlp_norm = _norm(c.hidden_size, c.dtype, rngs) if c.post_norms else None

    def _residual(self, x: jax.Array, out: jax.Array, post_norm: nnx.RMSNorm | None) -> jax.Array:
        return x + (out if post_norm is None else post_norm(out))

    @property
    def mixer(self) -> Attention | GatedDeltaNet:
        """The layer's token mixer: its delta net when recurrent, else its attention."""
        if self.delta is not None:
            return self.delta
        if self.attn is None:
            raise ModelConfigError("a decoder layer has neither attention nor a delta net")
        return self.attn

    def paged(self, x: jax.Array, cache: KVCache, meta: StepMetadata, impl: str | None) -> tuple[jax.Array, KVCache]:
        if self.attn is None:
            raise ModelConfigError(f"recurrent layer {self.mixer.name!r} has no KV cache pages")
        out, cache = self.attn.paged(self.attn_norm(x), cache, meta, impl)
        return self._mlp_block(self._residual(x, out, self.post_attn_norm)), cache

    def recurrent(self, x: jax.Array, cache: HybridCache, meta: StepMetadata) -> tuple[jax.Array, HybridCache]:
        if self.delta is None:
            raise ModelConfigError(f"attention layer {self.mixer.name!r} has no recurrent state")
        out, cache = self.delta.paged(self.attn_norm(x), cache, meta)
        return self._mlp_block(self._residual(x, out, self.post_attn_norm)), cache

    def _mlp_block(self, x: jax.Array) -> jax.Array:
        return self._residual(x, self.mlp(self.mlp_norm(x)), self.post_mlp_norm)

    def dense(self, x: jax.Array) -> jax.Array:
        return self._mlp_block(self._residual(x, self.mixer.dense(self.attn_norm(x)), self.post_attn_norm))


class TinyLM(nnx.Module):
    """A decoder-only LM built from a :class:`ModelConfig`, weights drawn from ``seed``.

    A :class:`~jaxkv.models.protocol.ServedModel`: :attr:`params` is its ``nnx.State``,
    :meth:`forward` merges it into the module's graph, and :meth:`partition_specs` reads
    the weights' NNX sharding annotations. Two TinyLMs are equal when their configs are
    (their forwards are the same function of ``params``), so engines of one architecture
    share compiled steps whatever the weights.
    """

    def __init__(self, config: ModelConfig, *, seed: int = 0, name: str = "tiny") -> None:
        c = config
        rngs = nnx.Rngs(seed)
        self.config = c
        self.name = name
        self.embed = nnx.Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(c, i, rngs) for i in range(c.num_layers)])
        self.final_norm = _norm(c.hidden_size, c.dtype, rngs)
        self.lm_head = _linear(c.hidden_size, c.vocab_size, c.dtype, rngs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TinyLM) and type(other) is type(self) and other.config == self.config

    def __hash__(self) -> int:
        return hash((type(self), self.config))

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def params(self) -> nnx.State:
        """Every weight of the module (its ``nnx.State``)."""
        return nnx.state(self)

    def layer_specs(self) -> dict[str, KVCacheSpec]:
        """The cache spec of every layer (:meth:`ModelConfig.layer_specs`)."""
        return self.config.layer_specs()

    def partition_specs(self) -> nnx.State:
        """:attr:`params`' partition specs from the NNX annotations (column- and row-parallel
        projections on :data:`MODEL_AXIS`, the rest replicated)."""
        return nnx.get_partition_spec(self.params)

    def forward(
        self, params: nnx.State, cache: KVCache | HybridCache, meta: StepMetadata, *, impl: str | None = None
    ) -> tuple[jax.Array, KVCache | HybridCache]:
        """:meth:`__call__` of this module's graph over ``params``."""
        module: TinyLM = nnx.merge(nnx.graphdef(self), params)
        return module(cache, meta, impl=impl)

    def dense(self, params: nnx.State, tokens: jax.Array) -> jax.Array:
        """Logits ``(B, L, vocab)`` of whole sequences ``tokens (B, L)`` over ``params``, without a cache."""
        module: TinyLM = nnx.merge(nnx.graphdef(self), params)
        return module.dense_forward(tokens)

    def _embed(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens)
        return x * math.sqrt(self.config.hidden_size) if self.config.scale_embeddings else x

    def _logits(self, x: jax.Array) -> jax.Array:
        logits = self.lm_head(self.final_norm(x)).astype(jnp.float32)
        return soft_cap(logits, self.config.final_soft_cap)

    def __call__(
        self, cache: KVCache | HybridCache, meta: StepMetadata, *, impl: str | None = None
    ) -> tuple[jax.Array, KVCache | HybridCache]:
        """Logits ``(S, vocab)`` at ``meta.logits_indices`` of a ragged batch, and the updated cache.

        Each layer finds its KV cache group in ``meta`` by its name; ``impl`` picks the
        :mod:`jaxkv.device.ops` implementation (None: the current setting). A model with
        recurrent layers takes a :class:`HybridCache`.
        """
        if isinstance(cache, HybridCache) and not (self.config.recurrent and any(self.config.recurrent)):
            raise ModelConfigError(f"a model without recurrent layers got a {type(cache).__name__}")
        x = self._embed(meta.input_ids)
        for layer in self.layers:
            if layer.delta is None:
                kv = cache.kv if isinstance(cache, HybridCache) else cache
                x, kv = layer.paged(x, kv, meta, impl)
                cache = dataclasses.replace(cache, kv=kv) if isinstance(cache, HybridCache) else kv
            elif not isinstance(cache, HybridCache):
                raise ModelConfigError(f"a model with recurrent layers got a {type(cache).__name__}")
            else:
                x, cache = layer.recurrent(x, cache, meta)
        return self._logits(x[meta.logits_indices]), cache

    def dense_forward(self, tokens: jax.Array) -> jax.Array:
        """Logits ``(B, L, vocab)`` of whole sequences ``tokens (B, L)`` by this module's weights."""
        x = self._embed(tokens)
        for layer in self.layers:
            x = layer.dense(x)
        return self._logits(x)


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
