"""Synthetic prompt batches for the serving demo and benchmark: shared prefixes + unique tails."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int, is_int


class WorkloadError(JaxkvError, ValueError):
    """A workload knob out of range."""


def _suffix_range(value: object) -> tuple[int, int]:
    ok = isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 2
    if not (ok and is_int(value[0]) and is_int(value[1]) and 1 <= value[0] <= value[1]):
        raise WorkloadError(f"suffix_len must be a range (lo, hi) of ints with 1 <= lo <= hi, got {value!r:.80}")
    return int(value[0]), int(value[1])


def shared_prefix_prompts(
    *,
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[list[int]]:
    """``num_requests`` prompts: request i is prefix ``i % num_prefixes`` + a unique random tail.

    Prefixes are ``prefix_len`` random tokens (like system prompts); tail lengths are
    drawn uniformly from ``suffix_len = (lo, hi)``, both inclusive, ``lo >= 1``. A bad
    knob raises :class:`WorkloadError` naming it and its value.
    """
    for name, value, minimum in (
        ("num_requests", num_requests, 1),
        ("num_prefixes", num_prefixes, 1),
        ("prefix_len", prefix_len, 0),
        ("vocab_size", vocab_size, 1),
        ("seed", seed, 0),
    ):
        check_int(name, value, minimum=minimum, error=WorkloadError)
    lo, hi = _suffix_range(suffix_len)
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, prefix_len).tolist() for _ in range(num_prefixes)]
    return [
        prefixes[i % num_prefixes] + rng.integers(0, vocab_size, int(rng.integers(lo, hi + 1))).tolist()
        for i in range(num_requests)
    ]
