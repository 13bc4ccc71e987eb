"""Serve a batch of requests with shared prefixes on a tiny model, end to end on device.

Plans the KV cache of a tiny Flax model (default: the Gemma-3-like hybrid, 5 sliding-
window layers : 1 full), then generates greedily for a batch of prompts built from a few
shared prefixes (system prompts) and unique tails, with continuous batching, chunked
prefill, prefix caching and the paged KV cache updated in place by one jitted step.
Prints the plan, progress lines, every request's tokens, throughput, prefix hit rate and
KV usage, and (by default) checks the tokens against the dense, unpaged forward.

    jaxkv-serve
    jaxkv-serve --model tiny-llama --layout per_layer --num_requests 32
    jaxkv-serve --memory 2MiB --max_new_tokens 64      # preemptions
    jaxkv-serve --noprefix_caching --out /tmp/serve.json
    jaxkv-serve --head_dim_multiple 128                # the TPU cache layout anywhere
    jaxkv-serve --verify_uncached                      # cached vs uncached check
    jaxkv-serve --model llama-1b --memory 4GiB --max_model_len 4096 \\
        --prefix_len 1024 --verify_uncached                        # ~1.1e9 bf16 parameters: a GPU
    jaxkv-serve --model tiny-hybrid-kv8 --num_devices 4  # tensor parallel over 4 devices
    jaxkv-serve --model tiny-llama-kv8 --num_processes 2 --num_devices 4
    jaxkv-serve --checkpoint /tmp/tiny-llama           # a Hugging Face-format checkpoint
    jaxkv-serve --checkpoint /tmp/tiny-llama --prompt "Hello there" --prompt "Hello again"

``--checkpoint DIR`` serves the checkpoint saved in DIR (``config.json`` and
``*.safetensors``, :func:`jaxkv.models.checkpoint.load_pretrained`; Llama, Qwen3,
Gemma-3 text...) instead of ``--model``, split over the mesh with ``--num_devices``.
Where DIR has a ``tokenizer.json`` (and the ``tokenizers`` extra is installed), the
outputs are printed decoded too and ``--prompt`` gives text prompts (repeat the flag);
without ``--prompt`` the prompts are token ids with shared prefixes, as for a tiny model.
A sequence stops at the checkpoint's EOS ids (``generation_config.json``, else
``config.json``), its EOS kept as the last token; the dense check cuts its reference there too.

``--num_devices N`` runs the model tensor-parallel on a mesh of N devices (KV heads and
weights split, :mod:`jaxkv.device.mesh`); on CPU the command asks XLA for N host devices
before JAX starts (unless ``XLA_FLAGS`` already sets a count). The model's KV heads must
split evenly over the mesh (the ``-kv8`` tiny models have 8).

``--num_processes N`` (N > 1) starts N copies of this program as one ``jax.distributed``
cluster on this machine (:mod:`jaxkv.cluster.launcher`), each with ``--num_devices``
devices, and the model runs tensor-parallel over all of them (one global mesh): process 0
prints here, ``--out`` is written by process 0, every process runs the same scheduler and
KV cache manager, and a lockstep check (:mod:`jaxkv.cluster.lockstep`) compares their decisions before
every step; a process that fails (a lockstep mismatch included) stops them all with
its exit status.

Paged attention runs with the implementation ``jaxkv.device.ops`` picks for the backend
(``--impl auto``; the plan's first line names it), or the one ``--impl`` names
(``reference``: the jnp oracle; ``xla_gpu``: plain XLA, fast on CPU as well).

Bad input prints one line ``PROGRAM: error: ...`` on stderr (PROGRAM: the file name the
program was started from) and exits with status 2: a flag value out of range or
unreadable, a ``--memory`` budget larger than the device (``memory_stats()["bytes_limit"]``,
or physical RAM on CPU) or too small for one request, a missing jax (the hint names
``jaxkv[device]``). Tokens that differ from the dense reference (checked for float32
models: in bfloat16 a near tie may flip a token) or a failed ``--verify_uncached`` check
exit with status 1.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from absl import flags

from jaxkv.cluster.launcher import ProcessRole, launch
from jaxkv.commands.cli import (
    CommandLineError,
    check_fits_device,
    define_state_flags,
    exit_error,
    flags_parser,
    is_int_range,
    parse_size,
    plan_options,
    program_name,
    request_cpu_devices,
)
from jaxkv.errors import JaxkvError
from jaxkv.planner import LAYOUTS

if TYPE_CHECKING:
    from jaxkv.cluster.lockstep import LockstepCheck
    from jaxkv.serving.engine import Engine, GenerationResult, StepProgress

COMMAND = "jaxkv-serve"
"""The installed name: the help's examples show it as the program was started."""


