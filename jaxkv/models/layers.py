"""Pure-JAX pieces every model shares (the checkpoint architectures and the tiny test
models): norms, rotary embeddings, projections, gated MLPs and attention (dense, or paged
through :mod:`jaxkv.device.ops`).

Weights are plain arrays in the checkpoint's own layout (a projection's weight is
``(out, in)``, as Hugging Face stores it); every function is pure. Float32 models
multiply at full precision (GPUs would otherwise run float32 matmuls in TF32).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.device import ops
from jaxkv.device.cache import KVCache
from jaxkv.device.metadata import StepMetadata
from jaxkv.errors import JaxkvError

_HIGHEST = jax.lax.Precision.HIGHEST

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
}
"""Hugging Face activation names (``hidden_act`` / ``hidden_activation``) to functions."""


class UnsupportedConfigError(JaxkvError, ValueError):
    """A checkpoint config asks for something these layers do not build (named in the message)."""


def precision(dtype: Any) -> jax.lax.Precision | None:
    """Full precision for float32 weights, the backend's default for narrower ones."""
    return _HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weight.T (+ bias)`` for a Hugging Face ``(out, in)`` weight."""
    y = jnp.einsum("...i,oi->...o", x, weight, precision=precision(weight.dtype))
    return y if bias is None else y + bias


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, *, unit_offset: bool = False) -> jax.Array:
    """RMSNorm over the last axis, computed in float32.

    ``unit_offset``: Gemma's form, scaled by ``1 + weight`` in float32 and then cast;
    otherwise Llama's, cast first and then scaled by ``weight``.
    """
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def activation(name: str) -> Any:
    """The function of a Hugging Face activation name; :class:`UnsupportedConfigError` if unknown."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedConfigError(f"unknown activation {name!r}; valid: {', '.join(ACTIVATIONS)}") from None


def gated_mlp(x: jax.Array, params: Mapping[str, jax.Array], prefix: str, act: str) -> jax.Array:
    """``down(act(gate(x)) * up(x))`` from ``{prefix}.gate_proj.weight`` etc. (SwiGLU, GeGLU)."""
    gate = linear(x, params[f"{prefix}.gate_proj.weight"])
    up = linear(x, params[f"{prefix}.up_proj.weight"])
    return linear(activation(act)(gate) * up, params[f"{prefix}.down_proj.weight"])


@dataclass(frozen=True)
class Rope:
    """Rotary embedding of one layer kind: its inverse frequencies and how many dims rotate.

    Built from a Hugging Face ``rope_parameters`` dict by :meth:`from_config`; the first
    ``rotary_dim`` dims of a head rotate (rotate-half form), the rest pass through
    (partial rotary).
    """

    inv_freq: tuple[float, ...]
    rotary_dim: int

    @classmethod
    def from_config(cls, parameters: Mapping[str, Any], head_dim: int) -> Rope:
        """Frequencies for ``rope_type`` ``default``, ``linear`` or ``llama3`` (Llama-3.1 scaling)."""
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        rotary_dim = int(head_dim * parameters.get("partial_rotary_factor", 1.0))
        theta = float(parameters["rope_theta"])
        inv_freq = [theta ** (-i / rotary_dim) for i in range(0, rotary_dim, 2)]
        if rope_type == "linear":
            inv_freq = [f / parameters["factor"] for f in inv_freq]
        elif rope_type == "llama3":
            inv_freq = _llama3_frequencies(inv_freq, parameters)
        elif rope_type != "default":
            raise UnsupportedConfigError(f"rope_type {rope_type!r} is not built; built: default, linear, llama3")
        return cls(tuple(inv_freq), rotary_dim)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x (..., T, heads, D)`` rotated at ``positions (T,)``."""
        freqs = jnp.asarray(self.inv_freq, jnp.float32)
        angles = positions.astype(jnp.float32)[:, None] * freqs
        cos = jnp.cos(angles)[:, None, :].astype(x.dtype)
        sin = jnp.sin(angles)[:, None, :].astype(x.dtype)
        half = self.rotary_dim // 2
        x1, x2, rest = x[..., :half], x[..., half : self.rotary_dim], x[..., self.rotary_dim :]
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _llama3_frequencies(inv_freq: list[float], parameters: Mapping[str, Any]) -> list[float]:
    """Llama-3.1's frequency scaling: long wavelengths divided by ``factor``, short ones kept,
    a smooth blend between (by wavelength against the original context length)."""
    factor = parameters["factor"]
    low, high = parameters["low_freq_factor"], parameters["high_freq_factor"]
    context = parameters["original_max_position_embeddings"]
    scaled = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < context / high:
            scaled.append(f)
        elif wavelen > context / low:
            scaled.append(f / factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * f / factor + smooth * f)
    return scaled


@dataclass(frozen=True)
class AttentionShape:
    """Head counts and scale of one attention layer (``window``: None for full attention)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sm_scale: float
    window: int | None = None
    soft_cap: float | None = None


