"""Time-to-first-token and throughput with prefix caching vs without, in one run.

Workload: prompts of ``--prompt_len`` tokens whose first ``--shared`` fraction (default
90 %) is one shared prefix (a long system prompt) and the rest a unique tail. Two
engines with the same model, plan, buckets and step function serve it, one with prefix
caching and one without (the baseline); every number is reported with its ratio.

- **single request**: the prefix is served once (untimed), then ``--repeats`` requests
  with fresh tails, one at a time; TTFT is the median over them. This is the issue's
  "TTFT on a 90%-shared prompt".
- **batch**: ``--num_requests`` prompts sharing the prefix arrive together: mean TTFT,
  output tokens/s and wall time of the whole batch.

Each phase first runs untimed on a different prefix with the same lengths, so every
step shape is compiled before timing (the compilations of the timed runs are printed
and must be 0). On CPU the numbers are ratios of a tiny model's compute, not absolute
speeds; ``--model llama-1b`` (~1.1e9 bf16 parameters) is sized for a GPU.

Then both engines serve the timed batch once more, untimed, returning logits, and the
cached run is checked against the uncached one (:mod:`jaxkv.serving.logit_check`):
float32 tokens must be identical; in bfloat16 the logits must agree within
``--logit_tolerance`` x max |logit| up to each request's first token divergence. A
failed check exits with status 1.

    python scripts/bench_serve.py --out bench_serve.json
    python scripts/bench_serve.py --profile_dir /tmp/trace   # the timed batch, for TensorBoard/Perfetto
    python scripts/bench_serve.py --model llama-1b --prompt_len 4096 --max_model_len 4352 \
        --max_num_batched_tokens 4096 --memory 8GiB --out llama_1b.json     # on a GPU
    python scripts/bench_serve.py --checkpoint /tmp/tiny-llama --prompt_len 256 --max_model_len 512
    python scripts/bench_serve.py --quick    # under a minute on one GPU (llama-1b, 1,024 tokens)

Every phase is printed as it goes (flushed): the model load, then one line per
``generate`` call (its TTFT, wall time and step compilations: the warm-up calls
compile each step shape), and, from ``jaxkv.device.auto``, which attention
implementation ``auto`` runs for each shape and why.

``--checkpoint DIR`` benchmarks the Hugging Face-format checkpoint saved in DIR
(:func:`jaxkv.models.checkpoint.load_pretrained`) instead of ``--model``.

Bad input (a flag out of range or unreadable, a ``--memory`` budget larger than the
device or too small, prompts that do not fit ``--max_model_len``) prints one line
``bench_serve.py: error: ...`` on stderr and exits with status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as std_logging
import statistics
import sys
import time
from collections.abc import Sequence

import jax
from absl import app, flags, logging

from jaxkv import ops
from jaxkv.commands.cli import (
    check_fits_device,
    define_state_flags,
    exit_error,
    flags_parser,
    parse_size,
    plan_options,
    write_json,
)
from jaxkv.device import auto
from jaxkv.device.metadata import Buckets
from jaxkv.errors import JaxkvError
from jaxkv.models.loading import load_model
from jaxkv.models.tiny import DTYPES, model_names
from jaxkv.planner import LAYOUTS
from jaxkv.serving.engine import Engine, GenerationResult, plan_for_model
from jaxkv.serving.logit_check import DEFAULT_TOLERANCE, LogitCheck, compare_outputs
from jaxkv.serving.workloads import shared_prefix_prompts
from jaxkv.specs import cdiv

PROG = "bench_serve.py"
FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "tiny-hybrid", list(model_names()), "model architecture (llama-1b: for a GPU)")
flags.DEFINE_string("checkpoint", None, "benchmark this Hugging Face-format checkpoint directory instead of --model")
flags.DEFINE_enum("dtype", "auto", ["auto", *DTYPES], "weights, activations and KV cache (auto: the model's own)")
flags.DEFINE_float(
    "logit_tolerance",
    DEFAULT_TOLERANCE,
    "below float32: max |dlogit| <= this x max |logit| up to the first token divergence",
    lower_bound=0,
)
flags.DEFINE_integer("prompt_len", 1024, "tokens per prompt", lower_bound=2)
flags.DEFINE_float(
    "shared",
    0.9,
    "fraction of each prompt in the shared prefix (the rest, >= 1 token, is unique)",
    lower_bound=0,
    upper_bound=1,
)
flags.DEFINE_integer("num_requests", 8, "requests in the batch phase", lower_bound=1)
flags.DEFINE_integer("repeats", 3, "timed requests in the single-request phase", lower_bound=1)
flags.DEFINE_integer("max_new_tokens", 16, "tokens generated per request", lower_bound=1)
flags.DEFINE_string("memory", "64MiB", "KV cache budget")
flags.DEFINE_integer("max_model_len", 2048, "tokens of the longest request", lower_bound=1)
flags.DEFINE_enum("layout", "cross_layer", LAYOUTS, "KV cache buffer layout")
define_state_flags()
flags.DEFINE_integer("max_num_seqs", 8, "most requests running at once", lower_bound=1)
flags.DEFINE_integer("max_num_batched_tokens", 1024, "token budget of one step", lower_bound=1)
flags.DEFINE_enum("impl", "auto", list(ops.IMPLEMENTATIONS), "jaxkv.device.ops implementation")
flags.DEFINE_bool(
    "quick",
    False,
    "a run that fits a GPU lease (under a minute on one GPU): the sizes of QUICK for each flag not given "
    "(llama-1b, 1,024-token prompts on an accelerator; tiny-llama, 128 on CPU)",
)
flags.DEFINE_integer("seed", 0, "weights and prompts seed", lower_bound=0)
flags.DEFINE_string("out", None, "write the results as JSON here")
flags.DEFINE_string("profile_dir", None, "write a jax.profiler trace of the timed batch phase here")
flags.register_validator("shared", lambda v: 0 <= v <= 1, message="--shared must be a fraction in [0, 1]")  # NaN too
flags.register_validator(
    "logit_tolerance", lambda v: 0 < v < float("inf"), message="--logit_tolerance must be a finite number > 0"
)


QUICK = {
    "accelerator": {
        "model": "llama-1b",
        "prompt_len": 1024,
        "max_model_len": 1088,
        "max_num_batched_tokens": 1024,
        "max_num_seqs": 4,
        "num_requests": 4,
        "repeats": 2,
        "max_new_tokens": 4,
        "memory": "2GiB",
    },
    "cpu": {
        "model": "tiny-llama",
        "prompt_len": 128,
        "max_model_len": 160,
        "max_num_batched_tokens": 128,
        "max_num_seqs": 4,
        "num_requests": 3,
        "repeats": 1,
        "max_new_tokens": 2,
        "memory": "4MiB",
    },
}
"""``--quick``'s sizes per backend kind, for the flags a user did not give."""


