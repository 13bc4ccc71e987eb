"""Per-sequence output state: the ``n`` siblings of a request, stops, text, logprobs, deltas.

vLLM's output-processor seam. :class:`OutputProcessor` keeps every unfinished sequence
between :meth:`~jaxkv.serving.engine.Engine.add_request` and its last delta: its
:class:`~jaxkv.serving.stopping.StopChecker` (stop ids and strings, the detokenized text),
its log-probabilities and logits, its arrival and first-token times. Each step it turns
the tokens drawn into :class:`~jaxkv.serving.outputs.RequestDelta` s and, for sequences
that ended, :class:`~jaxkv.serving.outputs.RequestOutput` s; it names the sequences that
stopped so the engine retires them in the scheduler (the one path that frees blocks).

The ``n`` sequences of one request share its prompt's blocks: the first is queued alone,
the others once it has drawn its first token (it has computed the prompt, so they find
every full prompt block in the prefix cache). Host only: no JAX.

With inline text off (:meth:`OutputProcessor.set_inline_text`, what
:class:`~jaxkv.serving.async_engine.AsyncEngine` asks for) the deltas carry token ids only
and stop strings are left to the caller, which detokenizes off the engine's thread
(:mod:`jaxkv.serving.text_stage`) and ends a sequence at a stop string with :meth:`stop`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
from numpy.typing import ArrayLike

from jaxkv.core.manager import Request
from jaxkv.models.text import TextTokenizer
from jaxkv.serving.outputs import RequestDelta, RequestOutput, TokenLogprobs
from jaxkv.serving.sampling_params import FinishReason, SamplingParams
from jaxkv.serving.scheduler import ScheduledChunk, SeqState
from jaxkv.serving.stopping import StopChecker


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences: its own for one, ``id#index`` for several."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def sequence_key(sequence_id: str) -> tuple[str, int]:
    """The request id and index of a sequence id that :func:`sequence_ids` made from a
    request id holding no ``#``."""
    request_id, _, index = sequence_id.partition("#")
    return request_id, int(index or 0)


@dataclass(frozen=True)
class PendingSequence:
    """A sequence not yet handed to the scheduler (a sibling of an ``n`` > 1 request waits
    for the first one's first token)."""

    request_id: str
    index: int
    seed: int
    request: Request
    params: SamplingParams
    arrival: float
    return_logits: bool


@dataclass(eq=False)
class LiveSequence:
    """One sequence in the scheduler (``seq`` is keyed by its own id: the request's id, with
    ``#index`` when the request has ``n`` > 1) and what it has output so far."""

    seq: SeqState
    request_id: str
    index: int
    seed: int
    stopper: StopChecker
    arrival: float
    first_token: float | None = None
    logits: list[np.ndarray] | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    """Per prompt position once scored (None before, and always for the first)."""

    @property
    def params(self) -> SamplingParams:
        return self.stopper.params

    @property
    def scores_prompt(self) -> bool:
        """Whether its steps must score every new token: it asked for ``prompt_logprobs`` and
        has not drawn yet (its prompt's scores go out with its first token)."""
        return self.prompt_logprobs is not None and self.first_token is None


class SampledRows(Protocol):
    """What one step drew, one row per scheduled chunk, read back to the host
    (:class:`~jaxkv.serving.sampler.SampledTokens` as numpy arrays)."""

    @property
    def token_ids(self) -> np.ndarray: ...
    @property
    def logprob(self) -> np.ndarray | None: ...
    @property
    def top_ids(self) -> np.ndarray | None: ...
    @property
    def top_logprobs(self) -> np.ndarray | None: ...


class PromptScores(Protocol):
    """One chunk's scored new tokens, read back to the host
    (:class:`~jaxkv.serving.prompt_logprobs.PromptLogprobs` as numpy arrays)."""

    @property
    def logprob(self) -> ArrayLike: ...
    @property
    def rank(self) -> ArrayLike: ...
    @property
    def top_ids(self) -> ArrayLike: ...
    @property
    def top_logprobs(self) -> ArrayLike: ...


