"""Per-request generation parameters, under vLLM's names, checked when made.

:class:`SamplingParams` is what a client asks of one request: how to draw each token
(``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``), how many sequences
(``n``), how many tokens (``max_tokens``, ``min_tokens``), when to stop (``stop``
strings, ``stop_token_ids``, the checkpoint's EOS unless ``ignore_eos``), how to bend
the distribution (``presence_penalty``, ``frequency_penalty``, ``repetition_penalty``,
``logit_bias``: vLLM's semantics, :mod:`jaxkv.serving.penalties`) and how many top
log-probabilities to return per token (``logprobs``) and per prompt token
(``prompt_logprobs``: :mod:`jaxkv.serving.prompt_logprobs`). A bad value is a
:class:`SamplingParamsError` naming it, raised by the constructor: a request never
reaches the engine with one. Temperature 0 is greedy decoding (the argmax), the
engine's default for a bare ``max_new_tokens``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, TypeGuard

from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int, is_int

FinishReason = Literal["stop", "length", "abort"]
"""Why a sequence ended: a stop token or string, ``max_tokens`` (or ``max_model_len``),
or an abort (a client that left, an explicit :meth:`~jaxkv.serving.engine.Engine.abort`)."""

MAX_LOGPROBS = 20
"""The most top log-probabilities a token may return (OpenAI's limit): the jitted step
always computes this many, so a request's ``logprobs`` compiles nothing."""

MAX_MASKED_STOP_IDS = 32
"""The most stop token ids (EOS included) a request with ``min_tokens`` may have: the
step masks them with a fixed-width row per sequence."""


MAX_N = 128
"""The most sequences one request may ask for (OpenAI's bound): each is a sequence the
engine schedules, so ``n`` is capped where a client sets it."""

MAX_TOP_K = 2**31 - 1
"""The largest ``top_k`` (the step carries it in an int32 row; any vocabulary is smaller)."""

MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
"""Stop strings are checked against each new piece of text: their number and length are
bounded so one request cannot slow every step of the engine it shares."""

MAX_STOP_TOKEN_IDS = 1024
"""The most ``stop_token_ids`` one request may list."""

MAX_LOGIT_BIAS = 1024
"""The most ``logit_bias`` entries one request may list (the step carries them in a row per
sequence, padded to the widest row of the step)."""

LOGIT_BIAS_LIMIT = 100.0
"""A bias is clamped to [-100, 100], as vLLM clamps it (OpenAI's documented range)."""


class SamplingParamsError(JaxkvError, ValueError):
    """A sampling parameter out of its range (the message names it and its value)."""


def _is_number(value: object) -> TypeGuard[int | float]:
    """An int or float, not a bool."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _number(name: str, value: object, low: float, high: float, *, low_open: bool = False) -> float:
    """``value`` as a float in ``[low, high]`` (``(low, high]`` when ``low_open``); NaN fails."""
    if not _is_number(value) or math.isnan(value):
        raise SamplingParamsError(f"{name} must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise SamplingParamsError(f"{name} must be in {bound}, got {value!r}")
    return float(value)


def _count(name: str, value: object, minimum: int) -> int:
    return check_int(name, value, minimum=minimum, error=SamplingParamsError)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates (see the module docstring). ``top_k`` 0 (or -1, vLLM's
    old spelling) keeps every token; ``seed`` None draws a seed per sequence; with a
    seed and ``n`` > 1 sequence ``i`` uses ``seed + i``. ``max_tokens`` None: up to
    ``max_model_len``. ``stop`` strings need a tokenizer (the engine refuses them
    without one); the text ends before the stop string (after it with
    ``include_stop_str_in_output``), the tokens at the one that completed it. Text
    leaves special tokens out unless ``skip_special_tokens`` is False."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    prompt_logprobs: int | None = None
    """Score every prompt token after the first and return its log-probability with the
    ``prompt_logprobs`` most likely tokens' (0..:data:`MAX_LOGPROBS`); such a request
    computes its whole prompt (it reads nothing from the prefix cache, as in vLLM)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "n", _count("n", self.n, 1))
        if self.n > MAX_N:
            raise SamplingParamsError(f"n must be at most {MAX_N}, got {self.n!r}")
        set_(self, "temperature", _number("temperature", self.temperature, 0.0, 100.0))
        set_(self, "top_p", _number("top_p", self.top_p, 0.0, 1.0, low_open=True))
        set_(self, "min_p", _number("min_p", self.min_p, 0.0, 1.0))
        top_k = -1 if is_int(self.top_k) and self.top_k == -1 else _count("top_k", self.top_k, 0)
        if top_k > MAX_TOP_K:
            raise SamplingParamsError(f"top_k must be at most {MAX_TOP_K} (0 or -1: every token), got {top_k!r}")
        set_(self, "top_k", max(top_k, 0))
        if self.seed is not None:
            set_(self, "seed", _count("seed", self.seed, 0))
            if self.seed + self.n > 2**32:
                raise SamplingParamsError(f"seed + n must fit in 32 bits, got seed={self.seed!r}, n={self.n}")
        if self.max_tokens is not None:
            set_(self, "max_tokens", _count("max_tokens", self.max_tokens, 1))
        set_(self, "min_tokens", _count("min_tokens", self.min_tokens, 0))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        set_(self, "stop", self._strings(self.stop))
        set_(self, "stop_token_ids", self._ids(self.stop_token_ids))
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logprobs is not None:
            set_(self, "logprobs", _count("logprobs", self.logprobs, 0))
            if self.logprobs > MAX_LOGPROBS:
                raise SamplingParamsError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.prompt_logprobs is not None:
            if is_int(self.prompt_logprobs) and self.prompt_logprobs == -1:
                raise SamplingParamsError(
                    f"prompt_logprobs=-1 (the whole vocabulary) is not supported: at most {MAX_LOGPROBS}"
                )
            set_(self, "prompt_logprobs", _count("prompt_logprobs", self.prompt_logprobs, 0))
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise SamplingParamsError(
                    f"prompt_logprobs must be at most {MAX_LOGPROBS}, got {self.prompt_logprobs!r}"
                )
        set_(self, "presence_penalty", _number("presence_penalty", self.presence_penalty, -2.0, 2.0))
        set_(self, "frequency_penalty", _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0))
        repetition = self.repetition_penalty
        if not _is_number(repetition) or not math.isfinite(repetition) or repetition <= 0:
            raise SamplingParamsError(f"repetition_penalty must be a finite number > 0, got {repetition!r}")
        set_(self, "repetition_penalty", float(repetition))
        set_(self, "logit_bias", self._bias(self.logit_bias))

    @classmethod
    def greedy(cls, max_tokens: int) -> SamplingParams:
        """Greedy decoding of up to ``max_tokens`` tokens (what a bare ``max_new_tokens`` means)."""
        return cls(temperature=0.0, max_tokens=max_tokens)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """Whether some penalty is away from its neutral value (the step then needs the token history)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @staticmethod
    def _bias(bias: object) -> Mapping[int, float] | None:
        """``logit_bias`` as a read-only map of token ids (ints, or their decimal strings as JSON
        keys send them) to biases clamped to +-:data:`LOGIT_BIAS_LIMIT`; None when empty."""
        if bias is None:
            return None
        if not isinstance(bias, Mapping):
            raise SamplingParamsError(f"logit_bias must be a map of token ids to numbers, got {bias!r:.200}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(f"logit_bias may list at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
        out: dict[int, float] = {}
        for key, value in bias.items():
            token = int(key) if isinstance(key, str) and key.strip().isdecimal() else key
            if not is_int(token) or token < 0:
                raise SamplingParamsError(f"logit_bias keys must be token ids >= 0, got {key!r:.80}")
            if not _is_number(value) or math.isnan(value):
                raise SamplingParamsError(f"logit_bias values must be numbers, got {value!r:.80} for {key!r:.80}")
            out[int(token)] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
        return MappingProxyType(out) if out else None

    @staticmethod
    def _strings(stop: object) -> tuple[str, ...]:
        """``stop`` (one string or several) as a tuple of non-empty strings."""
        items = (stop,) if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise SamplingParamsError(f"stop must be a non-empty string or a list of them, got {stop!r:.200}")
        if len(items) > MAX_STOP_STRINGS:
            raise SamplingParamsError(f"stop may list at most {MAX_STOP_STRINGS} strings, got {len(items)}")
        longest = max(items, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise SamplingParamsError(
                f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, got one of {len(longest)}"
            )
        return tuple(items)

    @staticmethod
    def _ids(ids: object) -> tuple[int, ...]:
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
            raise SamplingParamsError(f"stop_token_ids must be a list of ints >= 0, got {ids!r:.200}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(f"stop_token_ids may list at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
        return tuple(int(t) for t in ids)
