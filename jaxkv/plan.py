"""Print the KV cache plan of a preset model for a memory budget.

    python -m jaxkv.plan --preset gemma-3-27b --memory 16GiB --max-model-len 32768

Flags are absl flags kept in a private registry (importing this module defines no
global flags); ``--max-model-len`` and ``--max_model_len`` spellings both work. Bad
arguments (unknown or unparsable flags, sizes that are not positive, counts below 1)
print one line ``jaxkv.plan: error: ...`` on stderr and exit with status 2; a plan that
cannot be made (budget too small for one request, pages that cannot be unified) exits
with 1.

The module also holds what the scripts share: :func:`parse_size`, :func:`is_int_range`,
:func:`request_cpu_devices` (a CPU device count set before JAX starts),
:func:`device_memory_bytes` / :func:`check_fits_device` (refuse a KV budget larger than
the device) and :func:`flags_parser` / :func:`exit_error` (absl flag errors and refused
input as one line on stderr, exit status 2).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import NoReturn

from absl import flags

from jaxkv.errors import JaxkvError
from jaxkv.ints import is_int
from jaxkv.planner import (
    LAYOUTS,
    STATE_LAYOUTS,
    TPU_HEAD_DIM_MULTIPLE,
    IncompatibleSpecsError,
    InsufficientMemoryError,
    PlanError,
    plan_kv_cache,
)
from jaxkv.presets import UnknownPresetError, get_preset, list_presets
from jaxkv.specs import DEFAULT_MAX_NUM_BATCHED_TOKENS

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "pb": 10**15,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "pib": 1 << 50,
}
# ASCII digits only, at most 24 before and after the point: no 5000-digit literal
# reaches int() (Python refuses those with a raw ValueError).
_SIZE = re.compile(r"\s*([0-9]{1,24}(?:\.[0-9]{0,24})?|\.[0-9]{1,24})\s*([a-zA-Z]*)\s*")


PROG = "jaxkv.plan"
USAGE_STATUS = 2
"""Exit status of a command refused for bad input (flags, sizes, trace files)."""


CPU_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def with_cpu_device_count(xla_flags: str, count: int) -> str:
    """``xla_flags`` asking XLA for ``count`` host-platform devices (an earlier count replaced)."""
    kept = re.sub(rf"{CPU_DEVICE_COUNT_FLAG}=\S*", "", xla_flags).split()
    return " ".join([*kept, f"{CPU_DEVICE_COUNT_FLAG}={count}"])


def request_cpu_devices(argv: Sequence[str], flag: str = "num_devices") -> None:
    """Give JAX's CPU backend as many devices as ``--<flag>=N`` (or ``--<flag> N``) in
    ``argv`` asks for, through ``XLA_FLAGS``; call it before JAX is imported (XLA reads
    the flag once, when its CPU backend starts). A device count already in ``XLA_FLAGS``
    wins; a value that is not a positive int is left for the flag parser to refuse."""
    value = None
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{flag}="):
            value = arg.split("=", 1)[1]
        elif arg == f"--{flag}" and i + 1 < len(argv):
            value = argv[i + 1]
    xla_flags = os.environ.get("XLA_FLAGS", "")
    if value is None or not value.isdigit() or int(value) < 1 or CPU_DEVICE_COUNT_FLAG in xla_flags:
        return
    os.environ["XLA_FLAGS"] = with_cpu_device_count(xla_flags, int(value))


class SizeError(JaxkvError, ValueError):
    """A memory size that cannot be read."""


class DeviceMemoryError(SizeError):
    """A KV cache budget larger than the memory of the device that would hold it."""


def parse_size(text: str) -> int:
    """Bytes in ``text``: "16GiB", "512MiB", "1.5GB", "17179869184" (fractions floor).

    Raises :class:`SizeError` naming ``text`` unless it is a positive size of at most
    24 digits before and after the decimal point.
    """
    if not isinstance(text, str):
        raise SizeError(f"memory size must be a str such as '16GiB', got {text!r}")
    match = _SIZE.fullmatch(text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        units = ", ".join(u for u in _UNITS if u)
        raise SizeError(f"cannot read memory size {text!r:.60}; use bytes or one of {units}")
    size = int(Fraction(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise SizeError(f"memory size must be positive, got {text!r}")
    return size


_INT = re.compile(r"\s*[0-9]{1,18}\s*")


def is_int_range(value: Sequence[str]) -> bool:
    """Whether a list flag's value is ``lo,hi``: two ASCII ints with ``1 <= lo <= hi < 10**18``."""
    if len(value) != 2 or not all(_INT.fullmatch(v) for v in value):
        return False
    return 1 <= int(value[0]) <= int(value[1])


def _format_bytes(n: int) -> str:
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:,.1f} {unit})"
    return f"{n:,} bytes"


