"""Sparse mixture-of-experts: routers and the routed experts as grouped matmuls.

Each token picks ``k`` of ``E`` experts with weights (:func:`softmax_top_k`, as
Qwen3-Next routes; :func:`sigmoid_group_top_k`, as Nemotron-H and DeepSeek-V3 route).
:func:`routed_experts` then runs every (token, expert) pair exactly once: the ``T k``
pairs are sorted by expert and each expert's contiguous run goes through its own
weights in one :func:`jax.lax.ragged_dot` (group sizes = tokens per expert), so the
work is ``T k`` rows whatever ``E`` is, never a dense pass of every token through every
expert. Expert weights are stacked ``(E, in, out)``; :func:`stack_experts` stacks
checkpoints that store experts one by one, once, when the weights are loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxkv.device.mesh import MODEL_AXIS

_HIGHEST = jax.lax.Precision.HIGHEST
_EXPERT_SPLIT = {"gate_proj": 2, "up_proj": 2, "down_proj": 1}


def stacked_partition(part: str) -> PartitionSpec:
    """Where tensor parallelism splits a stacked ``(E, in, out)`` expert weight of ``part``
    (``gate_proj``, ``up_proj``, ``down_proj``): by its hidden units (``out`` of gate/up,
    ``in`` of down), as a dense MLP's."""
    return PartitionSpec(*(MODEL_AXIS if d == _EXPERT_SPLIT[part] else None for d in range(3)))


def stack_experts(
    params: Mapping[str, jax.Array], prefix: str, count: int, parts: Sequence[str]
) -> dict[str, jax.Array]:
    """``params`` with the ``count`` experts under ``prefix`` stored one by one
    (``{prefix}.{e}.{part}.weight``, each ``(out, in)`` as Hugging Face stores them)
    replaced by one stack ``{prefix}.{part}`` of ``(E, in, out)`` per part: the layout
    :func:`routed_experts` reads, so a step never restacks them. Parts already stacked
    are left as they are."""
    stacked = dict(params)
    for part in parts:
        names = [f"{prefix}.{e}.{part}.weight" for e in range(count)]
        if names[0] in stacked:
            stacked[f"{prefix}.{part}"] = jnp.stack([stacked.pop(name).T for name in names])
    return stacked


def softmax_top_k(logits: jax.Array, k: int, *, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """The ``k`` most probable experts of each token ``(T, k)`` and their softmax
    probabilities (renormalised over the ``k`` when ``normalize``), from router ``logits (T, E)``."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return experts, weights


def sigmoid_group_top_k(
    logits: jax.Array,
    k: int,
    *,
    bias: jax.Array,
    num_groups: int,
    top_groups: int,
    normalize: bool,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """Experts ``(T, k)`` and weights by sigmoid scores ``s = sigmoid(logits (T, E))``.

    Experts are chosen by ``s + bias`` within the ``top_groups`` of ``num_groups`` equal
    groups whose two best biased scores sum highest; their weights are the unbiased
    ``s``, renormalised over the ``k`` when ``normalize``, times ``scale``.
    """
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    biased = scores + bias.astype(jnp.float32)
    tokens, num_experts = biased.shape
    grouped = biased.reshape(tokens, num_groups, num_experts // num_groups)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    kept = jax.lax.top_k(group_score, top_groups)[1]
    allowed = jnp.zeros((tokens, num_groups), bool).at[jnp.arange(tokens)[:, None], kept].set(True)
    biased = jnp.where(jnp.repeat(allowed, num_experts // num_groups, axis=1), biased, -jnp.inf)
    experts = jax.lax.top_k(biased, k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return experts, weights * scale


def routed_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    up: jax.Array,
    down: jax.Array,
    activation: Callable[[jax.Array], jax.Array],
    gate: jax.Array | None = None,
) -> jax.Array:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for ``x (T, D)``.

    An expert is ``down(activation(gate(x)) * up(x))`` with ``gate (E, D, F)``, or
    ``down(activation(up(x)))`` without; ``up (E, D, F)``, ``down (E, F, D')``.
    """
    tokens, k = experts.shape
    num_experts = up.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    source = order // k  # the token of each sorted (token, expert) pair
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    rows = x[source]
    hidden = jax.lax.ragged_dot(rows, up, sizes, precision=_HIGHEST)
    if gate is None:
        hidden = activation(hidden)
    else:
        hidden = activation(jax.lax.ragged_dot(rows, gate, sizes, precision=_HIGHEST)) * hidden
    out = jax.lax.ragged_dot(hidden, down, sizes, precision=_HIGHEST)
    out = out.astype(jnp.float32) * weights.reshape(-1)[order][:, None].astype(jnp.float32)
    return jnp.zeros((tokens, down.shape[-1]), jnp.float32).at[source].add(out).astype(x.dtype)
