"""Request checks before anything is queued: prompts, sampling parameters, salts.

vLLM's input-processor seam: :class:`InputProcessor` turns what a caller passes to
:meth:`~jaxkv.serving.engine.Engine.generate` or ``add_request`` into token lists,
:class:`~jaxkv.serving.sampling_params.SamplingParams` (a bare ``max_new_tokens`` is greedy
decoding) and cache salts, checked against one engine's vocabulary, ``max_model_len``,
EOS ids and tokenizer, or refuses with :class:`EngineError` naming the first bad value
(nothing queued). Host only: no JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.core.manager import KVCacheManagerError, token_id_list
from jaxkv.errors import JaxkvError
from jaxkv.ints import is_int
from jaxkv.serving.sampling_params import MAX_MASKED_STOP_IDS, SamplingParams
from jaxkv.serving.stopping import StopChecker


class EngineError(JaxkvError, ValueError):
    """An engine set-up or a generate call the engine cannot serve; nothing was run."""


class InputProcessor:
    """Checks requests for an engine of ``vocab_size`` tokens and ``max_model_len``, stopping
    at ``eos_token_ids``; stop strings need ``has_tokenizer``."""

    def __init__(
        self, vocab_size: int, max_model_len: int, eos_token_ids: tuple[int, ...], *, has_tokenizer: bool
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.has_tokenizer = has_tokenizer

    def check(
        self, prompts: object, max_new_tokens: object, cache_salt: object
    ) -> tuple[list[list[int]], list[SamplingParams], list[str | None]]:
        """Prompts as token lists, per-prompt sampling parameters and salts;
        :class:`EngineError` naming the first bad value."""
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
            raise EngineError(f"prompts must be a list of token-id sequences, got {prompts!r:.80}")
        if not len(prompts):
            raise EngineError("generate needs at least one prompt")
        if is_int(prompts[0]):
            raise EngineError("prompts must be a list of prompts, got a flat list of ints (wrap one prompt in a list)")
        n = len(prompts)
        limits = per_prompt(
            "max_new_tokens",
            max_new_tokens,
            n,
            scalar=lambda v: isinstance(v, SamplingParams) or not isinstance(v, Sequence),
        )
        salts = per_prompt("cache_salt", cache_salt, n, scalar=lambda v: v is None or isinstance(v, str))
        vocab = self.vocab_size
        max_len = self.max_model_len
        out = []
        params = []
        for i, (prompt, limit, salt) in enumerate(zip(prompts, limits, salts, strict=True)):
            params.append(self.params(i, limit))
            if salt is not None and not isinstance(salt, str):
                raise EngineError(f"prompt {i}: cache_salt must be a str or None, got {salt!r}")
            try:
                ids = token_id_list(prompt, f"prompt {i}")
            except KVCacheManagerError as err:
                raise EngineError(str(err)) from None
            if not ids:
                raise EngineError(f"prompt {i} is empty")
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise EngineError(f"prompt {i}: token {bad!r} is not an id in [0, {vocab})")
            if len(ids) >= max_len:
                raise EngineError(
                    f"prompt {i} has {len(ids)} tokens; max_model_len={max_len} leaves no room for an output token"
                )
            out.append(ids)
        return out, params, salts

    def params(self, i: int, limit: object) -> SamplingParams:
        """Prompt ``i``'s sampling parameters (a bare limit: greedy), checked against this engine."""
        if not isinstance(limit, SamplingParams):
            if not is_int(limit) or limit <= 0:
                raise EngineError(
                    f"prompt {i}: max_new_tokens must be a positive int, got {limit!r} (or a SamplingParams)"
                )
            return SamplingParams.greedy(int(limit))
        if limit.stop and not self.has_tokenizer:
            raise EngineError(f"prompt {i}: stop strings {limit.stop!r} need a tokenizer, and this engine has none")
        vocab = self.vocab_size
        bad = next((t for t in limit.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise EngineError(f"prompt {i}: stop token {bad} is not an id in [0, {vocab})")
        bad = next((t for t in limit.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise EngineError(f"prompt {i}: logit_bias token {bad} is not an id in [0, {vocab})")
        stop_ids = StopChecker(limit, self.eos_token_ids, None).stop_token_ids
        if limit.min_tokens and len(stop_ids) > MAX_MASKED_STOP_IDS:
            raise EngineError(
                f"prompt {i}: min_tokens={limit.min_tokens} masks at most {MAX_MASKED_STOP_IDS} stop ids, "
                f"got {len(stop_ids)} (EOS included)"
            )
        return limit


def per_prompt(name: str, value: object, n: int, *, scalar: Callable[[object], bool]) -> list:
    """One value per prompt: ``value`` repeated when it is a scalar, else its items."""
    if scalar(value):
        return [value] * n
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise EngineError(f"{name} must be one value or one per prompt, got {value!r:.80}")
    if len(value) != n:
        raise EngineError(f"{len(value)} {name} values for {n} prompts")
    return list(value)
