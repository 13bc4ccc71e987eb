"""Presence, frequency and repetition penalties and logit bias, on the device, as vLLM applies them.

After the stop ids are masked (``min_tokens``) and before temperature, each row's logits
are bent in vLLM's order (its ``LogitBiasLogitsProcessor``, then ``apply_penalties``):

    logits += logit_bias                                      (the row's listed ids)
    logits  = logits / r  where seen and logits > 0           (r: repetition_penalty;
    logits  = logits * r  where seen and logits <= 0           seen: in the prompt or output)
    logits -= frequency_penalty * output_count
    logits -= presence_penalty * (output_count > 0)

``output_count`` counts the tokens the sequence generated so far. The host sends a row's
tokens *before* the one the step feeds (its prompt, when ``repetition_penalty`` asks for
it, then its outputs) and the step adds the fed token itself, read from the step's input
ids: so the counts stay exact when the host learns a drawn token only a step later.

A step carries :class:`PenaltyInputs` only when one of its rows has a penalty or a bias
(else None: a second compiled variant, which a batch without them never runs); the
token and bias widths are padded to powers of two, so lengths compile a few variants
and parameter values none. Rows without penalties keep their logits bit for bit
(a bias of 0, a penalty of 1 or 0 change no float).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.errors import JaxkvError
from jaxkv.serving.sampling_params import SamplingParams

MIN_TOKEN_WIDTH = 16
MIN_BIAS_WIDTH = 8
"""The narrowest padded token and bias rows (widths grow by powers of two from these)."""


class PenaltyInputsError(JaxkvError, ValueError):
    """A row with penalties came without its token history (a caller's bug, named by row)."""


class TokenHistory(Protocol):
    """A sequence's tokens as the host knows them (a :class:`~jaxkv.core.request.Request`)."""

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def prompt_bytes(self) -> bytes:
        """The prompt as little-endian int32, or ``b""`` when not packed."""
        ...


class PenaltyRow(NamedTuple):
    """One row's penalties: its parameters, the position of the token it draws, its tokens."""

    params: SamplingParams
    position: int
    history: TokenHistory | None


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyInputs:
    """Per-row penalties of one step (``S`` rows; ``W``, ``B``: padded widths)."""

    values: np.ndarray | jax.Array
    """(S, 3) float32: presence, frequency and repetition penalty (0, 0, 1: none)."""
    counts: np.ndarray | jax.Array
    """(S, 3) int32: prompt tokens in ``tokens``, tokens in ``tokens``, whether the fed token is an output (0/1)."""
    tokens: np.ndarray | jax.Array
    """(S, W) int32: the prompt's tokens (or none), then the outputs before the fed one; padding 0."""
    bias_ids: np.ndarray | jax.Array
    """(S, B) int32: token ids to bias; padding 0 (with a bias of 0)."""
    bias: np.ndarray | jax.Array
    """(S, B) float32."""


def _width(n: int, least: int) -> int:
    """``n`` rounded up to a power of two, at least ``least``."""
    return max(least, 1 << max(n - 1, 0).bit_length())


def _tokens(row: PenaltyRow) -> tuple[np.ndarray, int, bool]:
    """The row's prompt (only when the repetition penalty reads it) and its outputs before the
    fed token, how many of them are prompt, and whether the fed token is an output.

    ``position`` is the draw's: the fed token sits at ``position - 1``. An output there may be
    unknown to the host yet (and what follows it), so no output from it on is read; the
    prompt is always known and sent whole (a fed prompt token is in it), read from the
    bytes the request's check packed when it has them (no per-token Python work)."""
    p, history = row.params, row.history
    if history is None or not p.has_penalties:
        return np.zeros(0, np.int32), 0, False
    prompt, fed = history.num_prompt_tokens, row.position - 1
    outputs = np.asarray(history.all_token_ids[prompt:fed] if fed > prompt else (), np.int32)
    if p.repetition_penalty == 1.0:
        return outputs, 0, fed >= prompt
    packed = history.prompt_bytes
    if len(packed) == 4 * prompt:
        prompt_ids = np.frombuffer(packed, "<i4")
    else:
        prompt_ids = np.asarray(history.all_token_ids[:prompt], np.int32)
    return np.concatenate([prompt_ids, outputs]), prompt, fed >= prompt


def penalty_inputs(rows: Sequence[PenaltyRow | None], num_rows: int) -> PenaltyInputs | None:
    """The step's :class:`PenaltyInputs` (host arrays) for ``rows`` padded to ``num_rows``,
    or None when no row has a penalty or a bias. A row with penalties needs its history."""
    if not any(r is not None and (r.params.has_penalties or r.params.logit_bias) for r in rows):
        return None
    values = np.zeros((num_rows, 3), np.float32)
    values[:, 2] = 1.0
    counts = np.zeros((num_rows, 3), np.int32)
    histories = [np.zeros(0, np.int32)] * num_rows
    biases: list[dict[int, float]] = [{} for _ in range(num_rows)]
    for i, row in enumerate(rows):
        if row is None:
            continue
        p = row.params
        if p.has_penalties and row.history is None:
            raise PenaltyInputsError(f"row {i} has penalties and no token history")
        values[i] = p.presence_penalty, p.frequency_penalty, p.repetition_penalty
        histories[i], num_prompt, fed_output = _tokens(row)
        counts[i] = num_prompt, len(histories[i]), fed_output
        biases[i] = dict(p.logit_bias or {})
    tokens = np.zeros((num_rows, _width(max(map(len, histories)), MIN_TOKEN_WIDTH)), np.int32)
    bias_ids = np.zeros((num_rows, _width(max(map(len, biases)), MIN_BIAS_WIDTH)), np.int32)
    bias = np.zeros(bias_ids.shape, np.float32)
    for i, (history, row_bias) in enumerate(zip(histories, biases, strict=True)):
        tokens[i, : len(history)] = history
        bias_ids[i, : len(row_bias)] = list(row_bias)
        bias[i, : len(row_bias)] = list(row_bias.values())
    return PenaltyInputs(values, counts, tokens, bias_ids, bias)


def apply_penalties(logits: jax.Array, inputs: PenaltyInputs, fed_ids: jax.Array) -> jax.Array:
    """``logits`` (S, V) float32 with each row's bias and penalties applied (module docstring);
    ``fed_ids`` (S,): the token each row feeds this step."""
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    logits = logits.at[rows, inputs.bias_ids].add(inputs.bias)
    counts, tokens = jnp.asarray(inputs.counts), jnp.asarray(inputs.tokens)
    num_prompt, num_tokens, fed_output = counts[:, 0:1], counts[:, 1:2], counts[:, 2]
    index = jnp.arange(tokens.shape[1])[None, :]
    is_output = (index >= num_prompt) & (index < num_tokens)
    output_count = jnp.zeros((num_rows, vocab), jnp.float32).at[rows, tokens].add(is_output.astype(jnp.float32))
    output_count = output_count.at[rows[:, 0], fed_ids].add(fed_output.astype(jnp.float32))
    in_prompt = jnp.zeros((num_rows, vocab), jnp.bool_).at[rows, tokens].max(index < num_prompt)
    values = jnp.asarray(inputs.values)
    presence, frequency, repetition = values[:, 0:1], values[:, 1:2], values[:, 2:3]
    penalty = jnp.where(in_prompt | (output_count > 0), repetition, 1.0)
    logits = jnp.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - frequency * output_count
    return logits - presence * (output_count > 0)
