"""Print the KV cache plan of a preset model for a memory budget.

    python -m jaxkv.commands.plan --preset gemma-3-27b --memory 16GiB --max-model-len 32768

Flags are absl flags kept in a private registry (importing this module defines no
global flags); ``--max-model-len`` and ``--max_model_len`` spellings both work. Bad
arguments (unknown or unparsable flags, sizes that are not positive, counts below 1)
and plans that cannot be made (a budget too small for one request, which names the
smallest that fits; pages that cannot be unified) print one line ``jaxkv.commands.plan: error:
...`` on stderr and exit with status 2, as every jaxkv command refuses bad input.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from absl import flags

from jaxkv.commands.cli import USAGE_STATUS, SizeError, parse_size, print_error, state_layout_flag
from jaxkv.planner import (
    LAYOUTS,
    STATE_LAYOUTS,
    TPU_HEAD_DIM_MULTIPLE,
    PlanError,
    PlanOptions,
    StatePoolOptions,
    plan_kv_cache,
)
from jaxkv.presets import UnknownPresetError, get_preset, list_presets
from jaxkv.specs import DEFAULT_MAX_NUM_BATCHED_TOKENS

PROG = "jaxkv.commands.plan"


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
        "auto",
        ["auto", *STATE_LAYOUTS],
        "where Mamba states live: pages of the one block pool (shared_pages), in attention pages (vLLM's rule) "
        "or in a state pool of their own; auto: shared_pages for hybrids with recurrent layers, state_pool for "
        "recurrent layers alone or --tensor_parallel > 1",
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
        return _fail(str(err).splitlines()[0], USAGE_STATUS)
    if fv.help:
        print(fv.get_help())
        return 0
    if len(extra) > 1:
        return _fail(f"unexpected arguments: {' '.join(extra[1:])}", USAGE_STATUS)
    for name in ("preset", "memory", "max_model_len"):
        if fv[name].value is None:
            return _fail(f"--{name} is required", USAGE_STATUS)
    try:
        specs = get_preset(fv.preset)
        memory = parse_size(fv.memory)
        checkpoint_bytes = 0 if fv.checkpoint_memory is None else parse_size(fv.checkpoint_memory)
    except (UnknownPresetError, SizeError) as err:
        return _fail(str(err), USAGE_STATUS)
    try:
        sizes = (
            None
            if fv.max_num_seqs is None and not checkpoint_bytes
            else StatePoolOptions(fv.max_num_seqs, checkpoint_bytes)
        )
        options = PlanOptions(
            block_size=fv.block_size,
            layout=fv.layout,
            max_num_batched_tokens=fv.max_num_batched_tokens,
            head_dim_multiple=fv.head_dim_multiple,
            state_layout=state_layout_flag(fv.state_layout),
            state_pool=sizes,
            tensor_parallel=fv.tensor_parallel,
        )
        if sizes is not None and options.state_layout_for(specs) != "state_pool":
            raise PlanError(
                f"max_num_seqs={sizes.max_num_seqs} and checkpoint_bytes={sizes.checkpoint_bytes} size a state pool; "
                f"state_layout={options.state_layout_for(specs)!r} has none (use --state_layout=state_pool)"
            )
        config = plan_kv_cache(specs, memory, max_model_len=fv.max_model_len, options=options)
    except PlanError as err:  # InsufficientMemoryError, IncompatibleSpecsError included
        return _fail(str(err), USAGE_STATUS)
    print(f"{fv.preset}: {len(specs)} cached layers")
    print(config.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
