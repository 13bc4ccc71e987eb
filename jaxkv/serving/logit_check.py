"""Do two runs of the same prompts agree? An honest check of tokens and logits.

Prefix caching must not change what a model computes, but two runs never compute in
the same shapes: a cached request reads K/V written by an earlier step instead of
recomputing them in its own prefill, so matmuls are blocked and summed differently.

- **float32** models (full matmul precision) differ only in rounding far below any
  gap between logits that matters: the greedy tokens must be **identical**.
- **narrower dtypes** (bfloat16 keeps 8 bits of mantissa) move logits by about 2^-8
  relative per rounding, and a near tie between the two best tokens may flip; after
  that the two runs continue different texts and nothing more can be compared. So the
  check is on the logits instead: at every sampled position up to and including each
  request's first token divergence, ``max |Δlogit| <= tolerance * max |logit|``
  (default tolerance 2^-4), over all compared positions.

:func:`compare_outputs` returns a :class:`LogitCheck`; its :meth:`~LogitCheck.summary`
is one line for a report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxkv.errors import JaxkvError
from jaxkv.serving.outputs import RequestOutput

DEFAULT_TOLERANCE = 2.0**-4
"""Relative logit tolerance of narrow dtypes: ``max |Δlogit| <= tol * max |logit|``."""
EXACT_DTYPES = ("float32",)
"""Dtypes whose runs must give identical tokens."""


class LogitCheckError(JaxkvError, ValueError):
    """Two runs that cannot be compared (other prompts, missing logits, bad tolerance)."""


@dataclass(frozen=True)
class LogitCheck:
    """The outcome of :func:`compare_outputs`.

    ``first_divergence`` is ``(request index, output position)`` of the first request
    (in order) whose tokens differ, or None. ``max_abs_diff`` and ``max_abs_logit`` are
    over the compared positions (NaN when no logits were given); ``num_positions``
    counts them.
    """

    dtype: str
    tolerance: float | None
    identical_tokens: bool
    num_tokens: int
    num_diverged: int
    first_divergence: tuple[int, int] | None
    num_positions: int
    max_abs_diff: float
    max_abs_logit: float
    passed: bool

    def summary(self) -> str:
        """One line: the verdict, the rule applied and the numbers it was decided on."""
        verdict = "PASS" if self.passed else "FAIL"
        tokens = (
            f"tokens identical ({self.num_tokens:,})"
            if self.first_divergence is None
            else f"{self.num_diverged} request(s) diverge, first at request {self.first_divergence[0]} "
            f"token {self.first_divergence[1]}"
        )
        if self.tolerance is None:
            return f"{verdict}: {self.dtype} must give identical tokens: {tokens}"
        return (
            f"{verdict}: {self.dtype} logits within {self.tolerance:g} x max |logit| up to the first divergence: "
            f"max |dlogit| {self.max_abs_diff:.4g} vs {self.tolerance * self.max_abs_logit:.4g} "
            f"(max |logit| {self.max_abs_logit:.4g}) over {self.num_positions:,} positions; {tokens}"
        )

    def to_dict(self) -> dict:
        """JSON-able fields, plus the summary line."""
        return {**dataclasses.asdict(self), "summary": self.summary()}


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(
    baseline: Sequence[RequestOutput],
    candidate: Sequence[RequestOutput],
    *,
    dtype: str,
    tolerance: float = DEFAULT_TOLERANCE,
) -> LogitCheck:
    """Compare two runs of the same prompts, request by request.

    ``dtype`` is the model's: in :data:`EXACT_DTYPES` the tokens must be identical
    (logits, when present, are reported but not judged); otherwise both runs need
    logits (``Engine.generate(..., return_logits=True)``) and they are judged up to and
    including each request's first divergence. Runs of other prompts, or missing
    logits, raise :class:`LogitCheckError`.
    """
    if not (np.isfinite(tolerance) and tolerance > 0):
        raise LogitCheckError(f"tolerance must be a finite number > 0, got {tolerance!r}")
    if [o.prompt_token_ids for o in baseline] != [o.prompt_token_ids for o in candidate]:
        raise LogitCheckError(f"the runs served other prompts ({len(baseline)} vs {len(candidate)} requests)")
    exact = dtype in EXACT_DTYPES
    with_logits = all(o.logits is not None for o in (*baseline, *candidate))
    if not exact and not with_logits:
        raise LogitCheckError(f"a {dtype} check compares logits: generate both runs with return_logits=True")
    diverged = []
    max_diff = max_logit = 0.0
    num_positions = 0
    for index, (a, b) in enumerate(zip(baseline, candidate, strict=True)):
        split = _first_difference(a.output_token_ids, b.output_token_ids)
        if split is not None:
            diverged.append((index, split))
        if with_logits:
            la, lb = a.logits, b.logits
            assert la is not None and lb is not None  # with_logits: checked above
            end = min(len(la), len(lb), len(la) if split is None else split + 1)
            if end:
                diff = float(np.abs(la[:end] - lb[:end]).max())
                max_diff = max(max_diff, np.inf if np.isnan(diff) else diff)  # NaN never passes
                max_logit = max(max_logit, float(np.abs(la[:end]).max()))
                num_positions += end
    if not with_logits:
        max_diff = max_logit = float("nan")
    identical = not diverged
    passed = identical if exact else max_diff <= tolerance * max_logit
    return LogitCheck(
        dtype=dtype,
        tolerance=None if exact else tolerance,
        identical_tokens=identical,
        num_tokens=sum(len(o.output_token_ids) for o in baseline),
        num_diverged=len(diverged),
        first_divergence=diverged[0] if diverged else None,
        num_positions=num_positions,
        max_abs_diff=max_diff,
        max_abs_logit=max_logit,
        passed=passed,
    )
