"""Text for token-only deltas, off the engine's thread (vLLM v1's frontend detokenizer).

An engine with inline text off (:meth:`~jaxkv.serving.engine.Engine.set_inline_text`)
reports each sequence's tokens without text and stops only at stop ids and lengths.
:class:`TextStage` gives those deltas their text where they are read (the
:class:`~jaxkv.serving.async_engine.AsyncEngine`'s event loop): one
:class:`~jaxkv.serving.stopping.StopChecker` per sequence, fed the same tokens in the same
order as the engine's own would be, so the pieces, the held-back tail, the text cut at a
stop string (``include_stop_str_in_output`` honoured) and the partial-character rule are
those of inline text. A stop string found here is found a step or more after its token
was drawn: the stage holds the sequence's last delta, names the sequence for the engine to
end (:meth:`~jaxkv.serving.engine.Engine.stop_sequence`), drops what the engine drew past
it, and releases the held delta when the engine reports the sequence finished (with the
prompt tokens it found cached). Host only: no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxkv.models.text import TextTokenizer
from jaxkv.serving.outputs import RequestDelta
from jaxkv.serving.sampling_params import SamplingParams
from jaxkv.serving.stopping import StopChecker


@dataclass(eq=False, slots=True)
class _SequenceText:
    """One sequence's text so far: its checker, the tokens it took, and (stopped at a
    string) the delta held until the engine reports the sequence finished."""

    stopper: StopChecker
    num_tokens: int = 0
    held: RequestDelta | None = None
    finished: bool = False


@dataclass(frozen=True, slots=True)
class StopAt:
    """A stop string ended sequence ``index`` of ``request_id`` after ``num_output_tokens``
    tokens: the engine is to end it there."""

    request_id: str
    index: int
    num_output_tokens: int


@dataclass(slots=True)
class Texted:
    """What :meth:`TextStage.process` made of one engine delta: the delta to hand on (None:
    nothing yet) and the stop, when it found a stop string, for the engine."""

    delta: RequestDelta | None
    stop: StopAt | None = None


@dataclass(eq=False)
class TextStage:
    """The text of every request added and unfinished, over ``tokenizer``, with the engine's
    ``eos_token_ids`` (as its own :class:`~jaxkv.serving.stopping.StopChecker` s have them)."""

    tokenizer: TextTokenizer
    eos_token_ids: tuple[int, ...]
    _requests: dict[str, list[_SequenceText]] = field(default_factory=dict)

    def add(self, request_id: str, params: SamplingParams) -> None:
        """Start the text of a request's ``params.n`` sequences (before the engine reports any)."""
        detokenizer = self.tokenizer.detokenizer
        skip = params.skip_special_tokens
        self._requests[request_id] = [
            _SequenceText(StopChecker(params, self.eos_token_ids, detokenizer(skip_special_tokens=skip)))
            for _ in range(params.n)
        ]

    def drop(self, request_id: str) -> None:
        """Forget a request (failed, or its stream ended with an error)."""
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, delta: RequestDelta) -> Texted:
        """``delta`` (token ids, from the engine) with its text, as inline text would have
        given it (filled in place); a delta of a request not added passes as it is. A tokenizer error
        propagates: the request's text cannot go on (drop it and abort it)."""
        sequences = self._requests.get(delta.request_id)
        if sequences is None:
            return Texted(delta)
        seq = sequences[delta.index]
        if seq.held is not None:  # stopped at a string: the engine's draws past it are dropped
            if not delta.finished:
                return Texted(None)
            held, seq.held = seq.held, None
            held.num_cached_tokens = delta.num_cached_tokens
            self._done(delta.request_id, seq)
            return Texted(held)
        ended = delta.finished
        text, reason = "", None
        for token in delta.token_ids:  # one a step; none in an abort's delta
            seq.num_tokens += 1
            piece, reason = seq.stopper.update(token, seq.num_tokens)
            text += piece
        if reason is None and ended:
            text, reason = text + seq.stopper.finish(), delta.finish_reason
        delta.text, delta.finish_reason = text, reason  # the engine keeps no delta: filled in place
        if reason is not None and not ended:  # a stop string: the engine runs on until told
            seq.held = delta
            return Texted(None, StopAt(delta.request_id, delta.index, seq.num_tokens))
        if ended:
            self._done(delta.request_id, seq)
        return Texted(delta)

    def _done(self, request_id: str, seq: _SequenceText) -> None:
        """``seq`` had its last delta; the request is forgotten once all its sequences have."""
        seq.finished = True
        if all(s.finished for s in self._requests[request_id]):
            del self._requests[request_id]