def apply_quick() -> None:
    """Set every flag of :data:`QUICK` the command line did not give."""
    for name, value in QUICK["cpu" if jax.default_backend() == "cpu" else "accelerator"].items():
        if not FLAGS[name].present:
            FLAGS[name].value = value


def progress(phase: str, engine: str, result: GenerationResult) -> None:
    """One line per ``generate`` call as it ends (flushed): the run can be followed live, and a
    call that compiles says how many step shapes it traced and what that cost."""
    print(
        f"  {phase:<10} {engine:<18} {len(result.outputs)} req: TTFT {result.mean_ttft_s * 1e3:,.1f} ms, "
        f"wall {result.wall_s:,.2f} s, {result.num_compilations} compilations",
        flush=True,
    )


def prompts(count: int, seed: int, vocab_size: int) -> list[list[int]]:
    """``count`` prompts of the flags' length sharing one prefix (a new prefix per seed)."""
    tail = max(1, FLAGS.prompt_len - round(FLAGS.prompt_len * FLAGS.shared))
    return shared_prefix_prompts(
        num_requests=count,
        num_prefixes=1,
        prefix_len=FLAGS.prompt_len - tail,
        suffix_len=(tail, tail),
        vocab_size=vocab_size,
        seed=FLAGS.seed * 1000 + seed,
    )


