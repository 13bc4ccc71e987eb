"""Gated DeltaNet (the linear-attention layer of Qwen3-Next), as pure JAX functions.

Per head, the state ``S (dk, dv)`` follows the gated delta rule: with ``q``, ``k``
L2-normalised, ``alpha = exp(g)`` (``g < 0``: a decay) and ``beta`` in (0, 1),

    S_t = alpha_t * S_{t-1} + k_t (beta_t * (v_t - alpha_t * S_{t-1}^T k_t))^T,    o_t = S_t^T q_t,

i.e. decay the state, then move the value stored under key ``k_t`` a step ``beta_t``
toward ``v_t``. Before it, the q/k/v projections pass a short causal depthwise
convolution (kernel ``K``) with SiLU, whose state is the last ``K - 1`` inputs.

Two forms of the same recurrence:

- :func:`dense_delta_net` (and :func:`dense_delta_net_states`, its final states too):
  whole sequences from zero state (the oracle: the convolution over zero-padded inputs,
  a scan over time);
- :func:`ragged_delta_net`: a serving step's packed tokens of several sequences
  (decodes first, then prefill chunks), each resuming from its own conv and recurrent
  state and returning the states after its last token; padding tokens change nothing.
  No loop over tokens: the convolution gathers, decodes take one vectorised step, and
  longer runs go a chunk of up to 64 tokens per loop step (:func:`delta_rule_chunk`,
  the WY form of the recurrence), so a 32k-token prompt is 512 steps, not 32k.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxkv.errors import JaxkvError

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


def _conv_silu(taps: list[jax.Array], conv_weight: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """SiLU of the depthwise convolution: ``taps[i]`` (oldest first) weighted by
    ``conv_weight[i]``, summed in float32, returned in ``dtype``."""
    weight = conv_weight.astype(jnp.float32)
    return jax.nn.silu(sum(tap.astype(jnp.float32) * weight[i] for i, tap in enumerate(taps))).astype(dtype)


def dense_delta_net(
    mixed: jax.Array, decay: jax.Array, beta: jax.Array, conv_weight: jax.Array, num_heads: int, key_dim: int
) -> jax.Array:
    """Outputs ``(B, L, H, dv)`` of whole sequences from zero state.

    ``mixed (B, L, C)``: the q/k/v projections before the convolution; ``decay``,
    ``beta (B, L, H)``; ``conv_weight (K, C)``.
    """
    return dense_delta_net_states(mixed, decay, beta, conv_weight, num_heads, key_dim)[0]


def dense_delta_net_states(
    mixed: jax.Array, decay: jax.Array, beta: jax.Array, conv_weight: jax.Array, num_heads: int, key_dim: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`dense_delta_net`'s outputs and the states after each whole sequence: the
    conv state ``(B, K-1, C)`` (its last inputs) and the recurrent state ``(B, H, dk, dv)``."""
    kernel = conv_weight.shape[0]
    padded = jnp.pad(mixed, ((0, 0), (kernel - 1, 0), (0, 0)))
    length = mixed.shape[1]
    conv = _conv_silu([padded[:, i : i + length] for i in range(kernel)], conv_weight, mixed.dtype)
    q, k, v = _split_heads(conv, num_heads, key_dim)
    value_dim = v.shape[-1]

    def one_sequence(q, k, v, decay, beta):
        def step(state, inputs):
            return delta_rule_step(state, *inputs)

        init = jnp.zeros((num_heads, key_dim, value_dim), jnp.float32)
        return jax.lax.scan(step, init, (q, k, v, decay.astype(jnp.float32), beta.astype(jnp.float32)))

    state, out = jax.vmap(one_sequence)(q, k, v, decay, beta)
    return out, padded[:, length:], state


class DeltaNetError(JaxkvError, ValueError):
    """A Gated DeltaNet call got a bad static argument (the message names it)."""


