"""When one sequence stops, and the text it streams (host side, one object per sequence).

A sequence stops (``finish_reason`` "stop") at a stop token id (the checkpoint's EOS
ids unless ``ignore_eos``, and ``stop_token_ids``; the step never draws one before
``min_tokens``: :meth:`StopChecker.banned`) or once its text contains a ``stop``
string (checked from ``min_tokens`` on); else it runs to its length limit.
With a tokenizer its text is streamed as pieces: the stop token's text is left out,
the text ends before a stop string (after it with ``include_stop_str_in_output``), and
while stop strings are asked for the last
``len(longest) - 1`` characters are held back (they may be the start of one), so a
stream never shows text that a stop string later takes back. Without a detokenizer it
stops at stop ids only: the text, and the stop strings with it, are then the caller's
(:mod:`jaxkv.serving.text_stage` runs a checker with one off the engine's thread).
"""

from __future__ import annotations

from jaxkv.models.text import IncrementalDetokenizer
from jaxkv.serving.sampling_params import FinishReason, SamplingParams


class StopChecker:
    """The stop rules and the text of one sequence of ``params``, ``eos_token_ids`` being the checkpoint's."""

    def __init__(
        self, params: SamplingParams, eos_token_ids: tuple[int, ...], detokenizer: IncrementalDetokenizer | None
    ) -> None:
        self.params = params
        ids = set(params.stop_token_ids) if params.ignore_eos else {*params.stop_token_ids, *eos_token_ids}
        self.stop_token_ids = tuple(sorted(ids))
        self._detokenizer = detokenizer
        self._hold = max((len(s) for s in params.stop), default=1) - 1
        self._pending = ""  # text decoded but not emitted (a stop string may begin in it)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """The text emitted so far."""
        return "".join(self._pieces)

    @property
    def detokenizes(self) -> bool:
        """Whether it has text (a detokenizer) and checks stop strings."""
        return self._detokenizer is not None

    def banned(self, num_output_tokens: int) -> tuple[int, ...]:
        """The ids the next draw may not be: the stop ids while short of ``min_tokens``."""
        return self.stop_token_ids if num_output_tokens < self.params.min_tokens else ()

    def update(self, token_id: int, num_output_tokens: int) -> tuple[str, FinishReason | None]:
        """Take the sequence's newest token (its ``num_output_tokens``-th): the text it adds
        and "stop" when the sequence stops at it, else None."""
        if token_id in self.stop_token_ids:
            return self.finish(), "stop"
        if self._detokenizer is None:
            return "", None
        if not self.params.stop:  # nothing held back: the piece as decoded
            piece = self._detokenizer.add_token(token_id)
            if piece:
                self._pieces.append(piece)
            return piece, None
        text = self._pending + self._detokenizer.add_token(token_id)
        if num_output_tokens >= self.params.min_tokens:
            found = [(i, -len(s)) for i, s in ((text.find(s), s) for s in self.params.stop) if i >= 0]
            if found:
                start, minus_length = min(found)  # the earliest, the longest there
                self._pending = ""
                end = start - minus_length if self.params.include_stop_str_in_output else start
                return self._emit(text[:end]), "stop"
        cut = max(len(text) - self._hold, 0)
        self._pending = text[cut:]
        return self._emit(text[:cut]), None

    def finish(self) -> str:
        """The text held back, when the sequence ends for another reason than a stop string."""
        if self._detokenizer is None:
            return ""
        text, self._pending = self._pending + self._detokenizer.flush(), ""
        return self._emit(text)

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece
