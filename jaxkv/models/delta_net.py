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
  The convolution is shifted inputs, all tokens at once; the delta rule takes one of
  two forms (:data:`FORMS`):

  - ``"chunked"`` (the default on GPU and TPU): decodes take one vectorised step, and
    longer runs the chunked (WY) form of the recurrence (:func:`delta_rule_chunk` for
    one chunk): all state-free work in parallel over 64-token chunks, then one loop
    step per chunk of a sequence, so a 32k-token prompt is 512 dependent steps, not 32k;
  - ``"scan"`` (the default on CPU): one scan step per packed token. A CPU gains
    nothing from the chunked form's parallel work, which is ~2.5x the arithmetic at
    64-token chunks (``scripts/bench_delta_net.py`` on the 2-core CPU: the chunked form
    at 0.74-0.98x of the scan), and its batched triangular solves go through LAPACK.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

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


def _split_heads(
    mixed: jax.Array, num_heads: int, key_dim: int, num_value_heads: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Conv outputs ``(..., H*2dk + Hv*dv)`` -> normalised, scaled q, normalised k, v per
    value head: with ``Hv`` (None: ``H``) a multiple of ``H``, each q/k head serves
    ``Hv / H`` consecutive value heads (Qwen3-Next's grouped value heads)."""
    value_heads = num_heads if num_value_heads is None else num_value_heads
    q, k, v = jnp.split(mixed, [num_heads * key_dim, 2 * num_heads * key_dim], axis=-1)
    lead = mixed.shape[:-1]
    q = l2_normalize(q.reshape(*lead, num_heads, key_dim)) * key_dim**-0.5
    k = l2_normalize(k.reshape(*lead, num_heads, key_dim))
    if value_heads != num_heads:
        q, k = (jnp.repeat(x, value_heads // num_heads, axis=-2) for x in (q, k))
    return q, k, v.reshape(*lead, value_heads, -1).astype(jnp.float32)


def conv_silu(
    taps: list[jax.Array], conv_weight: jax.Array, dtype: jnp.dtype, bias: jax.Array | None = None
) -> jax.Array:
    """SiLU of the depthwise convolution: ``taps[i]`` (oldest first) weighted by
    ``conv_weight[i]``, plus ``bias`` if any, summed in float32, returned in ``dtype``."""
    weight = conv_weight.astype(jnp.float32)
    total = sum(tap.astype(jnp.float32) * weight[i] for i, tap in enumerate(taps))
    if bias is not None:
        total = total + bias.astype(jnp.float32)
    return jax.nn.silu(total).astype(dtype)


def dense_causal_conv(
    mixed: jax.Array, conv_weight: jax.Array, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """:func:`conv_silu` over whole sequences ``mixed (B, L, C)`` from zero inputs, and
    the conv state after them ``(B, K-1, C)`` (their last inputs)."""
    kernel, length = conv_weight.shape[0], mixed.shape[1]
    padded = jnp.pad(mixed, ((0, 0), (kernel - 1, 0), (0, 0)))
    conv = conv_silu([padded[:, i : i + length] for i in range(kernel)], conv_weight, mixed.dtype, bias)
    return conv, padded[:, length:]


def dense_delta_net(
    mixed: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    conv_weight: jax.Array,
    num_heads: int,
    key_dim: int,
    num_value_heads: int | None = None,
) -> jax.Array:
    """Outputs ``(B, L, Hv, dv)`` of whole sequences from zero state.

    ``mixed (B, L, C)``: the q/k/v projections before the convolution; ``decay``,
    ``beta (B, L, Hv)``; ``conv_weight (K, C)``; ``num_value_heads`` (None: ``num_heads``)
    as in :func:`_split_heads`.
    """
    return dense_delta_net_states(mixed, decay, beta, conv_weight, num_heads, key_dim, num_value_heads)[0]


def dense_delta_net_states(
    mixed: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    conv_weight: jax.Array,
    num_heads: int,
    key_dim: int,
    num_value_heads: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`dense_delta_net`'s outputs and the states after each whole sequence: the
    conv state ``(B, K-1, C)`` (its last inputs) and the recurrent state ``(B, Hv, dk, dv)``."""
    conv, conv_state = dense_causal_conv(mixed, conv_weight)
    q, k, v = _split_heads(conv, num_heads, key_dim, num_value_heads)
    value_heads, value_dim = v.shape[-2:]

    def one_sequence(q, k, v, decay, beta):
        def step(state, inputs):
            return delta_rule_step(state, *inputs)

        init = jnp.zeros((value_heads, key_dim, value_dim), jnp.float32)
        return jax.lax.scan(step, init, (q, k, v, decay.astype(jnp.float32), beta.astype(jnp.float32)))

    state, out = jax.vmap(one_sequence)(q, k, v, decay, beta)
    return out, conv_state, state


FORMS = ("scan", "chunked")
"""The forms of :func:`ragged_delta_net`'s delta rule (same results to float rounding)."""


def default_form() -> str:
    """``"scan"`` on CPU, ``"chunked"`` on an accelerator (see the module docstring)."""
    return "scan" if jax.default_backend() == "cpu" else "chunked"


class DeltaNetError(JaxkvError, ValueError):
    """A Gated DeltaNet call got a bad static argument (the message names it)."""


class _Chunks(NamedTuple):
    """The state-independent part of the chunked delta rule, per grid chunk ``(N, ...)``.

    Packed tokens are cut into ``N`` grid chunks of ``C``; a *piece* is the tokens of
    one sequence inside one chunk. With ``G`` the cumulative log decay and ``u`` the
    tokens' steps, within a piece starting from state ``S0``:
    ``S_t = e^{G_t - G_0} S0 + sum_{i<=t} e^{G_t-G_i} k_i u_i^T`` and
    ``u = U - W S0``, where ``(I + A) [W | U] = beta [e^{G - G_0} k | v]`` and
    ``A[t, i] = beta_t e^{G_t-G_i} (k_t.k_i)`` for earlier ``i`` of the same piece
    (``G_0``: the cumulative decay just before the piece). This unrolls
    :func:`delta_rule_step`, whose step reads the decayed state:
    ``u_t = beta_t (v_t - (alpha_t S_{t-1})^T k_t)``. Pieces never mix: every pair of
    rows from different sequences is masked out before the solve.
    """

    q: jax.Array  # (N, C, H, dk), scaled
    k: jax.Array  # (N, C, H, dk)
    w: jax.Array  # (N, H, C, dk)
    u: jax.Array  # (N, H, C, dv)
    scores: jax.Array  # (N, H, C, C): e^{G_t-G_i} (q_t.k_i), same piece, i <= t
    from_start: jax.Array  # (N, C, H): e^{G_t - G_0}
    to_end: jax.Array  # (N, C, H): e^{G_last - G_t}
    whole: jax.Array  # (N, C, H): e^{G_last - G_0} of the row's piece


def _prepare_chunks(
    q: jax.Array, k: jax.Array, v: jax.Array, decay: jax.Array, beta: jax.Array, piece_of_row: jax.Array
) -> _Chunks:
    """:class:`_Chunks` of ``q``/``k (N, C, H, dk)``, ``v (N, C, H, dv)``, ``decay``/``beta
    (N, C, H)`` and ``piece_of_row (N, C)`` (a piece: a run of rows with equal ids)."""
    size = decay.shape[1]
    cum = jnp.cumsum(decay, axis=1)
    rows = jnp.arange(size)
    same = piece_of_row[:, :, None] == piece_of_row[:, None, :]
    # A piece's first and last rows (pieces are contiguous runs of equal ids).
    first = jnp.argmax(same, axis=2)
    last = size - 1 - jnp.argmax(same[:, :, ::-1], axis=2)
    before = jnp.where((first > 0)[..., None], jnp.take_along_axis(cum, jnp.maximum(first - 1, 0)[..., None], 1), 0.0)
    at_last = jnp.take_along_axis(cum, last[..., None], 1)
    lower = (same & (rows[:, None] >= rows[None, :]))[:, None]  # (N, 1, C, C)
    cum_h = jnp.swapaxes(cum, 1, 2)  # (N, H, C)
    # e^{G_t - G_i} for i <= t of one piece, else 0 (masked before exp: no inf * 0).
    gaps = jnp.exp(jnp.where(lower, cum_h[..., :, None] - cum_h[..., None, :], -jnp.inf))
    keys = jnp.einsum("nthd,nihd->nhti", k, k, precision=_HIGHEST)
    beta_h = jnp.swapaxes(beta, 1, 2)[..., None]
    mixing = jnp.where(lower & (rows[:, None] > rows[None, :]), beta_h * gaps * keys, 0.0)
    from_start = jnp.exp(cum - before)
    rhs = jnp.concatenate([(from_start * beta)[..., None] * k, beta[..., None] * v], axis=-1)
    solved = jax.lax.linalg.triangular_solve(
        mixing, jnp.swapaxes(rhs, 1, 2), left_side=True, lower=True, unit_diagonal=True
    )
    w, u = jnp.split(solved, [k.shape[-1]], axis=-1)
    scores = jnp.where(lower, gaps * jnp.einsum("nthd,nihd->nhti", q, k, precision=_HIGHEST), 0.0)
    return _Chunks(q, k, w, u, scores, from_start, jnp.exp(at_last - cum), jnp.exp(at_last - before))


def _run_piece(
    chunks: _Chunks, index: int | jax.Array, row: int | jax.Array, rows: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Piece on ``rows`` (mask, first row ``row``) of chunk ``index`` from ``state (H, dk, dv)``:
    the state after it and the chunk's outputs ``(C, H, dv)`` (valid on ``rows``)."""
    c = jax.tree.map(lambda x: x[index], chunks)
    steps = c.u - jnp.einsum("htk,hkv->htv", c.w, state, precision=_HIGHEST)
    steps = jnp.where(rows[:, None], steps, 0.0)
    out = c.from_start.T[..., None] * jnp.einsum("thk,hkv->htv", c.q, state, precision=_HIGHEST)
    out = out + jnp.einsum("hti,hiv->htv", c.scores, steps, precision=_HIGHEST)
    state = c.whole[row][:, None, None] * state
    state = state + jnp.einsum("thk,th,htv->hkv", c.k, c.to_end, steps, precision=_HIGHEST)
    return state, jnp.swapaxes(out, 0, 1)


def delta_rule_chunk(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, decay: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """``C`` tokens of one sequence at once: what ``C`` :func:`delta_rule_step` calls give.

    ``state (H, dk, dv)``, ``q``/``k (C, H, dk)``, ``v (C, H, dv)``, ``decay``/``beta
    (C, H)``; returns the state after the last token and the outputs ``(C, H, dv)``:
    matrix products and one triangular solve instead of ``C`` dependent steps (the
    derivation: :class:`_Chunks`). Only ``e^{G_t-G_i}`` for ``i <= t`` (at most 1) is
    ever formed, so no decay overflows.
    """
    size = decay.shape[0]
    q1, k1, v1, decay1, beta1 = (x[None].astype(jnp.float32) for x in (q, k, v, decay, beta))
    chunks = _prepare_chunks(q1, k1, v1, decay1, beta1, jnp.zeros((1, size), jnp.int32))
    return _run_piece(chunks, 0, 0, jnp.ones(size, bool), state.astype(jnp.float32))


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
    num_value_heads: int | None = None,
    chunk_size: int = 64,
    form: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One serving step: outputs ``(T, Hv, dv)`` and the sequences' states after it.

    ``mixed (T, C)``, ``decay``/``beta (T, Hv)`` of the packed tokens (``Hv``:
    ``num_value_heads``, None: ``num_heads``, as in :func:`_split_heads`); ``seq_of_token (T,)``
    the sequence of each token (each sequence's tokens contiguous, in sequence order),
    ``S`` (one past the last) for padding; ``conv_state (S, K-1, C)`` and
    ``recurrent_state (S, Hv, dk, dv)`` each sequence's states before the step (zeros for
    a fresh one). Returns the outputs (zero for padding) and both states after the step.

    The convolution takes each token's inputs at once. ``form`` (None:
    :func:`default_form`) picks the delta rule's: ``"scan"``, one scan step per token;
    ``"chunked"``, where the one-token sequences (decodes) take one
    :func:`delta_rule_step` together, so a step of decodes alone runs no loop, and the
    longer ones are cut on a grid of ``chunk_size`` tokens and a loop runs one step per
    (grid chunk, sequence) piece in use, at most ``T / chunk_size + S`` (see :func:`_chunked`).
    """
    form = default_form() if form is None else form
    if form not in FORMS:
        raise DeltaNetError(f"form must be one of {FORMS}, got {form!r}")
    if chunk_size < 1:
        raise DeltaNetError(f"chunk_size must be >= 1, got {chunk_size}")
    num_seqs, num_tokens = conv_state.shape[0], mixed.shape[0]
    if num_tokens == 0:
        return (
            jnp.zeros((0, *recurrent_state.shape[1:2], recurrent_state.shape[-1]), jnp.float32),
            conv_state,
            recurrent_state,
        )
    starts = sequence_starts(seq_of_token, num_seqs)
    q_lens = jnp.diff(starts)
    conv, conv_state = ragged_causal_conv(mixed, conv_weight, starts, conv_state)
    real = seq_of_token < num_seqs
    # Padding rows are zeroed so that whatever they hold (even NaN) meets no real row.
    conv, decay, beta = (jnp.where(real[:, None], x, 0) for x in (conv, decay, beta))
    inputs = (conv, decay.astype(jnp.float32), beta.astype(jnp.float32))
    heads = functools.partial(_split_heads, num_heads=num_heads, key_dim=key_dim, num_value_heads=num_value_heads)
    if form == "scan":
        state, out = scan_rows(
            delta_rule_step, recurrent_state.astype(jnp.float32), (*heads(conv), *inputs[1:]), seq_of_token
        )
        out = jnp.where(real[:, None, None], out, 0.0)
        return out, conv_state, state.astype(recurrent_state.dtype)

    single = q_lens == 1
    first = jnp.minimum(starts[:-1], num_tokens - 1)
    conv1, decay1, beta1 = (x[first] for x in inputs)
    stepped, single_out = jax.vmap(delta_rule_step)(recurrent_state, *heads(conv1), decay1, beta1)
    state = jnp.where(single[:, None, None, None], stepped, recurrent_state.astype(jnp.float32))
    state, out = _chunked(*inputs, seq_of_token, starts, jnp.where(q_lens > 1, q_lens, 0), state, heads, chunk_size)

    owner = jnp.minimum(seq_of_token, num_seqs - 1)
    out = jnp.where((real & single[owner])[:, None, None], single_out[owner], out)
    out = jnp.where(real[:, None, None], out, 0.0)
    return out, conv_state, state.astype(recurrent_state.dtype)


def sequence_starts(seq_of_token: jax.Array, num_seqs: int) -> jax.Array:
    """``(S + 1,)``: the first packed token of each sequence, then of the padding."""
    return jnp.searchsorted(seq_of_token, jnp.arange(num_seqs + 1, dtype=seq_of_token.dtype), side="left")


def ragged_causal_conv(
    mixed: jax.Array,
    conv_weight: jax.Array,
    starts: jax.Array,
    conv_state: jax.Array,
    bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`conv_silu` of the packed tokens ``mixed (T, C)`` (sequences beginning at
    ``starts``, see :func:`sequence_starts`) and each sequence's conv state after them.

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

    conv = conv_silu([tap(kernel - 1 - i) for i in range(kernel)], conv_weight, mixed.dtype, bias)
    # New state row r of sequence s: its input at q_len - (K-1) + r, from the old state when < 0.
    j = q_lens[:, None] - (kernel - 1) + lead
    taken = inputs[jnp.clip(starts[:-1, None] + j, 0, num_tokens - 1)]
    held = conv_state[jnp.arange(num_seqs)[:, None], jnp.clip(kernel - 1 + j, 0, kernel - 2)]
    return conv, jnp.where((j >= 0)[..., None], taken, held)


def scan_rows(
    step: Callable[..., tuple[jax.Array, jax.Array]],
    state: jax.Array,
    inputs: tuple[jax.Array, ...],
    seq_of_token: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """A recurrence a token at a time: one scan step per packed token,
    ``step(row, *token_inputs) -> (row, out)``, updates its sequence's row of ``state
    (S, ...)`` (padding: a scratch row past the last). Returns the rows and the outputs
    stacked over tokens."""
    rows = jnp.concatenate([state, jnp.zeros_like(state[:1])])

    def one(rows: jax.Array, token: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        *values, seq = token
        new, out = step(rows[seq], *values)
        return rows.at[seq].set(new), out

    rows, out = jax.lax.scan(one, rows, (*inputs, seq_of_token))
    return rows[:-1], out


def _chunked(
    conv: jax.Array,
    decay: jax.Array,
    beta: jax.Array,
    seq_of_token: jax.Array,
    starts: jax.Array,
    lens: jax.Array,
    state: jax.Array,
    heads: Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]],
    chunk_size: int,
) -> tuple[jax.Array, jax.Array]:
    """The delta rule over the sequences with ``lens > 0``, a grid chunk at a time.

    Everything that does not depend on a state (q/k/v, the masked decays, the
    triangular solves) is computed for all grid chunks at once; then a loop runs the
    pieces in use in token order (``sum`` over those sequences of the grid chunks each
    touches, at most ``T / C + S``), each resuming its sequence's state row. Returns
    the states and the outputs ``(T, H, dv)`` of those sequences' tokens (others zero).
    """
    num_tokens, num_seqs = conv.shape[0], state.shape[0]
    grid = -(-num_tokens // chunk_size)
    pad = grid * chunk_size - num_tokens
    conv, decay, beta = (jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) for x in (conv, decay, beta))
    owner = jnp.pad(seq_of_token, (0, pad), constant_values=num_seqs).reshape(grid, chunk_size)
    q, k, v = heads(conv.reshape(grid, chunk_size, -1))
    chunks = _prepare_chunks(q, k, v, decay.reshape(grid, chunk_size, -1), beta.reshape(grid, chunk_size, -1), owner)
    first_chunk = starts[:-1] // chunk_size
    counts = jnp.where(lens > 0, (starts[:-1] + lens - 1) // chunk_size - first_chunk + 1, 0)
    piece_end = jnp.cumsum(counts)
    out = jnp.zeros((grid, chunk_size, *v.shape[2:]), jnp.float32)

    def body(carry):
        j, state, out = carry
        seq = jnp.searchsorted(piece_end, j, side="right")
        index = first_chunk[seq] + j - piece_end[seq] + counts[seq]
        row = jnp.maximum(starts[seq] - index * chunk_size, 0)
        rows = owner[index] == seq
        new, piece_out = _run_piece(chunks, index, row, rows, state[seq])
        out = out.at[index].set(jnp.where(rows[:, None, None], piece_out, out[index]))
        return j + 1, state.at[seq].set(new), out

    _, state, out = jax.lax.while_loop(lambda c: c[0] < piece_end[-1], body, (jnp.int32(0), state, out))
    return state, out.reshape(grid * chunk_size, *out.shape[2:])[:num_tokens]


def seq_of_token(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int) -> jax.Array:
    """``(T,)`` index of the sequence owning each packed token; ``S`` for padding tokens."""
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    owner = jnp.searchsorted(cu_q_lens[1:], tokens, side="right").astype(jnp.int32)
    max_seqs = cu_q_lens.shape[0] - 1
    return jnp.where(tokens < cu_q_lens[num_seqs[0]], owner, max_seqs)
