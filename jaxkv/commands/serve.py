"""Serve a batch of requests with shared prefixes on a tiny model, end to end on device.

Plans the KV cache of a tiny Flax model (default: the Gemma-3-like hybrid, 5 sliding-
window layers : 1 full), then generates greedily for a batch of prompts built from a few
shared prefixes (system prompts) and unique tails, with continuous batching, chunked
prefill, prefix caching and the paged KV cache updated in place by one jitted step.
Prints the plan, progress lines, every request's tokens, throughput, prefix hit rate and
KV usage, and (by default) checks the tokens against the dense, unpaged forward.

    python scripts/serve.py
    python scripts/serve.py --model tiny-llama --layout per_layer --num_requests 32
    python scripts/serve.py --memory 2MiB --max_new_tokens 64      # preemptions
    python scripts/serve.py --noprefix_caching --out /tmp/serve.json
    python scripts/serve.py --head_dim_multiple 128                # the TPU cache layout anywhere
    python scripts/serve.py --verify_uncached                      # cached vs uncached check
    python scripts/serve.py --model llama-1b --memory 4GiB --max_model_len 4096 \
        --prefix_len 1024 --verify_uncached                        # ~1.1e9 bf16 parameters: a GPU
    python scripts/serve.py --model tiny-hybrid-kv8 --num_devices 4  # tensor parallel over 4 devices
    python scripts/serve.py --model tiny-llama-kv8 --num_processes 2 --num_devices 4
    python scripts/serve.py --checkpoint /tmp/tiny-llama           # a Hugging Face-format checkpoint
    python scripts/serve.py --checkpoint /tmp/tiny-llama --prompt "Hello there" --prompt "Hello again"

``--checkpoint DIR`` serves the checkpoint saved in DIR (``config.json`` and
``*.safetensors``, :func:`jaxkv.models.checkpoint.load_pretrained`; Llama, Qwen3,
Gemma-3 text...) instead of ``--model``, split over the mesh with ``--num_devices``.
Where DIR has a ``tokenizer.json`` (and the ``tokenizers`` extra is installed), the
outputs are printed decoded too and ``--prompt`` gives text prompts (repeat the flag);
without ``--prompt`` the prompts are token ids with shared prefixes, as for a tiny model.

``--num_devices N`` runs the model tensor-parallel on a mesh of N devices (KV heads and
weights split, :mod:`jaxkv.device.mesh`); on CPU the script asks XLA for N host devices
before JAX starts (unless ``XLA_FLAGS`` already sets a count). The model's KV heads must
split evenly over the mesh (the ``-kv8`` tiny models have 8).

``--num_processes N`` (N > 1) starts N copies of this script as one ``jax.distributed``
cluster on this machine (:mod:`jaxkv.cluster.launcher`), each with ``--num_devices``
devices, and the model runs tensor-parallel over all of them (one global mesh): process 0
prints here, ``--out`` is written by process 0, every process runs the same scheduler and
KV cache manager,
and a lockstep check (:mod:`jaxkv.cluster.lockstep`) compares their decisions before
every step; a process that fails (a lockstep mismatch included) stops them all with
its exit status.

Paged attention runs with jaxkv.device.ops' XLA formulation by default (``--impl xla_gpu``: plain
XLA, fast on CPU as well); ``--impl reference`` uses the jnp oracle.

Bad input prints one line ``serve.py: error: ...`` on stderr and exits with status 2:
a flag value out of range or unreadable, a ``--memory`` budget larger than the device
(``memory_stats()["bytes_limit"]``, or physical RAM on CPU) or too small for one
request. Tokens that differ from the dense reference (checked for float32 models: in
bfloat16 a near tie may flip a token) or a failed ``--verify_uncached`` check exit with
status 1.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxkv.commands.cli import request_cpu_devices

request_cpu_devices(sys.argv)  # before JAX starts: its CPU backend's device count

import jax  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from jaxkv.cluster import distributed  # noqa: E402
from jaxkv.cluster.launcher import ProcessRole, launch  # noqa: E402
from jaxkv.cluster.lockstep import LockstepCheck  # noqa: E402
from jaxkv.commands.cli import (  # noqa: E402
    check_fits_device,
    define_state_flags,
    exit_error,
    flags_parser,
    is_int_range,
    parse_size,
)
from jaxkv.device import ops  # noqa: E402
from jaxkv.device.mesh import model_mesh  # noqa: E402
from jaxkv.errors import JaxkvError  # noqa: E402
from jaxkv.models.checkpoint import read_config  # noqa: E402
from jaxkv.models.loading import load_model  # noqa: E402
from jaxkv.models.tiny import (  # noqa: E402
    DTYPES,
    dense_greedy_generate,
    get_model_config,
    model_names,
)
from jaxkv.planner import LAYOUTS  # noqa: E402
from jaxkv.serving.engine import (  # noqa: E402
    Engine,
    GenerationResult,
    StepProgress,
    plan_for_model,
)
from jaxkv.serving.logit_check import DEFAULT_TOLERANCE, EXACT_DTYPES, compare_outputs  # noqa: E402
from jaxkv.serving.workloads import shared_prefix_prompts  # noqa: E402

PROG = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "jaxkv-serve"
"""The program's name in its messages: ``serve.py`` from a checkout, ``jaxkv-serve`` installed."""
FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "tiny-hybrid", list(model_names()), "model architecture (llama-1b: for a GPU)")
flags.DEFINE_string("checkpoint", None, "serve this Hugging Face-format checkpoint directory instead of --model")
flags.DEFINE_multi_string("prompt", None, "a text prompt (repeatable; needs tokenizer.json in --checkpoint)")
flags.DEFINE_enum("dtype", "auto", ["auto", *DTYPES], "weights, activations and KV cache (auto: the model's own)")
flags.DEFINE_integer("seed", 0, "weights and prompts seed", lower_bound=0)
flags.DEFINE_integer("num_requests", 16, "requests in the batch", lower_bound=1)
flags.DEFINE_integer("num_prefixes", 2, "distinct shared prefixes (system prompts)", lower_bound=1)
flags.DEFINE_integer("prefix_len", 96, "tokens per shared prefix", lower_bound=0)
flags.DEFINE_list("suffix_len", ["8", "48"], "lo,hi tokens of each request's unique tail")
flags.DEFINE_integer("max_new_tokens", 24, "tokens generated per request", lower_bound=1)
flags.DEFINE_string("memory", "4MiB", "KV cache budget: 4MiB, 512KiB or bytes")
flags.DEFINE_integer("max_model_len", 512, "tokens of the longest request", lower_bound=1)
flags.DEFINE_integer("block_size", 16, "tokens per block", lower_bound=1)
flags.DEFINE_enum("layout", "cross_layer", LAYOUTS, "KV cache buffer layout")
define_state_flags()
flags.DEFINE_integer("max_num_seqs", 8, "most requests running at once", lower_bound=1)
flags.DEFINE_integer("max_num_batched_tokens", 256, "token budget of one step", lower_bound=1)
flags.DEFINE_integer(
    "head_dim_multiple",
    None,
    "pad the cache's head_dim to a multiple of this (default: 128 on TPU, else 1)",
    lower_bound=1,
)
flags.DEFINE_boolean("prefix_caching", True, "reuse cached prefix blocks (--noprefix_caching: off)")
flags.DEFINE_enum("impl", "xla_gpu", list(ops.IMPLEMENTATIONS), "jaxkv.device.ops implementation")
flags.DEFINE_integer("progress_every", 10, "print a progress line every N steps", lower_bound=1)
flags.DEFINE_boolean(
    "verify", True, "check the tokens against the dense (unpaged) forward (float32 models: bf16 ties may flip)"
)
flags.DEFINE_boolean(
    "verify_uncached",
    False,
    "serve the batch again without prefix caching (a second KV cache of --memory) and check the two runs "
    "(jaxkv.serving.logit_check)",
)
flags.DEFINE_float(
    "logit_tolerance",
    DEFAULT_TOLERANCE,
    "--verify_uncached below float32: max |dlogit| <= this x max |logit| up to the first token divergence",
    lower_bound=0,
)
flags.DEFINE_string("out", None, "write the result as JSON to this path")
flags.DEFINE_integer(
    "num_processes", 1, "processes of one jax.distributed cluster on this machine (> 1: started here)", lower_bound=1
)
flags.DEFINE_integer(
    "num_devices",
    1,
    "tensor-parallel devices per process: the model and its KV heads split over a mesh of "
    "--num_processes x N (on CPU, XLA makes N host devices unless XLA_FLAGS sets a count)",
    lower_bound=1,
)
flags.register_validator("suffix_len", is_int_range, message="--suffix_len must be lo,hi with 1 <= lo <= hi")
flags.register_validator(
    "logit_tolerance", lambda v: 0 < v < float("inf"), message="--logit_tolerance must be a finite number > 0"
)