class ProcessedStep(NamedTuple):
    """One step's outputs: a delta per sequence that drew, the sequences that ended, and
    those that stopped (at a stop id or string) for the engine to retire in the scheduler."""

    deltas: list[RequestDelta]
    finished: list[RequestOutput]
    stopped: list[SeqState]


Enqueue = Callable[[Request, SamplingParams], SeqState]
"""Hands one sequence to the scheduler (the engine's), returning its scheduler state."""


class OutputProcessor:
    """The unfinished sequences of one engine, stopping at ``eos_token_ids`` (unless a request
    ignores EOS), with text when there is a ``tokenizer``; ``enqueue`` hands a sequence to
    the scheduler."""

    def __init__(self, eos_token_ids: tuple[int, ...], tokenizer: TextTokenizer | None, enqueue: Enqueue) -> None:
        self.eos_token_ids = eos_token_ids
        self.tokenizer = tokenizer
        self.inline_text = tokenizer is not None
        """Whether deltas and outputs carry text and stop strings are checked here."""
        self._enqueue = enqueue
        self.live: dict[str, LiveSequence] = {}  # by sequence id
        self.requests: dict[str, list[str]] = {}  # a request's unfinished sequence ids
        self._held: dict[str, list[PendingSequence]] = {}  # siblings queued once the first has drawn
        self._aborted: list[RequestDelta] = []  # aborts and caller's stops, reported by the next step
        self._ids = itertools.count()
        self._seeds = np.random.default_rng()

    def set_inline_text(self, inline: bool) -> None:
        """Detokenize and check stop strings here (True, with a tokenizer) or leave both to
        the caller (False: deltas carry no text, outputs none); for the sequences added after
        (each keeps the mode it started with)."""
        self.inline_text = inline and self.tokenizer is not None

    def taken(self, request_id: str, n: int) -> bool:
        """Whether ``request_id`` (or one of its ``n`` sequence ids) names an unfinished sequence."""
        return request_id in self.requests or any(sid in self.live for sid in sequence_ids(request_id, n))

    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        salt: str | None,
        request_id: str | None,
        return_logits: bool,
        arrival: float,
        branch_points: tuple[int, ...] = (),
    ) -> str:
        """Take a checked request: its first sequence queued now, its siblings held; its id."""
        rid = request_id
        if rid is None:
            rid = f"req-{next(self._ids)}"
            while self.taken(rid, params.n):  # a made id never takes a caller's
                rid = f"req-{next(self._ids)}"
        sids = sequence_ids(rid, params.n)
        pending = [
            PendingSequence(
                rid,
                index,
                params.seed + index if params.seed is not None else int(self._seeds.integers(2**32)),
                Request(
                    sid,
                    prompt,
                    cache_salt=salt,
                    skip_reading_prefix_cache=params.prompt_logprobs is not None,
                    branch_points=branch_points,
                ),
                params,
                arrival,
                return_logits,
            )
            for index, sid in enumerate(sids)
        ]
        first = self._queue(pending[0])
        if len(pending) > 1:
            self._held[first.seq.request_id] = pending[1:]
        self.requests[rid] = sids
        return rid

    def _queue(self, pending: PendingSequence) -> LiveSequence:
        seq = self._enqueue(pending.request, pending.params)
        params = pending.params
        detokenizer = None
        if self.inline_text and self.tokenizer is not None:
            detokenizer = self.tokenizer.detokenizer(skip_special_tokens=params.skip_special_tokens)
        live = LiveSequence(
            seq,
            pending.request_id,
            pending.index,
            pending.seed,
            StopChecker(params, self.eos_token_ids, detokenizer),
            pending.arrival,
            logits=[] if pending.return_logits else None,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=None if params.prompt_logprobs is None else [None] * pending.request.num_prompt_tokens,
        )
        self.live[pending.request.request_id] = live
        return live

    def sequences(self, chunks: Sequence[ScheduledChunk]) -> list[LiveSequence]:
        """The sequence of each scheduled chunk."""
        return [self.live[c.seq.request_id] for c in chunks]

    def add_logits(self, chunks: Sequence[ScheduledChunk], logits: np.ndarray) -> None:
        """Keep each drawing chunk's logits row for the sequences that asked for them."""
        for chunk, row in zip(chunks, logits, strict=False):
            live = self.live[chunk.seq.request_id]
            if chunk.samples and live.logits is not None:
                live.logits.append(row)

    def add_prompt_logprobs(self, chunks: Sequence[ScheduledChunk], scored: Sequence[PromptScores]) -> None:
        """Keep, for each sequence that asked for ``prompt_logprobs`` and has not drawn yet, the
        scores of its chunk's prompt tokens (a chunk at position ``p`` scores tokens from
        ``p + 1``; a recomputed chunk, after a preemption, writes the same positions again)."""
        for chunk, scores in zip(chunks, scored, strict=True):
            live = self.live[chunk.seq.request_id]
            if live.prompt_logprobs is None or live.first_token is not None:
                continue
            start = chunk.num_computed_tokens + 1
            count = min(chunk.num_new_tokens, len(live.prompt_logprobs) - start)
            if count <= 0:
                continue
            k = live.params.prompt_logprobs
            tokens = live.seq.request.all_token_ids[start : start + count]
            logprob, rank = np.asarray(scores.logprob)[:count].tolist(), np.asarray(scores.rank)[:count].tolist()
            top_ids = np.asarray(scores.top_ids)[:count, :k].tolist()
            top_logprobs = np.asarray(scores.top_logprobs)[:count, :k].tolist()
            for j, token in enumerate(tokens):
                top = tuple(zip(top_ids[j], top_logprobs[j], strict=True))
                live.prompt_logprobs[start + j] = TokenLogprobs(token, logprob[j], top, rank[j])

    def process(
        self, chunks: Sequence[ScheduledChunk], sampled: SampledRows, at_limit: set[str], now: float
    ) -> ProcessedStep:
        """The tokens ``sampled`` drew for ``chunks`` (already appended by the scheduler, which
        retired the sequences ``at_limit``), as deltas; stops applied."""
        out = ProcessedStep([], [], [])
        tokens = sampled.token_ids.tolist()
        for row, chunk in enumerate(chunks):
            if not chunk.samples:
                continue
            sid = chunk.seq.request_id
            live = self.live[sid]
            delta = self._take_token(live, tokens[row], sampled, row, sid in at_limit, now)
            out.deltas.append(delta)
            if delta.finish_reason is not None:
                out.finished.append(self._output(live, now, delta.finish_reason))
                if sid not in at_limit:
                    out.stopped.append(live.seq)
        return out

    def _take_token(
        self, live: LiveSequence, token: int, sampled: SampledRows, row: int, at_limit: bool, now: float
    ) -> RequestDelta:
        """Record ``token``, what row ``row`` of ``sampled`` drew for ``live``: its text, whether
        it stops the sequence, and the first token's time (the held siblings queued then)."""
        prompt_logprobs = None
        if live.first_token is None:
            if live.prompt_logprobs is not None:
                prompt_logprobs = tuple(live.prompt_logprobs)
            live.first_token = now
            for held in self._held.pop(live.seq.request_id, ()):  # it computed the prompt: its siblings will hit it
                self._queue(held)
        logprobs = None
        if live.logprobs is not None:
            k = live.params.logprobs
            assert sampled.logprob is not None and sampled.top_ids is not None and sampled.top_logprobs is not None
            top = tuple(zip(sampled.top_ids[row, :k].tolist(), sampled.top_logprobs[row, :k].tolist(), strict=True))
            logprobs = (TokenLogprobs(token, float(sampled.logprob[row]), top),)
            live.logprobs.append(logprobs[0])
        text, reason = live.stopper.update(token, live.seq.num_output_tokens)
        if reason is None and at_limit:
            text, reason = text + live.stopper.finish(), "length"
        cached = None
        if reason is not None:
            self._forget(live)
            cached = live.seq.num_cached_tokens
        return RequestDelta(live.request_id, live.index, (token,), text, logprobs, reason, cached, prompt_logprobs)

    def abort(self, request_id: str) -> list[SeqState]:
        """Drop one unfinished request (all its sequences, held siblings too; nothing when
        there is no such request), an "abort" delta each for the next step; the sequences
        the scheduler must retire."""
        seqs: list[SeqState] = []
        for sid in list(self.requests.get(request_id, ())):
            for held in self._held.pop(sid, ()):  # siblings never queued: nothing to retire
                self._aborted.append(RequestDelta(request_id, held.index, (), "", None, "abort"))
                self._drop(request_id, held.request.request_id)
            live = self.live.get(sid)
            if live is not None:
                seqs.append(live.seq)
                finish = live.stopper.finish()
                self._aborted.append(
                    RequestDelta(request_id, live.index, (), finish, None, "abort", live.seq.num_cached_tokens)
                )
                self._forget(live)
        return seqs

    def stop(self, request_id: str, index: int, num_output_tokens: int) -> tuple[SeqState, RequestOutput] | None:
        """End sequence ``index`` of ``request_id`` at a stop string its caller found in its text
        after ``num_output_tokens`` tokens (the tokens drawn past them are dropped): a "stop"
        delta for the next step, and the sequence for the scheduler to retire with its output;
        None when it is not running (finished, aborted, or a sibling not queued yet)."""
        for sid in self.requests.get(request_id, ()):
            live = self.live.get(sid)
            if live is not None and live.index == index and live.first_token is not None:
                break
        else:
            return None
        output = self._output(live, time.perf_counter(), "stop", num_output_tokens)
        self._aborted.append(RequestDelta(request_id, index, (), "", None, "stop", live.seq.num_cached_tokens))
        self._forget(live)
        return live.seq, output

    def take_aborted(self) -> list[RequestDelta]:
        """The abort (and caller's stop) deltas since the last call."""
        out, self._aborted = self._aborted, []
        return out

    def clear(self) -> list[SeqState]:
        """Forget every unfinished sequence (a failed step); those the scheduler held."""
        seqs = [live.seq for live in self.live.values()]
        self.live.clear()
        self.requests.clear()
        self._held.clear()
        self._aborted.clear()
        return seqs

    def _forget(self, live: LiveSequence) -> None:
        """Drop a finished or aborted sequence from the books."""
        self.live.pop(live.seq.request_id, None)
        self._drop(live.request_id, live.seq.request_id)

    def _drop(self, request_id: str, sid: str) -> None:
        sids = self.requests[request_id]
        sids.remove(sid)
        if not sids:
            del self.requests[request_id]

    def _output(self, live: LiveSequence, now: float, reason: FinishReason, cut: int | None = None) -> RequestOutput:
        """The finished sequence's output, its first ``cut`` output tokens (None: all)."""
        seq = live.seq
        req = seq.request
        # A finished sequence was admitted (its prefix hit counted) and drew at least once.
        assert seq.num_cached_tokens is not None and live.first_token is not None
        return RequestOutput(
            request_id=live.request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            output_token_ids=tuple(req.output_token_ids[:cut]),
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            ttft_s=live.first_token - live.arrival,
            finish_s=now - live.arrival,
            logits=None if live.logits is None else np.stack(live.logits[:cut]),
            finish_reason=reason,
            index=live.index,
            text=live.stopper.text if live.stopper.detokenizes else None,
            logprobs=None if live.logprobs is None else tuple(live.logprobs[:cut]),
            prompt_logprobs=None if live.prompt_logprobs is None else tuple(live.prompt_logprobs),
        )
