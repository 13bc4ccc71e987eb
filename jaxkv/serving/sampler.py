"""Token sampling on the device, inside the jitted step: pure jnp, one compile for all parameters.

Every request's parameters are rows of :class:`SamplingInputs` (one row per sequence
of the step, padded like the step's sequences), so a batch mixing greedy, seeded,
top-k and top-p requests runs the same compiled function as any other batch. Per row:

    logits ─► mask stop ids (while short of min_tokens) ─► logit bias, penalties ─► / temperature
           ─► keep the top_k ─► keep the smallest head of mass >= top_p
           ─► keep p >= min_p · p_max ─► Gumbel-max draw with key fold_in(key(seed), position)

A row's key depends only on its seed and the position of the token it draws, so a
seeded request draws the same tokens whatever shares its batch (and again after a
preemption). Temperature 0 is the argmax of the (masked) logits: the greedy path.
The top :data:`~jaxkv.serving.sampling_params.MAX_LOGPROBS` log-probabilities and the
chosen token's come from the model's raw distribution (``log_softmax`` of the
logits, before any of the masks), as vLLM reports them by default; a step computes and
returns them only when one of its rows asked (a static flag: two compiled variants at most).
Logit bias and the presence, frequency and repetition penalties (:mod:`jaxkv.serving.penalties`)
travel in arrays of their own only when a row of the step has one, so a step without
them runs the variant it ran before.

A serving loop keeps its step's rows on the device (:class:`SamplingBatch`): they change
only when a row's parameters, seed or banned ids do, since the step fills in the positions
from its metadata (:func:`at_positions`); a steady decode step sends no sampling input.

Ties at the top-p boundary keep every token equal to the last one kept; top-k keeps
ties with the k-th value too (they are equally likely, none is preferred).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.serving.penalties import (
    PenaltyInputs,
    PenaltyInputsError,
    PenaltyRow,
    TokenHistory,
    apply_penalties,
    penalty_inputs,
)
from jaxkv.serving.sampling_params import MAX_LOGPROBS, MAX_MASKED_STOP_IDS, SamplingParams

_FLOATS = ("temperature", "top_p", "min_p")
"""The float32 columns of :class:`SamplingInputs`' packed rows (carried as their int32 bits)."""
_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "seed", "position", "num_banned")
"""The packed row's first columns, one value each; the banned ids follow."""
_AT = {name: i for i, name in enumerate(_COLUMNS)}
_IDLE_FLOATS = (0.0, 1.0, 0.0)
"""Temperature, top_p and min_p of a row that draws nothing (greedy, nothing filtered)."""


def _column(packed: np.ndarray | jax.Array, name: str) -> np.ndarray | jax.Array:
    """Column ``name`` of packed rows (either kind of array), in its own dtype."""
    values = packed[:, _AT[name]]
    dtype = np.float32 if name in _FLOATS else np.uint32 if name == "seed" else None
    if dtype is None:
        return values
    if isinstance(values, np.ndarray):
        return values.view(dtype)
    return jax.lax.bitcast_convert_type(values, dtype)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class SamplingInputs:
    """Per-row sampling parameters of one step (``S`` rows: the step's padded sequences).

    One int32 array ``(S, 7 + MAX_MASKED_STOP_IDS)`` carries them all (float32 and uint32
    values as their bits), so the step's call sends one array, not eight; ``logprobs`` is
    static: whether some row asked for log-probabilities (a step without them computes and
    returns none; each value compiles once). ``penalties``: the rows' logit bias and
    penalties, None when no row has any (:mod:`jaxkv.serving.penalties`)."""

    packed: np.ndarray | jax.Array
    penalties: PenaltyInputs | None = None
    logprobs: bool = dataclasses.field(default=False, metadata={"static": True})

    @property
    def temperature(self) -> np.ndarray | jax.Array:
        """(S,) float32; 0: greedy."""
        return _column(self.packed, "temperature")

    @property
    def top_k(self) -> np.ndarray | jax.Array:
        """(S,) int32; 0: every token."""
        return _column(self.packed, "top_k")

    @property
    def top_p(self) -> np.ndarray | jax.Array:
        """(S,) float32 in (0, 1]."""
        return _column(self.packed, "top_p")

    @property
    def min_p(self) -> np.ndarray | jax.Array:
        """(S,) float32 in [0, 1]."""
        return _column(self.packed, "min_p")

    @property
    def seed(self) -> np.ndarray | jax.Array:
        """(S,) uint32: the row's key is ``fold_in(key(seed), position)``."""
        return _column(self.packed, "seed")

    @property
    def position(self) -> np.ndarray | jax.Array:
        """(S,) int32: the position in its sequence of the token the row draws."""
        return _column(self.packed, "position")

    @property
    def num_banned(self) -> np.ndarray | jax.Array:
        """(S,) int32."""
        return _column(self.packed, "num_banned")

    @property
    def banned(self) -> np.ndarray | jax.Array:
        """(S, MAX_MASKED_STOP_IDS) int32: token ids the row may not draw (the first ``num_banned``)."""
        return self.packed[:, len(_COLUMNS) :]