def _suffix_range() -> tuple[int, int]:
    lo, hi = FLAGS.suffix_len
    return int(lo), int(hi)


def _print_progress(p: StepProgress) -> None:
    if p.step % FLAGS.progress_every == 0 or p.num_finished == p.num_requests:
        print(
            f"step {p.step:5d}  {p.elapsed_s:6.2f}s  tokens {p.num_tokens:4d}  running {p.num_running:3d}  "
            f"waiting {p.num_waiting:3d}  finished {p.num_finished:3d}/{p.num_requests}  usage {p.usage:6.1%}",
            flush=True,
        )


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


def _load_tokenizer(directory: str) -> Any:
    """The checkpoint's ``tokenizer.json`` as a ``tokenizers.Tokenizer``; None when there is
    none (or the ``tokenizers`` extra is missing), unless ``--prompt`` needs it: then a refusal."""
    path = Path(directory) / "tokenizer.json"
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if FLAGS.prompt:
            exit_error(PROG, "--prompt needs the tokenizers library (pip install jaxkv[tokenizers])")
        return None
    if not path.exists():
        if FLAGS.prompt:
            exit_error(PROG, f"--prompt needs {path}, which does not exist")
        return None
    return Tokenizer.from_file(str(path))


def _text_prompts(tokenizer: Any, vocab_size: int) -> list[list[int]]:
    """``--prompt`` texts as token ids; a refusal for an empty one or ids past the model's vocabulary."""
    prompts = [tokenizer.encode(text).ids for text in FLAGS.prompt]
    for text, ids in zip(FLAGS.prompt, prompts, strict=True):
        if not ids or max(ids) >= vocab_size or len(ids) >= FLAGS.max_model_len:
            exit_error(
                PROG,
                f"--prompt={text!r} encodes to {len(ids)} tokens (ids up to {max(ids, default=None)}): it must be "
                f"non-empty, shorter than --max_model_len={FLAGS.max_model_len}, ids < vocab_size={vocab_size}",
            )
    return prompts


