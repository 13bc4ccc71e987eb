"""Token sampling on the device, inside the jitted step: pure jnp, one compile for all parameters.

Every request's parameters are rows of :class:`SamplingInputs` (one row per sequence
of the step, padded like the step's sequences), so a batch mixing greedy, seeded,
top-k and top-p requests runs the same compiled function as any other batch. Per row:

    logits ─► mask stop ids (while short of min_tokens) ─► / temperature
           ─► keep the top_k ─► keep the smallest head of mass >= top_p
           ─► keep p >= min_p · p_max ─► Gumbel-max draw with key fold_in(key(seed), position)

A row's key depends only on its seed and the position of the token it draws, so a
seeded request draws the same tokens whatever shares its batch (and again after a
preemption). Temperature 0 is the argmax of the (masked) logits: the greedy path.
The top :data:`~jaxkv.serving.sampling_params.MAX_LOGPROBS` log-probabilities and the
chosen token's come from the model's raw distribution (``log_softmax`` of the
logits, before any of the masks), as vLLM reports them by default.

Ties at the top-p boundary keep every token equal to the last one kept; top-k keeps
ties with the k-th value too (they are equally likely, none is preferred).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.serving.sampling_params import MAX_LOGPROBS, MAX_MASKED_STOP_IDS, SamplingParams


class SamplingInputs(NamedTuple):
    """Per-row sampling parameters of one step (``S`` rows: the step's padded sequences)."""

    temperature: np.ndarray | jax.Array
    """(S,) float32; 0: greedy."""
    top_k: np.ndarray | jax.Array
    """(S,) int32; 0: every token."""
    top_p: np.ndarray | jax.Array
    """(S,) float32 in (0, 1]."""
    min_p: np.ndarray | jax.Array
    """(S,) float32 in [0, 1]."""
    seed: np.ndarray | jax.Array
    """(S,) uint32: the row's key is ``fold_in(key(seed), position)``."""
    position: np.ndarray | jax.Array
    """(S,) int32: the position in its sequence of the token the row draws."""
    banned: np.ndarray | jax.Array
    """(S, MAX_MASKED_STOP_IDS) int32: token ids the row may not draw (the first ``num_banned``)."""
    num_banned: np.ndarray | jax.Array
    """(S,) int32."""


class SampledTokens(NamedTuple):
    """What the step drew, per row."""

    token_ids: np.ndarray | jax.Array
    """(S,) int32."""
    logprob: np.ndarray | jax.Array
    """(S,) float32: the chosen token's log-probability."""
    top_ids: np.ndarray | jax.Array
    """(S, K) int32, K = min(MAX_LOGPROBS, vocab): the most likely tokens, most likely first."""
    top_logprobs: np.ndarray | jax.Array
    """(S, K) float32."""


class RowSampling(NamedTuple):
    """One sequence's draw: its parameters, seed, token position and banned ids."""

    params: SamplingParams
    seed: int
    position: int
    banned: tuple[int, ...] = ()


def sampling_inputs(rows: Sequence[RowSampling | None], num_rows: int) -> SamplingInputs:
    """The step's :class:`SamplingInputs` (host arrays) for ``rows`` (None: a row that draws
    nothing this step, sampled greedily and ignored), padded to ``num_rows`` greedy rows."""
    temperature = np.zeros(num_rows, np.float32)
    top_k = np.zeros(num_rows, np.int32)
    top_p = np.ones(num_rows, np.float32)
    min_p = np.zeros(num_rows, np.float32)
    seed = np.zeros(num_rows, np.uint32)
    position = np.zeros(num_rows, np.int32)
    banned = np.zeros((num_rows, MAX_MASKED_STOP_IDS), np.int32)
    num_banned = np.zeros(num_rows, np.int32)
    for i, row in enumerate(rows):
        if row is None:
            continue
        p = row.params
        temperature[i], top_k[i], top_p[i], min_p[i] = p.temperature, p.top_k, p.top_p, p.min_p
        if not p.is_greedy:  # a greedy row's key is unused: its inputs stay the same in every process
            seed[i], position[i] = row.seed, row.position
        banned[i, : len(row.banned)] = row.banned
        num_banned[i] = len(row.banned)
    return SamplingInputs(temperature, top_k, top_p, min_p, seed, position, banned, num_banned)


def greedy_inputs(num_rows: int) -> SamplingInputs:
    """Every row greedy, nothing banned."""
    return sampling_inputs((), num_rows)


def _ban(logits: jax.Array, banned: jax.Array, num_banned: jax.Array) -> jax.Array:
    """``logits`` (S, V) with each row's first ``num_banned`` ids of ``banned`` set to -inf."""
    rows = jnp.arange(logits.shape[0])[:, None]
    used = jnp.arange(banned.shape[1])[None, :] < num_banned[:, None]
    return logits.at[rows, banned].min(jnp.where(used, -jnp.inf, jnp.inf))


def _keep_top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """A (S, V) mask of the tokens inside each row's top_k and top_p."""
    vocab = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)  # (S, V) each row's values, largest first
    k = jnp.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    rank = jnp.arange(vocab)[None, :]
    in_k = rank < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, desc, -jnp.inf), axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly larger tokens
    num_kept = jnp.maximum(jnp.sum(in_k & (before < top_p[:, None]), axis=-1), 1)
    threshold = jnp.take_along_axis(desc, (num_kept - 1)[:, None], axis=-1)
    return scaled >= threshold


def _draw(logits: jax.Array, inputs: SamplingInputs) -> jax.Array:
    """Each row's token (S,): a tempered, filtered Gumbel-max draw, or the argmax where temperature is 0."""
    temperature = jnp.asarray(inputs.temperature)
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    keep = _keep_top_k_top_p(scaled, jnp.asarray(inputs.top_k), jnp.asarray(inputs.top_p))
    peak = jnp.max(scaled, axis=-1, keepdims=True)
    keep &= scaled - peak >= jnp.log(jnp.asarray(inputs.min_p))[:, None]  # p / p_max >= min_p
    keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(
        jnp.asarray(inputs.seed), jnp.asarray(inputs.position)
    )
    noise = jax.vmap(lambda key: jax.random.gumbel(key, scaled.shape[-1:], jnp.float32))(keys)
    drawn = jnp.argmax(jnp.where(keep, scaled, -jnp.inf) + noise, axis=-1)
    return jnp.where(temperature > 0, drawn, jnp.argmax(logits, axis=-1))


def sample(logits: jax.Array, inputs: SamplingInputs) -> SampledTokens:
    """Draw one token per row of ``logits`` (S, V) as ``inputs`` say (see the module docstring).

    A step whose rows are all greedy takes the argmax alone: the vocabulary sort and the
    noise of a draw run only when some row samples (a runtime branch, one compile).
    """
    logits = logits.astype(jnp.float32)
    raw = jax.nn.log_softmax(logits, axis=-1)
    logits = _ban(logits, jnp.asarray(inputs.banned), jnp.asarray(inputs.num_banned))
    inputs = SamplingInputs(*(jnp.asarray(field) for field in inputs))
    tokens = jax.lax.cond(
        jnp.any(inputs.temperature > 0), _draw, lambda lg, _: jnp.argmax(lg, axis=-1), logits, inputs
    ).astype(jnp.int32)
    top_logprobs, top_ids = jax.lax.top_k(raw, min(MAX_LOGPROBS, raw.shape[-1]))
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return SampledTokens(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)