def delta_rule_chunk(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, decay: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``C`` tokens of one sequence at once: what ``C`` :func:`delta_rule_step` calls give.

    ``state (H, dk, dv)``, ``q``/``k (C, H, dk)``, ``v (C, H, dv)``, ``decay``/``beta
    (C, H)``; returns the state after the last token and the outputs ``(C, H, dv)``.
    A token with ``decay = beta = 0`` changes nothing (how a short chunk is padded).

    With ``G`` the cumulative log decay, unrolling the recurrence gives
    ``S_t = e^{G_t} S_0 + sum_{i<=t} e^{G_t-G_i} k_i u_i^T``, where the steps ``u``
    solve the unit lower-triangular system
    ``u_t + beta_t sum_{i<t} e^{G_t-G_i} (k_t.k_i) u_i = beta_t (v_t - e^{G_t} S_0^T k_t)``:
    matrix products and one triangular solve instead of ``C`` dependent steps. Only
    ``e^{G_t-G_i}`` for ``i <= t`` (at most 1) is ever formed, so no decay overflows.
    """
    size = decay.shape[0]
    state = state.astype(jnp.float32)
    cum = jnp.cumsum(decay.astype(jnp.float32), axis=0).T  # (H, C)
    beta = beta.astype(jnp.float32).T
    causal = jnp.tril(jnp.ones((size, size), bool))
    # e^{G_t - G_i} for i <= t, 0 above the diagonal (masked before exp: no inf * 0).
    gaps = jnp.exp(jnp.where(causal, cum[:, :, None] - cum[:, None, :], -jnp.inf))
    keys = jnp.einsum("thd,ihd->hti", k, k, precision=_HIGHEST)
    mixing = jnp.where(causal & ~jnp.eye(size, dtype=bool), beta[:, :, None] * gaps * keys, 0.0)
    stored = jnp.exp(cum)[:, :, None] * jnp.einsum("thk,hkv->htv", k, state, precision=_HIGHEST)
    rhs = beta[:, :, None] * (jnp.swapaxes(v, 0, 1) - stored)
    steps = jax.lax.linalg.triangular_solve(mixing, rhs, left_side=True, lower=True, unit_diagonal=True)
    scores = gaps * jnp.einsum("thd,ihd->hti", q, k, precision=_HIGHEST)
    out = jnp.exp(cum)[:, :, None] * jnp.einsum("thk,hkv->htv", q, state, precision=_HIGHEST)
    out = out + jnp.einsum("hti,hiv->htv", scores, steps, precision=_HIGHEST)
    tail = jnp.exp(cum[:, -1:] - cum)  # e^{G_last - G_i}
    state = jnp.exp(cum[:, -1])[:, None, None] * state
    state = state + jnp.einsum("ihk,hi,hiv->hkv", k, tail, steps, precision=_HIGHEST)
    return state, jnp.swapaxes(out, 0, 1)


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
    *,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One serving step: outputs ``(T, H, dv)`` and the sequences' states after it.

    ``mixed (T, C)``, ``decay``/``beta (T, H)`` of the packed tokens; ``seq_of_token (T,)``
    the sequence of each token (each sequence's tokens contiguous, in sequence order),
    ``S`` (one past the last) for padding; ``conv_state (S, K-1, C)`` and
    ``recurrent_state (S, H, dk, dv)`` each sequence's states before the step (zeros for
    a fresh one). Returns the outputs (zero for padding) and both states after the step.

    No loop runs over tokens: the convolution gathers each token's inputs at once; the
    one-token sequences (decodes) take one :func:`delta_rule_step` together; the longer
    ones go in slots of up to ``chunk_size`` tokens of one sequence, a loop over the
    slots in use (``sum ceil(q_len / chunk_size)``) running :func:`delta_rule_chunk`.
    """
    if chunk_size < 1:
        raise DeltaNetError(f"chunk_size must be >= 1, got {chunk_size}")
    num_seqs, num_tokens = conv_state.shape[0], mixed.shape[0]
    if num_tokens == 0:
        return jnp.zeros((0, num_heads, recurrent_state.shape[-1]), jnp.float32), conv_state, recurrent_state
    # starts[s]: the first token of sequence s; starts[S]: the first padding token.
    starts = jnp.searchsorted(seq_of_token, jnp.arange(num_seqs + 1, dtype=seq_of_token.dtype), side="left")
    q_lens = jnp.diff(starts)
    conv, conv_state = _ragged_conv(mixed, conv_weight, starts, conv_state)
    # q, k, v are split off per chunk (and per decode) rather than for all tokens here:
    # XLA's CPU fusion ran ~15x slower normalising q and k of all T tokens at once.
    inputs = (conv, decay.astype(jnp.float32), beta.astype(jnp.float32))
    heads = functools.partial(_split_heads, num_heads=num_heads, key_dim=key_dim)

    single = q_lens == 1
    first = jnp.minimum(starts[:-1], num_tokens - 1)
    conv1, decay1, beta1 = (x[first] for x in inputs)
    stepped, single_out = jax.vmap(delta_rule_step)(recurrent_state, *heads(conv1), decay1, beta1)
    state = jnp.where(single[:, None, None, None], stepped, recurrent_state.astype(jnp.float32))
    state, out = _chunk_loop(inputs, heads, state, starts, jnp.where(q_lens > 1, q_lens, 0), chunk_size)

    owner = jnp.minimum(seq_of_token, num_seqs - 1)
    real = seq_of_token < num_seqs
    out = jnp.where((real & single[owner])[:, None, None], single_out[owner], out)
    out = jnp.where(real[:, None, None], out, 0.0)
    return out, conv_state, state.astype(recurrent_state.dtype)


def _ragged_conv(
    mixed: jax.Array, conv_weight: jax.Array, starts: jax.Array, conv_state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The causal convolution of the packed tokens and each sequence's conv state after them.

    A token's input ``back`` tokens before it is the packed input ``back`` places
    earlier, except within a sequence's first ``K - 1`` tokens, where it comes from
    the sequence's conv state: those few (at most ``S (K - 1)``) are scattered over the
    shifted inputs, so no gather runs over all tokens. Padding tokens convolve whatever
    precedes them; their outputs are never used.
    """
    kernel = conv_weight.shape[0]
    num_seqs, num_tokens = conv_state.shape[0], mixed.shape[0]
    inputs = mixed.astype(conv_state.dtype)
    q_lens = jnp.diff(starts)
    lead = jnp.arange(kernel - 1)  # a sequence's first tokens, the ones reaching into its state
    target = jnp.where(lead < q_lens[:, None], starts[:-1, None] + lead, num_tokens)  # (S, K-1); T: none

    def tap(back: int) -> jax.Array:
        """Each token's input ``back`` tokens before it."""
        if back == 0:
            return inputs
        shifted = jnp.pad(inputs, ((back, 0), (0, 0)))[:num_tokens]
        held = conv_state[:, jnp.clip(kernel - 1 + lead - back, 0, kernel - 2)]  # (S, K-1, C)
        reach = jnp.where(lead < back, target, num_tokens)  # only tokens back past their first
        return shifted.at[reach.reshape(-1)].set(held.reshape(-1, inputs.shape[-1]), mode="drop")

    conv = _conv_silu([tap(kernel - 1 - i) for i in range(kernel)], conv_weight, mixed.dtype)
    # New state row r of sequence s: its input at q_len - (K-1) + r, from the old state when < 0.
    j = q_lens[:, None] - (kernel - 1) + lead
    taken = inputs[jnp.clip(starts[:-1, None] + j, 0, num_tokens - 1)]
    held = conv_state[jnp.arange(num_seqs)[:, None], jnp.clip(kernel - 1 + j, 0, kernel - 2)]
    return conv, jnp.where((j >= 0)[..., None], taken, held)


def _chunk_loop(
    inputs: tuple[jax.Array, jax.Array, jax.Array],
    heads: Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]],
    state: jax.Array,
    starts: jax.Array,
    lens: jax.Array,
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    """Run :func:`delta_rule_chunk` over the slots of the sequences with ``lens > 0``;
    ``inputs``: the conv outputs, decays and betas of the packed tokens, ``heads``
    splits conv outputs into q, k, v.

    Slot ``j`` is up to ``chunk_size`` tokens of one sequence (never two); slots run in
    token order, each resuming its sequence's state row. The loop runs only the slots
    in use, so a step of decodes alone runs none. Returns the states and the outputs
    ``(T, H, dv)`` of the slots' tokens (others zero).
    """
    num_tokens = inputs[0].shape[0]
    # Pad by one chunk so a slot's window never runs off the end (dynamic_slice would clamp it).
    padded = [jnp.pad(x, [(0, chunk_size)] + [(0, 0)] * (x.ndim - 1)) for x in inputs]
    slots = -(-lens // chunk_size)
    slot_end = jnp.cumsum(slots)
    out = jnp.zeros((num_tokens + chunk_size, *state.shape[1:2], state.shape[-1]), jnp.float32)
    valid_rank = jnp.arange(chunk_size)

    def body(carry):
        j, state, out = carry
        seq = jnp.searchsorted(slot_end, j, side="right")
        start = starts[seq] + (j - slot_end[seq] + slots[seq]) * chunk_size
        valid = valid_rank < starts[seq] + lens[seq] - start
        window = (jax.lax.dynamic_slice_in_dim(x, start, chunk_size) for x in padded)
        # Tokens past the slot's end (the next sequence's, padding) are zeroed: no effect.
        conv, decay, beta = (jnp.where(valid[:, None], x, 0) for x in window)
        new, chunk_out = delta_rule_chunk(state[seq], *heads(conv), decay, beta)
        held = jax.lax.dynamic_slice_in_dim(out, start, chunk_size)
        out = jax.lax.dynamic_update_slice_in_dim(out, jnp.where(valid[:, None, None], chunk_out, held), start, 0)
        return j + 1, state.at[seq].set(new), out

    _, state, out = jax.lax.while_loop(lambda c: c[0] < slot_end[-1], body, (jnp.int32(0), state, out))
    return state, out[:num_tokens]


def seq_of_token(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int) -> jax.Array:
    """``(T,)`` index of the sequence owning each packed token; ``S`` for padding tokens."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    owner = jnp.searchsorted(cu_q_lens[1:], tokens, side="right").astype(jnp.int32)
    max_seqs = cu_q_lens.shape[0] - 1
    return jnp.where(tokens < cu_q_lens[num_seqs[0]], owner, max_seqs)