def _check_prompts_fit() -> None:
    """Refuse a batch whose longest prompt leaves no room for an output token."""
    longest = FLAGS.prefix_len + _suffix_range()[1]
    if FLAGS.prompt and not FLAGS.checkpoint:
        exit_error(PROG, "--prompt needs --checkpoint DIR with a tokenizer.json (a tiny --model has no tokenizer)")
    if FLAGS.prompt:
        return
    if longest >= FLAGS.max_model_len:
        exit_error(
            PROG,
            f"--prefix_len={FLAGS.prefix_len} + --suffix_len hi={_suffix_range()[1]} = {longest:,} prompt tokens "
            f"leave no room for output in --max_model_len={FLAGS.max_model_len}",
        )


def _check_heads_split() -> None:
    """Refuse a cluster whose devices cannot each hold whole KV heads of the model, before
    launching it."""
    devices = FLAGS.num_processes * FLAGS.num_devices
    if FLAGS.checkpoint:
        try:
            config = read_config(Path(FLAGS.checkpoint))
        except (JaxkvError, OSError) as err:
            exit_error(PROG, err)
        heads = config.get("num_key_value_heads") or config.get("num_attention_heads", 1)
        model = f"--checkpoint={FLAGS.checkpoint}"
    else:
        heads = get_model_config(FLAGS.model).num_kv_heads
        model = f"--model={FLAGS.model}"
    if heads % devices:
        exit_error(
            PROG,
            f"{model} has {heads} KV heads, not a multiple of the {devices} devices of "
            f"--num_processes={FLAGS.num_processes} x --num_devices={FLAGS.num_devices} "
            "(try --model=tiny-llama-kv8)",
        )


def _step_check(name: str) -> LockstepCheck | None:
    """The lockstep check of an engine in a cluster of processes; None in a lone process."""
    return distributed.lockstep_check(name) if jax.process_count() > 1 else None


