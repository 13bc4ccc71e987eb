"""Gated DeltaNet (the linear-attention layer of Qwen3-Next), as pure JAX functions.

Per head, the state ``S (dk, dv)`` follows the gated delta rule: with ``q``, ``k``
L2-normalised, ``alpha = exp(g)`` (``g < 0``: a decay) and ``beta`` in (0, 1),

    S_t = alpha_t * S_{t-1} + k_t (beta_t * (v_t - alpha_t * S_{t-1}^T k_t))^T,    o_t = S_t^T q_t,

i.e. decay the state, then move the value stored under key ``k_t`` a step ``beta_t``
toward ``v_t``. Before it, the q/k/v projections pass a short causal depthwise
convolution (kernel ``K``) with SiLU, whose state is the last ``K - 1`` inputs.

Two forms of the same recurrence:

- :func:`dense_delta_net`: whole sequences from zero state (the oracle: the
  convolution over zero-padded inputs, a scan over time);
- :func:`ragged_delta_net`: a serving step's packed tokens of several sequences
  (decodes first, then prefill chunks), each resuming from its own conv and recurrent
  state and returning the states after its last token; padding tokens change nothing.
  One scan over the packed tokens updates the owning sequence's state at each token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / |x|`` over the last axis (in float32)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def delta_rule_step(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, decay: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token: ``state (H, dk, dv)``, ``q``/``k (H, dk)`` (normalised), ``v (H, dv)``,
    ``decay``/``beta (H,)``; returns the new state and the output ``(H, dv)``, float32."""
    state = state * jnp.exp(decay)[:, None, None]
    stored = jnp.einsum("hk,hkv->hv", k, state, precision=_HIGHEST)
    update = beta[:, None] * (v - stored)
    state = state + jnp.einsum("hk,hv->hkv", k, update, precision=_HIGHEST)
    return state, jnp.einsum("hk,hkv->hv", q, state, precision=_HIGHEST)


def _split_heads(mixed: jax.Array, num_heads: int, key_dim: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Conv outputs ``(..., H*(2dk+dv))`` -> normalised, scaled q, normalised k, v per head."""
    q, k, v = jnp.split(mixed, [num_heads * key_dim, 2 * num_heads * key_dim], axis=-1)
    lead = mixed.shape[:-1]
    q = l2_normalize(q.reshape(*lead, num_heads, key_dim)) * key_dim**-0.5
    k = l2_normalize(k.reshape(*lead, num_heads, key_dim))
    return q, k, v.reshape(*lead, num_heads, -1).astype(jnp.float32)


def dense_delta_net(
    mixed: jax.Array, decay: jax.Array, beta: jax.Array, conv_weight: jax.Array, num_heads: int, key_dim: int
) -> jax.Array:
    """Outputs ``(B, L, H, dv)`` of whole sequences from zero state.

    ``mixed (B, L, C)``: the q/k/v projections before the convolution; ``decay``,
    ``beta (B, L, H)``; ``conv_weight (K, C)``.
    """
    kernel = conv_weight.shape[0]
    padded = jnp.pad(mixed, ((0, 0), (kernel - 1, 0), (0, 0)))
    length = mixed.shape[1]
    weight = conv_weight.astype(jnp.float32)
    conv = sum(padded[:, i : i + length].astype(jnp.float32) * weight[i] for i in range(kernel))
    q, k, v = _split_heads(jax.nn.silu(conv).astype(mixed.dtype), num_heads, key_dim)
    value_dim = v.shape[-1]

    def one_sequence(q, k, v, decay, beta):
        def step(state, inputs):
            return delta_rule_step(state, *inputs)

        init = jnp.zeros((num_heads, key_dim, value_dim), jnp.float32)
        _, out = jax.lax.scan(step, init, (q, k, v, decay.astype(jnp.float32), beta.astype(jnp.float32)))
        return out

    return jax.vmap(one_sequence)(q, k, v, decay, beta)


def ragged_delta_net(
    mixed: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    conv_weight: jax.Array,
    seq_of_token: jax.Array,
    conv_state: jax.Array,
    recurrent_state: jax.Array,
    num_heads: int,
    key_dim: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One serving step: outputs ``(T, H, dv)`` and the sequences' states after it.

    ``mixed (T, C)``, ``decay``/``beta (T, H)`` of the packed tokens; ``seq_of_token (T,)``
    the sequence of each token, ``S`` (one past the last) for padding; ``conv_state
    (S, K-1, C)`` and ``recurrent_state (S, H, dk, dv)`` each sequence's states before
    the step (zeros for a fresh one). Returns the outputs and both states after the step.
    """
    num_seqs = conv_state.shape[0]
    # A scratch row S takes the padding tokens' updates, so real rows never see them.
    conv_rows = jnp.concatenate([conv_state, jnp.zeros_like(conv_state[:1])])
    state_rows = jnp.concatenate([recurrent_state, jnp.zeros_like(recurrent_state[:1])])

    def step(carry, inputs):
        conv_rows, state_rows = carry
        x, decay, beta, seq = inputs
        window = jnp.concatenate([conv_rows[seq], x[None].astype(conv_rows.dtype)])
        conv = jnp.sum(window.astype(jnp.float32) * conv_weight.astype(jnp.float32), axis=0)
        q, k, v = _split_heads(jax.nn.silu(conv).astype(mixed.dtype), num_heads, key_dim)
        state, out = delta_rule_step(state_rows[seq], q, k, v, decay.astype(jnp.float32), beta.astype(jnp.float32))
        carry = (conv_rows.at[seq].set(window[1:]), state_rows.at[seq].set(state))
        return carry, out

    (conv_rows, state_rows), out = jax.lax.scan(step, (conv_rows, state_rows), (mixed, decay, beta, seq_of_token))
    return out, conv_rows[:num_seqs], state_rows[:num_seqs]


def seq_of_token(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int) -> jax.Array:
    """``(T,)`` index of the sequence owning each packed token; ``S`` for padding tokens."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    owner = jnp.searchsorted(cu_q_lens[1:], tokens, side="right").astype(jnp.int32)
    max_seqs = cu_q_lens.shape[0] - 1
    return jnp.where(tokens < cu_q_lens[num_seqs[0]], owner, max_seqs)