class SampledTokens(NamedTuple):
    """What the step drew, per row; the log-probabilities only when some row asked for them
    (:attr:`SamplingInputs.logprobs`), else None."""

    token_ids: np.ndarray | jax.Array
    """(S,) int32."""
    logprob: np.ndarray | jax.Array | None = None
    """(S,) float32: the chosen token's log-probability."""
    top_ids: np.ndarray | jax.Array | None = None
    """(S, K) int32, K = min(MAX_LOGPROBS, vocab): the most likely tokens, most likely first."""
    top_logprobs: np.ndarray | jax.Array | None = None
    """(S, K) float32."""


class RowSampling(NamedTuple):
    """One sequence's draw: its parameters, seed, token position and banned ids, and its
    tokens (read only when its parameters have penalties: :mod:`jaxkv.serving.penalties`)."""

    params: SamplingParams
    seed: int
    position: int
    banned: tuple[int, ...] = ()
    history: TokenHistory | None = None


def sampling_inputs(rows: Sequence[RowSampling | None], num_rows: int) -> SamplingInputs:
    """The step's :class:`SamplingInputs` (host arrays) for ``rows`` (None: a row that draws
    nothing this step, sampled greedily and ignored), padded to ``num_rows`` greedy rows.

    The rows' values are gathered in Python lists and written column by column, so a row
    costs no numpy item assignment (bar its banned ids, only while short of ``min_tokens``)."""
    packed = np.zeros((num_rows, len(_COLUMNS) + MAX_MASKED_STOP_IDS), np.int32)
    floats = np.zeros((num_rows, len(_FLOATS)), np.float32)  # temperature, top_p, min_p
    floats[:, 1] = 1.0
    row_floats: list[tuple[float, float, float]] = []
    row_ints: list[tuple[int, int, int]] = []  # top_k, position, num_banned
    seeds: list[int] = []
    logprobs = penalized = False
    for i, row in enumerate(rows):
        if row is None:
            row_floats.append(_IDLE_FLOATS)
            row_ints.append((0, 0, 0))
            seeds.append(0)
            continue
        p, banned = row.params, row.banned
        row_floats.append((p.temperature, p.top_p, p.min_p))
        if p.is_greedy:  # a greedy row's key is unused: its inputs stay the same in every process
            row_ints.append((p.top_k, 0, len(banned)))
            seeds.append(0)
        else:
            row_ints.append((p.top_k, row.position, len(banned)))
            seeds.append(row.seed)
        if banned:
            packed[i, len(_COLUMNS) : len(_COLUMNS) + len(banned)] = banned
        logprobs |= p.logprobs is not None
        penalized |= p.has_penalties or bool(p.logit_bias)
    n = len(row_floats)
    if n:
        floats[:n] = row_floats
        packed[:n, [_AT["top_k"], _AT["position"], _AT["num_banned"]]] = row_ints
        packed[:n, _AT["seed"]] = np.array(seeds, np.uint32).view(np.int32)
    packed[:, [_AT[name] for name in _FLOATS]] = floats.view(np.int32)
    penalties = (
        penalty_inputs([None if r is None else PenaltyRow(r.params, r.position, r.history) for r in rows], num_rows)
        if penalized
        else None
    )
    return SamplingInputs(packed, penalties, logprobs)