def serve() -> dict:
    """Plan, build, generate, print; return the JSON report."""
    start = time.perf_counter()
    _check_prompts_fit()
    memory = parse_size(FLAGS.memory)
    check_fits_device(memory, jax.local_devices()[0], name=f"--memory={FLAGS.memory}")
    dtype = None if FLAGS.dtype == "auto" else FLAGS.dtype
    num_devices = FLAGS.num_devices * jax.process_count()
    mesh = model_mesh(num_devices) if num_devices > 1 else None
    model, model_name, model_dtype = load_model(FLAGS.checkpoint, FLAGS.model, dtype=dtype, seed=FLAGS.seed, mesh=mesh)
    config = plan_for_model(
        model,
        memory,
        max_model_len=FLAGS.max_model_len,
        block_size=FLAGS.block_size,
        layout=FLAGS.layout,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        head_dim_multiple=FLAGS.head_dim_multiple,
        state_layout=FLAGS.state_layout,
        checkpoint_share=FLAGS.checkpoint_share,
        max_num_seqs=FLAGS.max_num_seqs,
        tensor_parallel=num_devices,
    )
    backend = jax.default_backend()
    devices = f" x {num_devices} devices" if mesh is not None else ""
    print(
        f"{model_name} ({model_dtype}), {FLAGS.memory}, jaxkv.device.ops implementation "
        f"{ops.get_implementation()!r} on JAX's {backend} backend{devices}:"
    )
    print(config.summary())
    engine = Engine(
        model,
        config,
        enable_caching=FLAGS.prefix_caching,
        max_num_seqs=FLAGS.max_num_seqs,
        mesh=mesh,
        step_check=_step_check("serve"),
    )
    tokenizer = _load_tokenizer(FLAGS.checkpoint) if FLAGS.checkpoint else None
    if FLAGS.prompt:
        prompts = _text_prompts(tokenizer, model.vocab_size)
    else:
        prompts = shared_prefix_prompts(
            num_requests=FLAGS.num_requests,
            num_prefixes=FLAGS.num_prefixes,
            prefix_len=FLAGS.prefix_len,
            suffix_len=_suffix_range(),
            vocab_size=model.vocab_size,
            seed=FLAGS.seed,
        )
    warm = engine.generate([[0] * max(1, min(16, FLAGS.max_model_len - 2))], 2, return_logits=FLAGS.verify_uncached)
    print(f"warm-up: {warm.num_compilations} step shapes compiled in {warm.wall_s:.2f} s")
    shape = "text prompts" if FLAGS.prompt else f"{FLAGS.num_prefixes} shared prefixes of {FLAGS.prefix_len} tokens"
    print(f"serving {len(prompts)} requests ({shape})")
    result = engine.generate(
        prompts, FLAGS.max_new_tokens, progress=_print_progress, return_logits=FLAGS.verify_uncached
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
        "flags": {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])},
        "plan": {
            "num_blocks": config.num_blocks,
            "block_bytes": None if config.pages is None else config.pages.block_bytes,
        },
        "result": result.to_dict(),
    }
    if FLAGS.verify_uncached:
        uncached = Engine(
            model,
            config,
            enable_caching=False,
            max_num_seqs=FLAGS.max_num_seqs,
            mesh=mesh,
            step_check=_step_check("uncached"),
        )
        baseline = uncached.generate(prompts, FLAGS.max_new_tokens, return_logits=True)
        check = compare_outputs(baseline.outputs, result.outputs, dtype=model_dtype, tolerance=FLAGS.logit_tolerance)
        print(f"against a run without prefix caching: {check.summary()}")
        report["uncached_check"] = check.to_dict()
    if FLAGS.verify and model_dtype not in EXACT_DTYPES:
        print(f"dense check skipped: {model_dtype} tokens may flip at near ties; use --verify_uncached")
    elif FLAGS.verify:
        dense = dense_greedy_generate(model, prompts, FLAGS.max_new_tokens)
        same = dense == [list(o.output_token_ids) for o in result.outputs]
        print(f"tokens identical to the dense (unpaged) forward: {'yes' if same else 'NO'}")
        report["matches_dense"] = same
    print(f"total time {time.perf_counter() - start:.2f} s (model, plan, compile, serve, verify)")
    return report


def main(argv: Sequence[str]) -> None:
    del argv  # flags_parser refused positional arguments
    logging.set_verbosity(logging.WARNING)  # JAX's backend probing is INFO noise here
    role = ProcessRole.from_env()
    if role is None:
        _check_heads_split()  # before JAX makes the devices: 100,000 host devices would hang it
    if role is None and FLAGS.num_processes > 1:
        try:
            command = [sys.executable, *sys.argv]
            sys.exit(launch(command, FLAGS.num_processes, cpu_devices_per_process=FLAGS.num_devices))
        except KeyboardInterrupt:
            exit_error(PROG, "interrupted; every process stopped", status=130)
    if role is not None:
        distributed.join(role)
    try:
        with ops.set_implementation(FLAGS.impl):
            report = serve()
        if FLAGS.out and jax.process_index() == 0:
            with open(FLAGS.out, "w") as f:
                json.dump(report, f, indent=2)
            print(f"wrote {FLAGS.out}")
    # PlanError, EngineError, ModelConfigError: listed until they subclass JaxkvError too.
    except (JaxkvError, OSError) as err:
        exit_error(PROG, err)
    if report.get("matches_dense") is False:
        exit_error(PROG, "the engine's tokens differ from the dense reference", status=1)
    if report.get("uncached_check", {}).get("passed") is False:
        exit_error(PROG, f"prefix caching failed the check: {report['uncached_check']['summary']}", status=1)


def run() -> None:
    """The console script ``jaxkv-serve``."""
    app.run(main, flags_parser=flags_parser(PROG, module=__name__))


if __name__ == "__main__":
    run()