def run(engine: Engine, batch: list[list[int]], phase: str, name: str) -> GenerationResult:
    result = engine.generate(batch, FLAGS.max_new_tokens)
    progress(phase, name, result)
    return result


def measure(engines: dict[str, Engine], vocab_size: int) -> dict[str, dict]:
    """Warm up, then time both phases; every engine gets the same prompts, in turn.

    Single requests alternate between engines, so machine noise hits both alike.
    """
    for seed, phase in ((0, "warm-up"), (1, "single")):  # the warm-up compiles every shape
        print(f"{phase}: single requests, the prefix first", flush=True)
        served, *timed = prompts(1 + FLAGS.repeats, seed, vocab_size)
        runs: dict[str, list[GenerationResult]] = {name: [] for name in engines}
        for name, engine in engines.items():
            run(engine, [served], phase, name)
        for prompt in timed:
            for name, engine in engines.items():
                runs[name].append(run(engine, [prompt], phase, name))
    batches = {}
    for seed, phase in ((2, "warm-up"), (3, "batch")):
        print(f"{phase}: a batch of {FLAGS.num_requests}", flush=True)
        batch = prompts(FLAGS.num_requests, seed, vocab_size)
        profiled = FLAGS.profile_dir is not None and seed == 3
        with jax.profiler.trace(FLAGS.profile_dir) if profiled else contextlib.nullcontext():
            batches = {name: run(engine, batch, phase, name) for name, engine in engines.items()}
    return {
        name: {
            "single_ttft_s": statistics.median(r.outputs[0].ttft_s for r in runs[name]),
            "batch_mean_ttft_s": batches[name].mean_ttft_s,
            "batch_output_tokens_per_s": batches[name].output_tokens_per_s,
            "batch_wall_s": batches[name].wall_s,
            "batch_prefix_hit_rate": batches[name].prefix_hit_rate,
            "batch_tokens_computed": batches[name].num_scheduled_tokens,
            "timed_compilations": sum(r.num_compilations for r in runs[name]) + batches[name].num_compilations,
            "outputs": [list(o.output_token_ids) for o in batches[name].outputs],
        }
        for name in engines
    }


def token_check(engines: dict[str, Engine], vocab_size: int, dtype: str) -> LogitCheck:
    """Both engines serve the timed batch once more (untimed), bringing back logits: the
    cached run against the uncached one (:mod:`jaxkv.serving.logit_check`)."""
    print("token check: the timed batch again, with logits", flush=True)
    batch = prompts(FLAGS.num_requests, 3, vocab_size)
    runs = {}
    for name, engine in engines.items():
        runs[name] = engine.generate(batch, FLAGS.max_new_tokens, return_logits=True)
        progress("check", name, runs[name])
    return compare_outputs(
        runs["no prefix caching"].outputs,
        runs["prefix caching"].outputs,
        dtype=dtype,
        tolerance=FLAGS.logit_tolerance,
    )


ROWS = (
    ("TTFT, one shared-prefix request (ms)", "single_ttft_s", 1e3, "{:,.1f}", "speed-up"),
    ("batch mean TTFT (ms)", "batch_mean_ttft_s", 1e3, "{:,.1f}", "speed-up"),
    ("batch output tokens/s", "batch_output_tokens_per_s", 1, "{:,.1f}", "ratio"),
    ("batch wall time (s)", "batch_wall_s", 1, "{:,.2f}", "speed-up"),
    ("batch prefix hit rate", "batch_prefix_hit_rate", 1, "{:.1%}", ""),
    ("batch tokens computed", "batch_tokens_computed", 1, "{:,}", "speed-up"),
    ("compilations while timed", "timed_compilations", 1, "{}", ""),
)