def define_flags() -> flags.FlagValues:
    """This command's flags, in a registry of its own (absl's global ``FLAGS`` is left alone).

    Imports the device side (the flags list its models and implementations): call it after
    :func:`~jaxkv.commands.cli.request_cpu_devices`, as :func:`run` does.
    """
    from jaxkv.device import ops  # first: without jax, the one error naming jaxkv[device]
    from jaxkv.models.tiny import DTYPES, model_names
    from jaxkv.serving.logit_check import DEFAULT_TOLERANCE

    fv = flags.FlagValues()
    flags.DEFINE_enum(
        "model", "tiny-hybrid", list(model_names()), "model architecture (llama-1b: for a GPU)", flag_values=fv
    )
    flags.DEFINE_string(
        "checkpoint", None, "serve this Hugging Face-format checkpoint directory instead of --model", flag_values=fv
    )
    flags.DEFINE_multi_string(
        "prompt", None, "a text prompt (repeatable; needs tokenizer.json in --checkpoint)", flag_values=fv
    )
    flags.DEFINE_enum(
        "dtype",
        "auto",
        ["auto", *DTYPES],
        "weights, activations and KV cache (auto: the model's own)",
        flag_values=fv,
    )
    flags.DEFINE_integer("seed", 0, "weights and prompts seed", lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("num_requests", 16, "requests in the batch", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("num_prefixes", 2, "distinct shared prefixes (system prompts)", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("prefix_len", 96, "tokens per shared prefix", lower_bound=0, flag_values=fv)
    flags.DEFINE_list("suffix_len", ["8", "48"], "lo,hi tokens of each request's unique tail", flag_values=fv)
    flags.DEFINE_integer(
        "max_new_tokens",
        24,
        "tokens generated per request (fewer where a checkpoint's EOS comes first)",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_string("memory", "4MiB", "KV cache budget: 4MiB, 512KiB or bytes", flag_values=fv)
    flags.DEFINE_integer("max_model_len", 512, "tokens of the longest request", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("block_size", 16, "tokens per block", lower_bound=1, flag_values=fv)
    flags.DEFINE_enum("layout", "cross_layer", LAYOUTS, "KV cache buffer layout", flag_values=fv)
    define_state_flags(fv)
    flags.DEFINE_integer("max_num_seqs", 8, "most requests running at once", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("max_num_batched_tokens", 256, "token budget of one step", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer(
        "head_dim_multiple",
        None,
        "pad the cache's head_dim to a multiple of this (default: 128 on TPU, else 1)",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_boolean("prefix_caching", True, "reuse cached prefix blocks (--noprefix_caching: off)", flag_values=fv)
    flags.DEFINE_enum(
        "impl",
        "auto",
        list(ops.IMPLEMENTATIONS),
        "jaxkv.device.ops implementation (auto: the backend's pick, named in the output)",
        flag_values=fv,
    )
    flags.DEFINE_integer("progress_every", 10, "print a progress line every N steps", lower_bound=1, flag_values=fv)
    flags.DEFINE_boolean(
        "verify",
        True,
        "check the tokens against the dense (unpaged) forward (float32 models: bf16 ties may flip)",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "verify_uncached",
        False,
        "serve the batch again without prefix caching (a second KV cache of --memory) and check the two runs "
        "(jaxkv.serving.logit_check)",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "logit_tolerance",
        DEFAULT_TOLERANCE,
        "--verify_uncached below float32: max |dlogit| <= this x max |logit| up to the first token divergence",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_string("out", None, "write the result as JSON to this path", flag_values=fv)
    flags.DEFINE_integer(
        "num_processes",
        1,
        "processes of one jax.distributed cluster on this machine (> 1: started here)",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "num_devices",
        1,
        "tensor-parallel devices per process: the model and its KV heads split over a mesh of "
        "--num_processes x N (on CPU, XLA makes N host devices unless XLA_FLAGS sets a count)",
        lower_bound=1,
        flag_values=fv,
    )
    flags.register_validator(
        "suffix_len", is_int_range, message="--suffix_len must be lo,hi with 1 <= lo <= hi", flag_values=fv
    )
    flags.register_validator(
        "logit_tolerance",
        lambda v: 0 < v < float("inf"),
        message="--logit_tolerance must be a finite number > 0",
        flag_values=fv,
    )
    return fv


def _suffix_range(fv: flags.FlagValues) -> tuple[int, int]:
    lo, hi = fv.suffix_len
    return int(lo), int(hi)


def _progress_printer(every: int) -> Callable[[StepProgress], None]:
    """A progress callback printing a line every ``every`` steps and at the end."""

    def print_progress(p: StepProgress) -> None:
        if p.step % every == 0 or p.num_finished == p.num_requests:
            print(
                f"step {p.step:5d}  {p.elapsed_s:6.2f}s  tokens {p.num_tokens:4d}  running {p.num_running:3d}  "
                f"waiting {p.num_waiting:3d}  finished {p.num_finished:3d}/{p.num_requests}  usage {p.usage:6.1%}",
                flush=True,
            )

    return print_progress


def _report(result: GenerationResult, engine: Engine) -> str:
    max_ttft = max(o.ttft_s for o in result.outputs)
    blocks = engine.manager.config.num_usable_blocks
    computed, cached = result.scheduled_tokens_per_s, result.num_cached_prompt_tokens
    rows = [
        ("requests", f"{len(result.outputs)} ({result.num_prompt_tokens:,} prompt tokens)"),
        ("steps", f"{result.num_steps:,} ({result.num_compilations} step compilations)"),
        ("throughput", f"{result.output_tokens_per_s:,.1f} output tok/s, {computed:,.1f} computed tok/s"),
        ("TTFT", f"mean {result.mean_ttft_s * 1e3:,.1f} ms, max {max_ttft * 1e3:,.1f} ms"),
        ("prefix hit rate", f"{result.prefix_hit_rate:.1%} of prompt tokens ({cached:,} cached)"),
        ("tokens computed", f"{result.num_scheduled_tokens:,} ({result.num_generated_tokens:,} generated)"),
        ("KV usage", f"peak {result.peak_usage:.1%}, mean {result.mean_usage:.1%} of {blocks:,} blocks"),
        ("preemptions", str(result.num_preemptions)),
        ("wall time", f"{result.wall_s:.2f} s"),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _load_tokenizer(fv: flags.FlagValues, directory: str) -> Any:
    """The checkpoint's ``tokenizer.json`` as a ``tokenizers.Tokenizer``; None when there is
    none (or the ``tokenizers`` extra is missing), unless ``--prompt`` needs it: then a refusal."""
    path = Path(directory) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if fv.prompt:
            raise CommandLineError("--prompt needs the tokenizers library (pip install jaxkv[tokenizers])") from None
        return None
    if not path.exists():
        if fv.prompt:
            raise CommandLineError(f"--prompt needs {path}, which does not exist")
        return None
    return Tokenizer.from_file(str(path))


def _text_prompts(fv: flags.FlagValues, tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """``--prompt`` texts as token ids; a refusal for an empty one or ids past the model's vocabulary."""
    prompts = [tokenizer.encode(text).ids for text in fv.prompt]
    for text, ids in zip(fv.prompt, prompts, strict=True):
        if not ids or max(ids) >= vocab_size or len(ids) >= fv.max_model_len:
            raise CommandLineError(
                f"--prompt={text!r} encodes to {len(ids)} tokens (ids up to {max(ids, default=None)}): it must be "
                f"non-empty, shorter than --max_model_len={fv.max_model_len}, ids < vocab_size={vocab_size}"
            )
    return prompts


def _check_prompts_fit(fv: flags.FlagValues) -> None:
    """Refuse a batch whose longest prompt leaves no room for an output token."""
    longest = fv.prefix_len + _suffix_range(fv)[1]
    if fv.prompt and not fv.checkpoint:
        raise CommandLineError(
            "--prompt needs --checkpoint DIR with a tokenizer.json (a tiny --model has no tokenizer)"
        )
    if fv.prompt:
        return
    if longest >= fv.max_model_len:
        raise CommandLineError(
            f"--prefix_len={fv.prefix_len} + --suffix_len hi={_suffix_range(fv)[1]} = {longest:,} prompt tokens "
            f"leave no room for output in --max_model_len={fv.max_model_len}"
        )


def _check_heads_split(fv: flags.FlagValues) -> None:
    """Refuse a cluster whose devices cannot each hold whole KV heads of the model, before
    launching it."""
    from jaxkv.models.checkpoint import read_config
    from jaxkv.models.tiny import get_model_config

    devices = fv.num_processes * fv.num_devices
    if fv.checkpoint:
        config = read_config(Path(fv.checkpoint))
        heads = config.get("num_key_value_heads") or config.get("num_attention_heads", 1)
        model = f"--checkpoint={fv.checkpoint}"
    else:
        heads = get_model_config(fv.model).num_kv_heads
        model = f"--model={fv.model}"
    if heads % devices:
        raise CommandLineError(
            f"{model} has {heads} KV heads, not a multiple of the {devices} devices of "
            f"--num_processes={fv.num_processes} x --num_devices={fv.num_devices} "
            "(try --model=tiny-llama-kv8)"
        )


def _step_check(name: str) -> LockstepCheck | None:
    """The lockstep check of an engine in a cluster of processes; None in a lone process."""
    import jax

    from jaxkv.cluster import distributed

    return distributed.lockstep_check(name) if jax.process_count() > 1 else None


def _through_first(stop_ids: Sequence[int], tokens: list[int]) -> list[int]:
    """``tokens`` up to and including the first of ``stop_ids`` (all of them if none occurs):
    what a sequence that stops there keeps, as the engine keeps its stop token."""
    end = next((i + 1 for i, token in enumerate(tokens) if token in stop_ids), len(tokens))
    return tokens[:end]


def serve(fv: flags.FlagValues) -> dict:
    """Plan, build, generate, print (with ``fv``, the parsed :func:`define_flags`); return the JSON report."""
    import jax

    from jaxkv.device import ops
    from jaxkv.device.mesh import model_mesh
    from jaxkv.models.checkpoint import eos_token_ids
    from jaxkv.models.loading import load_model
    from jaxkv.models.tiny import dense_greedy_generate
    from jaxkv.serving.engine import Engine, plan_for_model
    from jaxkv.serving.logit_check import EXACT_DTYPES, compare_outputs
    from jaxkv.serving.workloads import shared_prefix_prompts

    start = time.perf_counter()
    _check_prompts_fit(fv)
    memory = parse_size(fv.memory)
    check_fits_device(memory, jax.local_devices()[0], name=f"--memory={fv.memory}")
    dtype = None if fv.dtype == "auto" else fv.dtype
    num_devices = fv.num_devices * jax.process_count()
    mesh = model_mesh(num_devices) if num_devices > 1 else None
    model, model_name, model_dtype = load_model(
        fv.checkpoint, fv.model, dtype=dtype, seed=fv.seed, mesh=mesh, max_model_len=fv.max_model_len
    )
    config = plan_for_model(
        model,
        memory,
        max_model_len=fv.max_model_len,
        options=plan_options(memory, fv),
        max_num_seqs=fv.max_num_seqs,
        tensor_parallel=num_devices,
    )
    backend = jax.default_backend()
    devices = f" x {num_devices} devices" if mesh is not None else ""
    implementation = ops.get_implementation()
    print(
        f"{model_name} ({model_dtype}), {fv.memory}, jaxkv.device.ops implementation "
        f"{implementation!r} on JAX's {backend} backend{devices}:"
    )
    print(config.summary())
    eos = eos_token_ids(fv.checkpoint) if fv.checkpoint else ()
    if eos:
        print(f"a sequence stops at the checkpoint's EOS ids {list(eos)} or after {fv.max_new_tokens} tokens")
    engine = Engine(
        model,
        config,
        enable_caching=fv.prefix_caching,
        max_num_seqs=fv.max_num_seqs,
        mesh=mesh,
        step_check=_step_check("serve"),
        eos_token_ids=eos,
    )
    tokenizer = _load_tokenizer(fv, fv.checkpoint) if fv.checkpoint else None
    if fv.prompt:
        prompts = _text_prompts(fv, tokenizer, model.vocab_size)
    else:
        prompts = shared_prefix_prompts(
            num_requests=fv.num_requests,
            num_prefixes=fv.num_prefixes,
            prefix_len=fv.prefix_len,
            suffix_len=_suffix_range(fv),
            vocab_size=model.vocab_size,
            seed=fv.seed,
        )
    warm = engine.generate([[0] * max(1, min(16, fv.max_model_len - 2))], 2, return_logits=fv.verify_uncached)
    print(f"warm-up: {warm.num_compilations} step shapes compiled in {warm.wall_s:.2f} s")
    shape = "text prompts" if fv.prompt else f"{fv.num_prefixes} shared prefixes of {fv.prefix_len} tokens"
    print(f"serving {len(prompts)} requests ({shape})")
    result = engine.generate(
        prompts, fv.max_new_tokens, progress=_progress_printer(fv.progress_every), return_logits=fv.verify_uncached
    )
    for out in result.outputs:
        print(
            f"{out.request_id:>7}  prompt {len(out.prompt_token_ids):4d}  cached {out.num_cached_tokens:4d}  "
            f"ttft {out.ttft_s * 1e3:7.1f} ms  -> {list(out.output_token_ids)}"
        )
        if tokenizer is not None:
            print(f"{'':>7}  decoded: {tokenizer.decode(list(out.output_token_ids))!r}")
    print(_report(result, engine))
    report: dict[str, Any] = {
        "flags": fv.flag_values_dict(),
        "implementation": implementation,
        "plan": {
            "num_blocks": config.num_blocks,
            "block_bytes": None if config.pages is None else config.pages.block_bytes,
        },
        "result": result.to_dict(),
    }
    if fv.verify_uncached:
        uncached = Engine(
            model,
            config,
            enable_caching=False,
            max_num_seqs=fv.max_num_seqs,
            mesh=mesh,
            step_check=_step_check("uncached"),
            eos_token_ids=eos,
        )
        baseline = uncached.generate(prompts, fv.max_new_tokens, return_logits=True)
        check = compare_outputs(baseline.outputs, result.outputs, dtype=model_dtype, tolerance=fv.logit_tolerance)
        print(f"against a run without prefix caching: {check.summary()}")
        report["uncached_check"] = check.to_dict()
    if fv.verify and model_dtype not in EXACT_DTYPES:
        print(f"dense check skipped: {model_dtype} tokens may flip at near ties; use --verify_uncached")
    elif fv.verify:
        dense = [_through_first(eos, tokens) for tokens in dense_greedy_generate(model, prompts, fv.max_new_tokens)]
        same = dense == [list(o.output_token_ids) for o in result.outputs]
        print(f"tokens identical to the dense (unpaged) forward: {'yes' if same else 'NO'}")
        report["matches_dense"] = same
    print(f"total time {time.perf_counter() - start:.2f} s (model, plan, compile, serve, verify)")
    return report


def main(fv: flags.FlagValues, argv: Sequence[str], prog: str) -> None:
    """Serve with the parsed flags ``fv``: launch a cluster of processes, join one, or run
    alone; refusals are one line on stderr under ``prog``, exit status 2."""
    import jax

    from jaxkv.cluster import distributed
    from jaxkv.device import ops

    role = ProcessRole.from_env()
    try:
        if role is None:
            _check_heads_split(fv)  # before JAX makes the devices: 100,000 host devices would hang it
        if role is None and fv.num_processes > 1:
            try:
                sys.exit(launch([sys.executable, *argv], fv.num_processes, cpu_devices_per_process=fv.num_devices))
            except KeyboardInterrupt:
                exit_error(prog, "interrupted; every process stopped", status=130)
        if role is not None:
            distributed.join(role)
        with ops.set_implementation(fv.impl):
            report = serve(fv)
        if fv.out and jax.process_index() == 0:
            with open(fv.out, "w") as f:
                json.dump(report, f, indent=2)
            print(f"wrote {fv.out}")
    # PlanError, EngineError, ModelConfigError: listed until they subclass JaxkvError too.
    except (JaxkvError, OSError) as err:
        exit_error(prog, err)
    if report.get("matches_dense") is False:
        exit_error(prog, "the engine's tokens differ from the dense reference", status=1)
    if report.get("uncached_check", {}).get("passed") is False:
        exit_error(prog, f"prefix caching failed the check: {report['uncached_check']['summary']}", status=1)


def run(argv: Sequence[str] | None = None) -> None:
    """The console script ``jaxkv-serve`` on ``argv`` (default ``sys.argv``): ask XLA for the
    CPU devices ``--num_devices`` needs, import JAX, parse the flags, serve."""
    argv = list(sys.argv if argv is None else argv)
    prog = program_name(argv, COMMAND)
    request_cpu_devices(argv)  # before JAX starts: its CPU backend's device count
    try:
        fv = define_flags()
    except JaxkvError as err:  # jax missing or outside the tested range: the pip hint
        exit_error(prog, err)
    flags_parser(prog, fv, module=__name__, command=COMMAND)(argv)
    main(fv, argv, prog)


if __name__ == "__main__":
    run()