def at_positions(inputs: SamplingInputs, positions: jax.Array) -> SamplingInputs:
    """``inputs`` with each row's ``position`` column set to ``positions`` (S,) (traced: the
    step derives them from its metadata, so kept inputs need no update as sequences grow)."""
    packed = jnp.asarray(inputs.packed).at[:, _AT["position"]].set(positions.astype(jnp.int32))
    return dataclasses.replace(inputs, packed=packed)


class SamplingBatch:
    """A step's sampling inputs kept across steps, as vLLM's persistent input batch keeps its
    sampling parameters: the packed rows are rebuilt, and sent to the device, only when the
    step's rows differ from the last step's in what they hold (parameters, seed, banned ids,
    the padded row count); a steady decode step reuses the device array as it is.

    The rows' positions are left out of that comparison: the step sets them from its
    metadata (:func:`at_positions`). A step with penalties or logit bias is rebuilt every
    time (its token history grows each step) and not kept. ``place`` puts the packed rows
    where the step reads them (every step the same placement: nothing recompiles)."""

    def __init__(self, place: Callable[[np.ndarray | jax.Array], jax.Array]) -> None:
        self._place = place
        self._key: list | None = None
        self._inputs: SamplingInputs | None = None

    def inputs(self, rows: Sequence[RowSampling | None], num_rows: int) -> SamplingInputs:
        """The step's :class:`SamplingInputs` for ``rows`` padded to ``num_rows`` (as
        :func:`sampling_inputs`, the packed rows on the device); positions unset."""
        key = [num_rows, *(None if r is None else (r.params, r.seed, r.banned) for r in rows)]
        if key == self._key and self._inputs is not None:
            return self._inputs
        host = sampling_inputs(rows, num_rows)
        inputs = SamplingInputs(self._place(host.packed), host.penalties, host.logprobs)
        self._key, self._inputs = (key, inputs) if host.penalties is None else (None, None)
        return inputs


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


def sample(logits: jax.Array, inputs: SamplingInputs, fed_ids: jax.Array | None = None) -> SampledTokens:
    """Draw one token per row of ``logits`` (S, V) as ``inputs`` say (see the module docstring);
    ``fed_ids`` (S,), the token each row feeds this step, is read only by penalties
    (:func:`~jaxkv.serving.penalties.apply_penalties`) and needed when ``inputs`` have them.

    A step whose rows are all greedy takes the argmax alone: the vocabulary sort and the
    noise of a draw run only when some row samples (a runtime branch, one compile). The
    log-probabilities are computed only when ``inputs.logprobs`` (static) asks for them.
    """
    logits = logits.astype(jnp.float32)
    inputs = SamplingInputs(jnp.asarray(inputs.packed), inputs.penalties, inputs.logprobs)
    masked = _ban(logits, jnp.asarray(inputs.banned), jnp.asarray(inputs.num_banned))
    if inputs.penalties is not None:
        if fed_ids is None:
            raise PenaltyInputsError("penalties need the fed token ids of the step (fed_ids)")
        masked = apply_penalties(masked, inputs.penalties, fed_ids)
    tokens = jax.lax.cond(
        jnp.any(inputs.temperature > 0), _draw, lambda lg, _: jnp.argmax(lg, axis=-1), masked, inputs
    ).astype(jnp.int32)
    if not inputs.logprobs:
        return SampledTokens(tokens)
    raw = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(raw, min(MAX_LOGPROBS, raw.shape[-1]))
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    return SampledTokens(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)
