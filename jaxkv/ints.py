"""Integer helpers shared by every module: ceiling division and int checks.

``bool`` is never an int here (``True`` as a block count is a bug), and numpy
integers are (token ids and counts often come from arrays). Host-only: no JAX.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import TypeGuard

from jaxkv.errors import JaxkvError


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def is_int(value: object) -> TypeGuard[int]:
    """An int or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, *, minimum: int = 1, error: type[JaxkvError] = JaxkvError) -> int:
    """``value`` as an int; raise ``error`` naming ``name`` unless it is an int >= ``minimum``."""
    if not is_int(value) or value < minimum:
        kind = {0: "a non-negative int", 1: "a positive int"}.get(minimum, f"an int >= {minimum}")
        raise error(f"{name} must be {kind}, got {value!r}")
    return int(value)


def check_int_range(name: str, value: object, *, error: type[JaxkvError] = JaxkvError) -> tuple[int, int]:
    """``value`` as ``(lo, hi)``; raise ``error`` naming ``name`` unless it is two ints with ``1 <= lo <= hi``."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)) and len(value) == 2:
        lo, hi = value
        if is_int(lo) and is_int(hi) and 1 <= lo <= hi:
            return int(lo), int(hi)
    raise error(f"{name} must be a range (lo, hi) of ints with 1 <= lo <= hi, got {value!r:.80}")