def table(results: dict[str, dict]) -> tuple[str, dict[str, float]]:
    """The markdown table and the on-vs-off ratios (speed-ups: off / on; rates: on / off)."""
    off, on = results["no prefix caching"], results["prefix caching"]
    lines = ["| metric | no prefix caching | prefix caching | on vs off |", "|---|---|---|---|"]
    ratios = {}
    for label, key, scale, fmt, kind in ROWS:
        cell = ""
        if kind and off[key] and on[key]:
            ratios[key] = off[key] / on[key] if kind == "speed-up" else on[key] / off[key]
            cell = f"{ratios[key]:.2f}x"
        lines.append(f"| {label} | {fmt.format(off[key] * scale)} | {fmt.format(on[key] * scale)} | {cell} |")
    return "\n".join(lines), ratios


def main(argv: Sequence[str]) -> None:
    del argv  # flags_parser refused positional arguments
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger(auto.__name__).setLevel(std_logging.INFO)  # which attention each shape runs, and why
    if FLAGS.quick:
        apply_quick()
    if FLAGS.prompt_len + FLAGS.max_new_tokens > FLAGS.max_model_len:
        exit_error(
            PROG,
            f"--prompt_len={FLAGS.prompt_len} + --max_new_tokens={FLAGS.max_new_tokens} exceeds "
            f"--max_model_len={FLAGS.max_model_len}",
        )
    try:
        memory = parse_size(FLAGS.memory)
        check_fits_device(memory, jax.local_devices()[0], name=f"--memory={FLAGS.memory}")
        dtype = None if FLAGS.dtype == "auto" else FLAGS.dtype
        print(f"load: {FLAGS.checkpoint or FLAGS.model}", flush=True)
        started = time.perf_counter()
        model, name, model_dtype = load_model(FLAGS.checkpoint, FLAGS.model, dtype=dtype, seed=FLAGS.seed)
        print(f"load: {name} ({model_dtype}) in {time.perf_counter() - started:.1f} s", flush=True)
        config = plan_for_model(
            model,
            memory,
            max_model_len=FLAGS.max_model_len,
            options=dataclasses.replace(plan_options(memory), head_dim_multiple=1),
            max_num_seqs=FLAGS.max_num_seqs,
        )
    # PlanError, EngineError, ModelConfigError: listed until they subclass JaxkvError too.
    except JaxkvError as err:
        exit_error(PROG, err)
    # Token buckets in powers of two, so a cached request's short prefill runs a small step.
    max_blocks = cdiv(FLAGS.max_model_len, config.hash_block_size)
    ladder = Buckets.powers_of_two(FLAGS.max_num_batched_tokens, FLAGS.max_num_seqs, max_blocks)
    buckets = Buckets(ladder.tokens, (FLAGS.max_num_seqs,), (max_blocks,))
    impl = FLAGS.impl if FLAGS.impl != "auto" else f"auto ({ops.get_implementation('auto')})"
    print(
        f"{name} ({model_dtype}), {FLAGS.layout}, {impl} ops on {jax.default_backend()}: "
        f"prompts of {FLAGS.prompt_len} tokens, {FLAGS.shared:.0%} shared; {config.num_blocks:,} blocks",
        flush=True,
    )
    try:
        with ops.set_implementation(FLAGS.impl):
            engines = {
                "no prefix caching": Engine(
                    model, config, enable_caching=False, max_num_seqs=FLAGS.max_num_seqs, buckets=buckets
                ),
                "prefix caching": Engine(
                    model, config, enable_caching=True, max_num_seqs=FLAGS.max_num_seqs, buckets=buckets
                ),
            }
            results = measure(engines, model.vocab_size)
            check = token_check(engines, model.vocab_size, model_dtype)
    except JaxkvError as err:
        exit_error(PROG, err)
    text, ratios = table(results)
    print(text)
    print(f"with vs without prefix caching: {check.summary()}")
    if FLAGS.out:
        flag_values = {f.name: f.value for f in FLAGS.get_key_flags_for_module(sys.modules[__name__])}
        report = {
            "flags": flag_values,
            "device": jax.default_backend(),
            "results": results,
            "ratios": ratios,
            "token_check": check.to_dict(),
        }
        write_json(PROG, FLAGS.out, report)
    if not check.passed:
        exit_error(PROG, f"prefix caching changed the model's output beyond the check: {check.summary()}", status=1)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
