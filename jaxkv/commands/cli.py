"""What the command-line tools share: memory sizes, a CPU device count set before JAX
starts, a budget checked against the device, help that names the program as it was
started, and refusals as one line on stderr with exit status 2 (absl flag errors included)."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, NoReturn

from absl import flags

from jaxkv.cluster.launcher import CPU_DEVICE_COUNT_FLAG, with_cpu_device_count
from jaxkv.errors import JaxkvError
from jaxkv.ints import is_int
from jaxkv.planner import STATE_LAYOUTS, PlanOptions, StateLayout, StatePoolOptions

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


USAGE_STATUS = 2
"""Exit status of a command refused for bad input (flags, sizes, trace files)."""


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


class CommandLineError(JaxkvError, ValueError):
    """Command-line input that parses but cannot run (prompts longer than the model allows,
    a device count the model's heads cannot split over...); a command prints it as one line."""


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


def device_memory_bytes(device: Any) -> tuple[int, str] | None:
    """(bytes, what they are) of memory on a JAX ``device`` (``Any``: the host core imports
    no JAX), or None if unknown.

    ``device.memory_stats()["bytes_limit"]`` where the backend reports it (GPU, TPU);
    else, on CPU (whose memory_stats is None), the host's physical RAM.
    """
    try:
        stats = device.memory_stats()
    except Exception:
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


def check_fits_device(memory_bytes: int, device: Any, *, name: str = "memory") -> None:
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


PLOTS_MISSING = "--plot needs matplotlib: pip install 'jaxkv[plots]'"


def pyplot(prog: str) -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or :func:`exit_error` naming the
    ``plots`` extra when matplotlib is missing (call it before long work, so a run is
    not lost to a missing package at the end)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        exit_error(prog, PLOTS_MISSING)
    return plt


def save_figure(prog: str, figure: Any, path: str) -> None:
    """Write a matplotlib ``figure`` to ``path`` (PNG by its suffix) and say so; :func:`exit_error` if it cannot."""
    try:
        figure.savefig(path, dpi=120, bbox_inches="tight")
    except (OSError, ValueError) as err:
        exit_error(prog, err)
    print(f"wrote {path}")


JAX_BACKEND_PROBE_LOGGER = "jax._src.xla_bridge"


def quiet_backend_probe() -> None:
    """Keep JAX's INFO record "Unable to initialize backend 'tpu'" (JAX probing for
    accelerators it then does not use) out of a script's output: under absl it reads
    like a failure. Warnings and errors of that logger still show."""
    logging.getLogger(JAX_BACKEND_PROBE_LOGGER).setLevel(logging.WARNING)


def underscored(arg: str, flag_values: flags.FlagValues) -> str:
    """``arg`` with a dashed flag name spelled as defined: ``--max-model-len=8`` -> ``--max_model_len=8``,
    ``--no-prefix-caching`` -> ``--noprefix_caching`` (anything else unchanged)."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg[2:].partition("=")
    if "-" not in name:
        return arg
    plain = name.replace("-", "_")
    if plain in flag_values:
        return f"--{plain}{eq}{value}"
    if plain.startswith("no_") and plain[3:] in flag_values:
        return f"--no{plain[3:]}{eq}{value}"
    return arg


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull")


def program_name(argv: Sequence[str], default: str) -> str:
    """The name a program gives itself in its messages: the file name in ``argv[0]``
    (``serve.py`` from a checkout, ``jaxkv-serve`` installed), else ``default``."""
    return Path(argv[0]).name if argv and argv[0] else default


def invoked_as(argv0: str) -> str:
    """The program in ``argv0`` as a user would start it again: ``jaxkv-serve`` (a console
    script), ``python3 scripts/serve.py`` (a file), ``python3 -m jaxkv.commands.serve``."""
    path = Path(argv0)
    if path.suffix != ".py":
        return path.name
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.origin and Path(spec.origin).resolve() == path.resolve():
        return f"python3 -m {spec.name}"
    return f"python3 {argv0}"


def print_help(
    flag_values: flags.FlagValues,
    *,
    full: bool = False,
    module: str | None = None,
    command: str | None = None,
    invoked: str = "",
) -> None:
    """The program module's docstring (``module``, default ``__main__``), then its flags:
    all of a command's own registry; of absl's global one, the module's (every flag defined
    when ``full``, or when the module defines none). ``command``, the program's installed
    name in the docstring's examples, reads as ``invoked`` (how it was started)."""
    doc = (getattr(sys.modules.get(module or "__main__"), "__doc__", None) or "").strip()
    if command and invoked:
        doc = doc.replace(command, invoked)
    own = flag_values.module_help(module) if module else flag_values.main_module_help()
    listing = "" if full or flag_values is not flags.FLAGS else own.strip()
    listing = listing or flag_values.get_help()
    print(f"{doc}\n\nflags:\n{listing}" if doc else listing)


