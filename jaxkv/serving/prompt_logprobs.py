"""Log-probabilities of a prompt's tokens under the model, from the logits at prefill positions.

vLLM's ``prompt_logprobs`` (and OpenAI's legacy ``echo`` with ``logprobs``) score each
prompt token ``i >= 1`` by the model's distribution after tokens ``< i``: the logits
at position ``i - 1``. A serving step computes logits only at each sequence's last new
token; the variant here asks the model for them at every new token
(:func:`every_position`) and reduces them on the device to what comes back, per token:
the log-probability of the token that follows it, that token's rank (vLLM reports it) and
the top :data:`~jaxkv.serving.sampling_params.MAX_LOGPROBS`. The token that follows a chunk's
last one is in the next chunk (chunked prefill) or is the draw: the host sends it
(:func:`next_token_ids`), so a prompt split over steps is scored exactly as in one.

A prompt position the prefix cache supplied is computed by no step, so it has no
logits: a request that wants prompt log-probabilities must compute its whole prompt
(vLLM skips the prefix cache for such a request too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.device.metadata import StepMetadata
from jaxkv.serving.sampler import SamplingInputs
from jaxkv.serving.sampling_params import MAX_LOGPROBS
from jaxkv.serving.scheduler import ScheduledChunk


@jax.tree_util.register_dataclass
class _EveryPosition(StepMetadata):
    """A step's metadata whose ``logits_indices`` are all its tokens (the model's logits
    come back ``(T, vocab)``, one row per new token, padding included)."""

    @property
    def logits_indices(self) -> jax.Array:
        return jnp.arange(self.input_ids.shape[0])


def every_position(meta: StepMetadata) -> StepMetadata:
    """``meta`` asking the model for logits at every new token, not only each sequence's last."""
    return _EveryPosition(meta.packed, meta.packing, meta.group_layers)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ScoredInputs(SamplingInputs):
    """A step's sampling inputs and, for scoring, the token after each sequence's last new
    one (``next_ids`` (S,) int32: :func:`next_token_ids`); ``with_logits`` (static): the step
    also returns the logits each token was drawn from."""

    next_ids: np.ndarray | jax.Array | None = None
    with_logits: bool = dataclasses.field(default=False, metadata={"static": True})


class PromptLogprobs(NamedTuple):
    """Per new token ``t`` of a step (or of one chunk, once split): the token after it scored."""

    logprob: np.ndarray | jax.Array
    """(T,) float32: log-probability of the token that follows ``t``."""
    rank: np.ndarray | jax.Array
    """(T,) int32: 1 + how many tokens are more likely than it."""
    top_ids: np.ndarray | jax.Array
    """(T, K) int32, K = min(MAX_LOGPROBS, vocab): the most likely next tokens, most likely first."""
    top_logprobs: np.ndarray | jax.Array
    """(T, K) float32."""


def next_token_ids(chunks: Sequence[ScheduledChunk], num_rows: int) -> np.ndarray:
    """(num_rows,) int32: for each chunk, the id of the token after its last one when the host
    knows it (the next chunk's first prompt token), else 0 (a draw: not a prompt token)."""
    out = np.zeros(num_rows, np.int32)
    for i, chunk in enumerate(chunks):
        end = chunk.num_computed_tokens + chunk.num_new_tokens
        if end < chunk.seq.request.num_prompt_tokens:
            out[i] = chunk.seq.request.all_token_ids[end]
    return out


def score_positions(logits: jax.Array, meta: StepMetadata, next_ids: jax.Array) -> PromptLogprobs:
    """:class:`PromptLogprobs` of every new token from ``logits`` (T, vocab) at every position;
    ``next_ids`` (S,): the token after each sequence's last new token (:func:`next_token_ids`).
    Each leaf has a leading axis of one (the runner cuts its outputs to the step's sequences)."""
    num_tokens = logits.shape[0]
    cu = meta.cu_q_lens
    position = jnp.arange(num_tokens)
    seq = jnp.clip(jnp.searchsorted(cu, position, side="right") - 1, 0, cu.shape[0] - 2)
    following = jnp.concatenate([meta.input_ids[1:], jnp.zeros(1, meta.input_ids.dtype)])
    targets = jnp.where(position == cu[seq + 1] - 1, jnp.asarray(next_ids)[seq], following)
    raw = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(raw, min(MAX_LOGPROBS, raw.shape[-1]))
    chosen = jnp.take_along_axis(raw, targets[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(raw > chosen[:, None], axis=-1, dtype=jnp.int32)
    return PromptLogprobs(chosen[None], rank[None], top_ids.astype(jnp.int32)[None], top_logprobs[None])


def split_by_chunk(scored: PromptLogprobs, chunks: Sequence[ScheduledChunk]) -> list[PromptLogprobs]:
    """The host's :class:`PromptLogprobs` of a step (leading axis of one) cut into each chunk's
    new tokens, in the step's order (decodes first, as the metadata lays them out)."""
    out, start = [], 0
    for chunk in chunks:
        end = start + chunk.num_new_tokens
        out.append(PromptLogprobs(*(np.asarray(leaf)[0, start:end] for leaf in scored)))
        start = end
    return out