def device_memory_bytes(device: object) -> tuple[int, str] | None:
    """(bytes, what they are) of memory on a JAX ``device``, or None if unknown.

    ``device.memory_stats()["bytes_limit"]`` where the backend reports it (GPU, TPU);
    else, on CPU (whose memory_stats is None), the host's physical RAM.
    """
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without stats raise various errors
        stats = None
    limit = stats.get("bytes_limit") if isinstance(stats, dict) else None
    if is_int(limit) and limit > 0:
        return int(limit), f"{device} bytes_limit"
    if getattr(device, "platform", None) == "cpu":
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        if ram > 0:
            return ram, f"{device} physical RAM"
    return None


def check_fits_device(memory_bytes: int, device: object, *, name: str = "memory") -> None:
    """Raise :class:`DeviceMemoryError` if a ``memory_bytes`` budget exceeds ``device``'s memory.

    Unknown device memory passes (nothing to compare with).
    """
    known = device_memory_bytes(device)
    if known is not None and memory_bytes > known[0]:
        raise DeviceMemoryError(
            f"{name} budget of {_format_bytes(memory_bytes)} exceeds the device memory: "
            f"{_format_bytes(known[0])} ({known[1]})"
        )


def print_error(prog: str, message: object) -> None:
    """Print ``{prog}: error: {message}`` on stderr, as one line (the message's first)."""
    lines = str(message).strip().splitlines() or [""]
    print(f"{prog}: error: {lines[0]}", file=sys.stderr)


def exit_error(prog: str, message: object, status: int = USAGE_STATUS) -> NoReturn:
    """:func:`print_error`, then exit with ``status``."""
    print_error(prog, message)
    sys.exit(status)


def write_json(prog: str, path: str, report: object) -> None:
    """Write ``report`` as indented JSON to ``path`` and say so; :func:`exit_error` if
    the file cannot be written."""
    try:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
    except OSError as err:
        exit_error(prog, err)
    print(f"wrote {path}")


def flags_parser(prog: str, flag_values: flags.FlagValues = flags.FLAGS) -> Callable[[list[str]], list[str]]:
    """A ``flags_parser`` for ``absl.app.run``: a bad flag is one line on stderr, exit status 2.

    (absl's own parser prints two lines and exits with 1.) Positional arguments are refused.
    """

    def parse(argv: list[str]) -> list[str]:
        try:
            rest = flag_values(argv)
        except flags.Error as err:
            exit_error(prog, err)
        if len(rest) > 1:
            exit_error(prog, f"unexpected arguments: {' '.join(rest[1:])}")
        return rest

    return parse


def define_state_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """``--state_layout`` and ``--checkpoint_share``, for the scripts that serve models
    (see :func:`jaxkv.serving.engine.state_plan`)."""
    flags.DEFINE_enum(
        "state_layout",
        "auto",
        ["auto", *STATE_LAYOUTS],
        "recurrent state: a pool of its own (state_pool) or one attention page per state (attention_pages, "
        "vLLM's rule); auto: state_pool for models with recurrent layers",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "checkpoint_share",
        0.1,
        "state_pool: share of --memory for state checkpoints",
        lower_bound=0.0,
        upper_bound=0.9,
        flag_values=flag_values,
    )


def _define_flags() -> flags.FlagValues:
    fv = flags.FlagValues()
    flags.DEFINE_string("preset", None, f"model: {', '.join(list_presets())}", flag_values=fv)
    flags.DEFINE_string("memory", None, "KV cache budget: 16GiB, 512MiB, 1.5GB or bytes", flag_values=fv)
    flags.DEFINE_integer("max_model_len", None, "tokens of the longest request", flag_values=fv)
    flags.DEFINE_integer("block_size", 16, "base tokens per block", flag_values=fv)
    flags.DEFINE_enum("layout", "cross_layer", LAYOUTS, "buffer layout", flag_values=fv)
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
    flags.DEFINE_enum(
        "state_layout",
        "attention_pages",
        STATE_LAYOUTS,
        "where Mamba states live: in attention pages (vLLM's rule) or in a state pool of their own",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "max_num_seqs",
        None,
        "state_pool: live states for this many running requests (default: balanced)",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "checkpoint_memory", None, "state_pool: bytes of states kept for prefix-cache checkpoints", flag_values=fv
    )
    flags.DEFINE_integer(
        "tensor_parallel",
        1,
        "devices the KV heads are split over (a mesh's model axis); the summary prints the bytes per device",
        flag_values=fv,
    )
    flags.DEFINE_boolean("help", False, "show this help", flag_values=fv)
    for name in (
        "max_model_len",
        "block_size",
        "max_num_batched_tokens",
        "head_dim_multiple",
        "state_layout",
        "max_num_seqs",
        "checkpoint_memory",
        "tensor_parallel",
    ):
        flags.DEFINE_alias(name.replace("_", "-"), name, flag_values=fv)
    return fv


def _fail(message: object, status: int) -> int:
    print_error(PROG, message)
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
        checkpoint_bytes = 0 if fv.checkpoint_memory is None else parse_size(fv.checkpoint_memory)
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
            state_layout=fv.state_layout,
            max_num_seqs=fv.max_num_seqs,
            checkpoint_bytes=checkpoint_bytes,
            tensor_parallel=fv.tensor_parallel,
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