def qkv(
    x: jax.Array,
    params: Mapping[str, jax.Array],
    prefix: str,
    shape: AttentionShape,
    rope: Rope,
    positions: jax.Array,
    *,
    norm_eps: float | None = None,
    unit_offset: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q ``(..., T, QH, D)``, k and v ``(..., T, KVH, D)`` of ``{prefix}.{q,k,v}_proj``, with
    the per-head q/k norms (``{prefix}.q_norm.weight``) when ``norm_eps`` is given, then RoPE."""
    lead = x.shape[:-1]

    def project(name: str, heads: int) -> jax.Array:
        out = linear(x, params[f"{prefix}.{name}.weight"], params.get(f"{prefix}.{name}.bias"))
        return out.reshape(*lead, heads, shape.head_dim)

    q, k, v = (
        project("q_proj", shape.num_heads),
        project("k_proj", shape.num_kv_heads),
        project("v_proj", shape.num_kv_heads),
    )
    if norm_eps is not None:
        q = rms_norm(q, params[f"{prefix}.q_norm.weight"], norm_eps, unit_offset=unit_offset)
        k = rms_norm(k, params[f"{prefix}.k_norm.weight"], norm_eps, unit_offset=unit_offset)
    return rope(q, positions), rope(k, positions), v


def output(out: jax.Array, params: Mapping[str, jax.Array], prefix: str) -> jax.Array:
    """``{prefix}.o_proj`` of the heads' outputs ``(..., T, QH, D)``."""
    flat = out.reshape(*out.shape[:-2], -1)
    return linear(flat, params[f"{prefix}.o_proj.weight"], params.get(f"{prefix}.o_proj.bias"))


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """``cap * tanh(x / cap)``, or ``x`` when ``cap`` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, shape: AttentionShape) -> jax.Array:
    """Causal (and window-masked) attention of whole sequences from position 0, float32:
    q ``(B, L, QH, D)``, k and v ``(B, L, KVH, D)``; out ``(B, L, QH, D)`` in q's dtype."""
    length = q.shape[1]
    groups = shape.num_heads // shape.num_kv_heads
    positions = jnp.arange(length)
    q = q.reshape(*q.shape[:2], shape.num_kv_heads, groups, shape.head_dim).astype(jnp.float32)
    logits = jnp.einsum("blhgd,bmhd->bhglm", q, k.astype(jnp.float32), precision=_HIGHEST)
    logits = soft_cap(logits * shape.sm_scale, shape.soft_cap)
    mask = positions[None, :] <= positions[:, None]
    if shape.window is not None:
        mask &= positions[None, :] > positions[:, None] - shape.window
    probs = jax.nn.softmax(jnp.where(mask, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bhglm,bmhd->blhgd", probs, v.astype(jnp.float32), precision=_HIGHEST)
    return out.reshape(*out.shape[:2], shape.num_heads, shape.head_dim).astype(v.dtype)


def paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: KVCache,
    layer: str,
    meta: StepMetadata,
    shape: AttentionShape,
    impl: str | None,
) -> tuple[jax.Array, KVCache]:
    """Attention of a ragged batch through the paged KV cache: ``layer``'s new k and v
    ``(T, KVH, D)`` written where ``meta`` says, then q ``(T, QH, D)`` attending over its
    pages (the cache supplies the window); out ``(T, QH, D)`` and the updated cache."""
    cache = ops.write_kv(cache, layer, k, v, meta, impl=impl)
    out = ops.paged_attention(q, cache, layer, meta, sm_scale=shape.sm_scale, soft_cap=shape.soft_cap, impl=impl)
    return out, cache
