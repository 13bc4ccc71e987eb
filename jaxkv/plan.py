"""Print the KV cache plan of a preset model for a memory budget.

    python -m jaxkv.plan --preset gemma-3-27b --memory 16GiB --max-model-len 32768

Flags are absl flags kept in a private registry (importing this module defines no
global flags); ``--max-model-len`` and ``--max_model_len`` spellings both work. Bad
arguments print one line on stderr and exit with status 2; a plan that cannot be
made (budget too small for one request, pages that cannot be unified) exits with 1.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from fractions import Fraction

from absl import flags

from jaxkv.planner import (
    LAYOUT_KINDS,
    TPU_HEAD_DIM_MULTIPLE,
    IncompatibleSpecsError,
    InsufficientMemoryError,
    PlanError,
    plan_kv_cache,
)
from jaxkv.presets import UnknownPresetError, get_preset, list_presets
from jaxkv.specs import DEFAULT_MAX_NUM_BATCHED_TOKENS

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


class SizeError(ValueError):
    """A memory size that cannot be read."""


def parse_size(text: str) -> int:
    """Bytes in ``text``: "16GiB", "512MiB", "1.5GB", "17179869184" (fractions floor)."""
    match = _SIZE.fullmatch(text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        units = ", ".join(u for u in _UNITS if u)
        raise SizeError(f"cannot read memory size {text!r}; use bytes or one of {units}")
    size = int(Fraction(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise SizeError(f"memory size must be positive, got {text!r}")
    return size


def _define_flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("preset", None, f"model: {', '.join(list_presets())}", flag_values=fv)
    flags.DEFINE_string(
        "memory", None, "KV cache budget: 16GiB, 512MiB, 1.5GB or bytes", flag_values=fv
    )
    flags.DEFINE_integer("max_model_len", None, "tokens of the longest request", flag_values=fv)
    flags.DEFINE_integer("block_size", 16, "base tokens per block", flag_values=fv)
    flags.DEFINE_enum("layout", "cross_layer", LAYOUT_KINDS, "buffer layout", flag_values=fv)
    flags.DEFINE_integer(
        "max_num_batched_tokens",
        DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "tokens one step may add to a request (sizes sliding/chunked spans)",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "head_dim_multiple",
        1,
        f"round attention head sizes up to a multiple of this ({TPU_HEAD_DIM_MULTIPLE}: TPU tiles)",
        flag_values=fv,
    )
    flags.DEFINE_boolean("help", False, "show this help", flag_values=fv)
    for name in ("max_model_len", "block_size", "max_num_batched_tokens", "head_dim_multiple"):
        flags.DEFINE_alias(name.replace("_", "-"), name, flag_values=fv)
    return fv


def _fail(message: str, status: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI on ``argv`` (default sys.argv); return the exit status."""
    fv = _define_flags()
    argv = list(sys.argv if argv is None else argv)
    try:
        extra = fv(argv)
    except flags.Error as err:
        return _fail(str(err).splitlines()[0], 2)
    if fv.help:
        print(fv.get_help())
        return 0
    if len(extra) > 1:
        return _fail(f"unexpected arguments: {' '.join(extra[1:])}", 2)
    for name in ("preset", "memory", "max_model_len"):
        if fv[name].value is None:
            return _fail(f"--{name} is required", 2)
    try:
        specs = get_preset(fv.preset)
        memory = parse_size(fv.memory)
    except (UnknownPresetError, SizeError) as err:
        return _fail(str(err), 2)
    try:
        config = plan_kv_cache(
            specs,
            memory,
            max_model_len=fv.max_model_len,
            block_size=fv.block_size,
            layout=fv.layout,
            max_num_batched_tokens=fv.max_num_batched_tokens,
            head_dim_multiple=fv.head_dim_multiple,
        )
    except (InsufficientMemoryError, IncompatibleSpecsError) as err:
        return _fail(str(err), 1)
    except PlanError as err:
        return _fail(str(err), 2)
    print(f"{fv.preset}: {len(specs)} cached layers")
    print(config.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