def flags_parser(
    prog: str, flag_values: flags.FlagValues = flags.FLAGS, *, module: str | None = None, command: str | None = None
) -> Callable[[list[str]], list[str]]:
    """A ``flags_parser`` for ``absl.app.run`` (or a command's ``run()``): a bad flag is one
    line on stderr, exit status 2.

    (absl's own parser prints two lines and exits with 1.) Positional arguments are refused.
    ``--help`` (``-h``, ``--helpshort``) prints the main module's docstring and its flags,
    ``--helpfull`` every flag, on stdout, and exits with 0 (absl's help exits with 1).
    ``module`` names the program's module when it is not ``__main__`` (a console script);
    ``command`` is its installed name, shown in the help as the program was started.
    Every flag takes dashes for underscores too (``--max-model-len``, ``--no-prefix-caching``).
    """

    def parse(argv: list[str]) -> list[str]:
        asked = [arg for arg in argv[1:] if arg in HELP_FLAGS]
        if asked:
            invoked = invoked_as(argv[0]) if argv and argv[0] else ""
            print_help(flag_values, full=asked[0] == "--helpfull", module=module, command=command, invoked=invoked)
            sys.exit(0)
        quiet_backend_probe()
        end = argv.index("--") if "--" in argv else len(argv)
        argv = [argv[0], *(underscored(arg, flag_values) for arg in argv[1:end]), *argv[end:]]
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
    (read with :func:`plan_options`)."""
    flags.DEFINE_enum(
        "state_layout",
        "auto",
        ["auto", *STATE_LAYOUTS],
        "recurrent state: pages of the one KV block pool (shared_pages), a pool of its own (state_pool) or one "
        "attention page per state (attention_pages, vLLM's rule); auto: shared_pages for models with recurrent and "
        "attention layers, state_pool for recurrent layers alone or a tensor-parallel mesh",
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


PLAN_FLAGS = ("block_size", "layout", "max_num_batched_tokens", "head_dim_multiple")
"""Flags named as :class:`~jaxkv.planner.PlanOptions` fields: :func:`plan_options` reads those a command defines."""


def state_layout_flag(value: str) -> StateLayout | None:
    """The planner's ``state_layout`` of a ``--state_layout`` value: ``auto`` is the commands' spelling of None."""
    return next((layout for layout in STATE_LAYOUTS if layout == value), None)


def plan_options(memory_bytes: int, flag_values: flags.FlagValues = flags.FLAGS) -> PlanOptions:
    """The :class:`~jaxkv.planner.PlanOptions` of a serving command's flags: those of
    :data:`PLAN_FLAGS` it defines, ``--state_layout`` and, unless it names another layout,
    a state pool of ``--max_num_seqs`` live requests and ``--checkpoint_share`` of
    ``memory_bytes`` for checkpoints (:func:`define_state_flags`)."""
    values: dict[str, Any] = {name: getattr(flag_values, name) for name in PLAN_FLAGS if name in flag_values}
    state_layout = state_layout_flag(flag_values.state_layout)
    pool = None
    if state_layout in (None, "state_pool"):
        pool = StatePoolOptions(flag_values.max_num_seqs, int(flag_values.checkpoint_share * memory_bytes))
    return PlanOptions(**values, state_layout=state_layout, state_pool=pool)
