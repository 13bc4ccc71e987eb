"""Synthetic prompt batches for the serving demo and benchmark: shared prefixes + unique tails."""

from __future__ import annotations

import numpy as np


class WorkloadError(ValueError):
    """A workload knob out of range."""


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
    drawn uniformly from ``suffix_len = (lo, hi)``, both inclusive, ``lo >= 1``.
    """
    lo, hi = suffix_len
    checks = [
        ("num_requests", num_requests, num_requests >= 1),
        ("num_prefixes", num_prefixes, num_prefixes >= 1),
        ("prefix_len", prefix_len, prefix_len >= 0),
        ("suffix_len", suffix_len, 1 <= lo <= hi),
        ("vocab_size", vocab_size, vocab_size >= 1),
    ]
    for name, value, ok in checks:
        if not ok:
            raise WorkloadError(f"bad {name}: {value!r}")
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab_size, prefix_len).tolist() for _ in range(num_prefixes)]
    return [
        prefixes[i % num_prefixes] + rng.integers(0, vocab_size, int(rng.integers(lo, hi + 1))).tolist()
        for i in range(num_requests)
    ]
