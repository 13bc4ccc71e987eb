"""Timing shared by the benchmark scripts."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax


def best_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time of one call (its result waited for), after one warm-up call (compilation)."""
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return best
