"""jaxkv's engine loop side by side with vLLM 0.33's, host time per step (issue 40).

Section ``engine``: the same requests at 8 / 32 / 64 / 128 running sequences
(``--batch_sizes``) go through jaxkv's :class:`~jaxkv.serving.engine.Engine` and through
vLLM 0.33's own v1 scheduler (``schedule()`` + ``update_from_output()``) and
``OutputProcessor`` (detokenization, stop checks) with the same tokenizer, in one run
(:mod:`jaxkv.benchmarks.vllm_engine`). vLLM runs no model: each request draws, in order,
the tokens it drew in jaxkv's run. Timed: thread CPU time (``time.thread_time``, so the
device's threads are not counted) of a whole ``Engine.step`` against vLLM's three phases,
on the steps where every sequence decodes (prefill and the first ``--warmup_steps``
decode steps left out). After one untimed run (compilation; the tokens vLLM is fed), each
of ``--reps`` repetitions serves the requests again with a fresh engine and a fresh vLLM
loop **stepped in turn** (a jaxkv step, then a vLLM step), so that the machine's load
falls on both alike; the steps are averaged in ``--windows`` windows of
``--window_steps``. Each ms figure is the median of the windows of all repetitions; the
ratio jaxkv / vLLM is the median (and quartiles) of the ratios of paired windows (jaxkv's
window i beside vLLM's window i of the same repetition). jaxkv's step is also
split (:class:`RunnerClock`) into the runner's part (metadata, sampling inputs, the jitted
call's dispatch and read-back), which vLLM's figures leave out (its model runner is not
run), and the rest (scheduler, output processing, the engine), whose ratio to vLLM's is
the like-for-like one; and the jitted call's own thread CPU (``ModelRunner.dispatch_cpu_s``:
JAX's dispatch, and whatever of the computation the CPU backend runs on the calling
thread, which an accelerator runs on the device), ``(jaxkv - jitted call) / vLLM`` the ratio
without it. Two settings
(``--settings``), as issue 40's table:

* ``tiny``: the tiny Llama checkpoint (``scripts/save_tiny_checkpoint.py``'s stored seed-0
  one and its byte-level tokenizer), jaxkv's real jitted step, ``--tiny_prompt_len``
  prompts;
* ``stub1k``: ``--stub_prompt_len`` (1k) prompts, the model stubbed: the same checkpoint
  behind :class:`PresetTokens`, a :class:`~jaxkv.models.protocol.ServedModel` whose
  forward returns preset tokens (text of :data:`PRESET_TEXT`), so only host work is left
  (the public seam: a model is a guest of the engine; the engine, plan, metadata and
  parameters passed are the real ones).

Requests ignore EOS and stream deltas; prompts are distinct random ASCII text (no prefix
hits on either side); both sides plan the same blocks (vLLM's scheduler is given jaxkv's
plan's block count and groups) and the same step token budget.

Section ``overlap``: a step's wall time against max(host, device) on a tiny Llama-like
model sized so that its jitted decode step takes about the host time on this CPU
(``--overlap_layers``, ``--overlap_hidden``), at ``--overlap_batch`` sequences. Host: the
step's thread CPU time; device: the compiled step alone on one decode step's metadata
(the engine's own, caught by its ``step_check`` hook), wall time, a fresh cache; wall: the
step's wall time. A loop that runs the device while the host works reaches
wall / max(host, device) near 1 (issue 40's target: <= 1.15); one that waits is near
(host + device) / max(host, device). The section runs the synchronous loop
(``async_scheduling=False``) and then the overlapped one (the default), in one run;
``--noasync_scheduling`` makes the engine section's engines synchronous.

    python scripts/bench_engine.py --out bench_engine.json
    PYTHONPATH=. /work/vllm-venv/bin/python scripts/bench_engine.py --out bench_engine.json  # with vLLM

Without vLLM (not importable, or ``--nopeer``) the vLLM columns read n/a. ``--quick`` is a
smoke run (the smallest batch size, 32-token prompts, 3 windows of 2 steps). Bad input prints one
line ``bench_engine.py: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import string
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from save_tiny_checkpoint import EOS_TOKEN_ID, SPECIAL_TOKENS, copy_stored_checkpoint, save_tiny_tokenizer

from jaxkv.benchmarks.vllm_manager import PeerError, vllm_available
from jaxkv.commands.cli import exit_error, flags_parser, write_json
from jaxkv.device.cache import KVCache
from jaxkv.device.metadata import StepMetadata, bucket
from jaxkv.device.state_cache import HybridCache
from jaxkv.errors import JaxkvError
from jaxkv.ints import cdiv
from jaxkv.models.checkpoint import load_pretrained
from jaxkv.models.protocol import ServedModel
from jaxkv.models.text import TextTokenizer
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.serving.engine import Engine
from jaxkv.serving.runner import allocate_cache
from jaxkv.serving.sampler import greedy_inputs
from jaxkv.serving.sampling_params import SamplingParams
from jaxkv.serving.scheduler import SchedulerOutput

PROG = "bench_engine.py"
SETTINGS = ("tiny", "stub1k")
SECTIONS = ("engine", "overlap")
PRESET_TEXT = "The engine loop, side by side with vLLM's: schedule, execute, update, process. "
"""What the stubbed model writes, over and over (printable ASCII: one byte token a character)."""
BLOCK_SIZE = 16

FLAGS = flags.FLAGS
flags.DEFINE_list("sections", list(SECTIONS), f"sections to run, of {', '.join(SECTIONS)}")
flags.DEFINE_list("settings", list(SETTINGS), f"engine: model settings, of {', '.join(SETTINGS)}")
flags.DEFINE_list("batch_sizes", ["8", "32", "64", "128"], "engine: running sequences")
flags.DEFINE_integer("tiny_prompt_len", 128, "engine, tiny: prompt tokens", lower_bound=1)
flags.DEFINE_integer("stub_prompt_len", 1024, "engine, stub1k: prompt tokens", lower_bound=1)
flags.DEFINE_integer("max_num_batched_tokens", 4096, "the step's token budget (both sides)", lower_bound=1)
flags.DEFINE_integer("windows", 5, "timed windows; each figure is their median", lower_bound=1)
flags.DEFINE_integer("window_steps", 4, "decode steps a window", lower_bound=1)
flags.DEFINE_integer(
    "reps", 3, "engine: lockstep repetitions, each a fresh engine and vLLM loop stepped in turn", lower_bound=1
)
flags.DEFINE_integer("warmup_steps", 3, "decode steps before the windows (compilation)", lower_bound=1)
flags.DEFINE_integer("overlap_batch", 32, "overlap: running sequences", lower_bound=1)
flags.DEFINE_integer("overlap_layers", 1, "overlap: the model's layers", lower_bound=1)
flags.DEFINE_integer("overlap_hidden", 32, "overlap: the model's hidden size (MLP 4x)", lower_bound=8)
flags.DEFINE_boolean(
    "async_scheduling", True, "engine: the engines overlap the host with the device (the overlap section runs both)"
)
flags.DEFINE_boolean("peer", True, "engine: drive vLLM's scheduler and output processor too when vLLM is importable")
flags.DEFINE_boolean(
    "quick", False, "a smoke run: the smallest batch size, 32-token prompts, a 64-token budget, 3 windows of 2 steps"
)
flags.DEFINE_string("out", None, "write the results as JSON here")


class PresetTokens:
    """``model`` with its forward replaced by preset tokens: the token after position p is
    ``preset[(p + 1) % len(preset)]``, whatever the cache holds. Everything else (name
    aside) is ``model``'s, so the engine plans, builds metadata and passes parameters as
    for ``model``; the device does next to nothing."""

    def __init__(self, model: ServedModel, preset: Sequence[int]) -> None:
        self._model = model
        self._preset = np.asarray(preset, np.int32)
        self.name = f"{model.name} (preset tokens)"
        self.vocab_size = model.vocab_size
        self.params = model.params

    def drew(self, outputs: Iterable[Sequence[int]], prompt_len: int) -> bool:
        """Whether every output of a ``prompt_len``-token prompt is the preset's tokens."""
        n = len(self._preset)
        return all(list(out) == [int(self._preset[(prompt_len + j) % n]) for j in range(len(out))] for out in outputs)

    def layer_specs(self) -> dict:
        return self._model.layer_specs()

    def partition_specs(self) -> Any:
        return self._model.partition_specs()

    def forward(
        self, params: Any, cache: KVCache | HybridCache, meta: StepMetadata, *, impl: str | None = None
    ) -> tuple[jax.Array, KVCache | HybridCache]:
        preset = jnp.asarray(self._preset)
        tokens = preset[(meta.positions[meta.logits_indices] + 1) % preset.shape[0]]
        return 30.0 * jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32), cache


@dataclass(frozen=True)
class Checkpoint:
    """The tiny Llama checkpoint and its tokenizer in ``path``, loaded for jaxkv."""

    path: Path
    model: ServedModel
    tokenizer: TextTokenizer


def tiny_checkpoint(directory: Path, max_model_len: int) -> Checkpoint:
    """The stored seed-0 tiny Llama and the byte-level tokenizer saved to ``directory``, its
    ``max_position_embeddings`` raised to ``max_model_len`` (RoPE runs past it; vLLM's
    config check reads it)."""
    import json

    copy_stored_checkpoint("llama", directory)
    save_tiny_tokenizer(directory)
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = max(config["max_position_embeddings"], max_model_len)
    config_file.write_text(json.dumps(config))
    model = load_pretrained(directory, max_model_len=max_model_len)
    return Checkpoint(directory, model, TextTokenizer.from_directory(directory))


def random_prompts(tokenizer: TextTokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` byte tokens of random ASCII text."""
    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " .,"
    return [tokenizer.encode("".join(rng.choices(alphabet, k=length))) for _ in range(count)]


def max_tokens_for(num_seqs: int, prompt_len: int, budget: int) -> int:
    """Output tokens a request asks for, so that every sequence still decodes through the
    timed windows after the last prompt is in (the first ones decode while later
    prompts prefill: a bound on those steps, plus warm-up, windows and one spare)."""
    prefill_steps = cdiv(num_seqs * prompt_len, max(budget - num_seqs, 1)) + 2
    return prefill_steps + FLAGS.warmup_steps + FLAGS.windows * FLAGS.window_steps + 2


def window_means(step_seconds: Sequence[float]) -> list[float] | None:
    """The mean of each window's steps, in ms, after the warm-up steps; None if the run had
    too few such steps."""
    timed = step_seconds[FLAGS.warmup_steps :]
    k = FLAGS.window_steps
    if len(timed) < FLAGS.windows * k:
        return None
    return [1e3 * statistics.fmean(timed[i * k : (i + 1) * k]) for i in range(FLAGS.windows)]


def windowed_ms(step_seconds: Sequence[float]) -> float | None:
    """Median over windows of the mean of a window's steps, in ms (see :func:`window_means`)."""
    means = window_means(step_seconds)
    return None if means is None else statistics.median(means)


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``values``."""
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return float(q1), float(q2), float(q3)


@dataclass
class JaxkvRun:
    """Per full-decode step: thread CPU and wall seconds, the thread CPU seconds inside the
    runner and inside its jitted call (``ModelRunner.dispatch_cpu_s``); the tokens each request drew."""

    host_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    runner_s: list[float] = field(default_factory=list)
    call_s: list[float] = field(default_factory=list)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    decode_output: SchedulerOutput | None = None


class RunnerClock:
    """Thread CPU seconds the engine spends inside its runner's step methods (step metadata,
    sampling inputs, the jitted call's dispatch, the read-back): the part of a jaxkv step that
    vLLM's figures here leave out (its model runner). Times whichever of :data:`METHODS` the
    runner has, once however they call each other."""

    METHODS = ("execute_sampled", "dispatch", "collect")

    def __init__(self, runner: Any) -> None:
        self.seconds = 0.0
        self._depth = 0
        for name in self.METHODS:
            method = getattr(runner, name, None)
            if method is not None:
                setattr(runner, name, self._timed(method))

    def _timed(self, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.seconds += time.thread_time() - start

        return timed


@dataclass
class VllmRun:
    """Per full-decode step of vLLM's loop: thread CPU seconds of each phase; its scheduler's class."""

    scheduler: str
    schedule_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)
    output_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)


def add_requests(engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int, run: JaxkvRun) -> None:
    """Queue ``prompts`` as requests ``r0``, ``r1``... that ignore EOS; their tokens go to ``run``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        run.tokens[engine.add_request(prompt, params, request_id=f"r{i}")] = []


def jaxkv_step(engine: Engine, clock: RunnerClock, run: JaxkvRun, num_seqs: int) -> bool:
    """One engine step, its tokens kept in ``run``; timed there when all ``num_seqs`` decode
    (then True)."""
    full = engine.num_running == num_seqs and engine.num_waiting == 0
    in_runner, in_call = clock.seconds, engine.runner.dispatch_cpu_s
    start, wall = time.thread_time(), time.perf_counter()
    step = engine.step()
    host, wall = time.thread_time() - start, time.perf_counter() - wall
    for delta in step.deltas:
        run.tokens[delta.request_id].extend(delta.token_ids)
    if full and step.num_tokens == num_seqs and not step.finished:
        run.host_s.append(host)
        run.wall_s.append(wall)
        run.runner_s.append(clock.seconds - in_runner)
        run.call_s.append(engine.runner.dispatch_cpu_s - in_call)
        return True
    return False


def run_jaxkv(engine: Engine, prompts: Sequence[Sequence[int]], max_tokens: int) -> JaxkvRun:
    """Serve ``prompts`` to the end, step by step, timing the steps where all decode."""
    run = JaxkvRun()
    clock = RunnerClock(engine.runner)
    add_requests(engine, prompts, max_tokens, run)
    gc.collect()
    while engine.has_unfinished:
        jaxkv_step(engine, clock, run, len(prompts))
    return run


def vllm_loop(checkpoint: Checkpoint, engine: Engine, prompts: Sequence[Sequence[int]], tokens: dict) -> Any:
    """vLLM's scheduler and output processor over ``engine``'s plan and budget, with
    ``prompts`` queued, each to draw as many tokens as ``tokens`` holds for it."""
    from jaxkv.benchmarks.vllm_engine import VllmEngineLoop

    loop = VllmEngineLoop(
        checkpoint.path,
        engine.manager.config,
        max_num_seqs=engine.max_num_seqs,
        max_num_batched_tokens=engine.max_num_batched_tokens,
        eos_token=SPECIAL_TOKENS[0],
    )
    for i, prompt in enumerate(prompts):
        loop.add_request(f"r{i}", prompt, len(tokens[f"r{i}"]))
    return loop


def vllm_step(loop: Any, tokens: dict, run: VllmRun, num_seqs: int) -> None:
    """One step of vLLM's loop, fed ``tokens``; its phases timed in ``run`` when all ``num_seqs`` decode."""
    full = len(loop.scheduler.running) == num_seqs
    times = loop.step(tokens)
    if full and times.num_scheduled_tokens == num_seqs and not times.num_finished:
        for values, value in zip(
            (run.schedule_s, run.update_s, run.output_s, run.total_s),
            (times.schedule_s, times.update_s, times.output_s, times.total_s),
            strict=True,
        ):
            values.append(value)


@dataclass
class Rep:
    """One lockstep repetition: jaxkv's steps, and vLLM's (None without the peer)."""

    jaxkv: JaxkvRun
    vllm: VllmRun | None


def run_lockstep(
    checkpoint: Checkpoint, model: ServedModel, prompts: Sequence[Sequence[int]], max_tokens: int, tokens: dict | None
) -> Rep:
    """A fresh engine of ``model`` and (given ``tokens``, what each request drew) a fresh
    vLLM loop fed them serve ``prompts``, stepped in turn (a jaxkv step, then a vLLM step),
    so that the machine's load falls on both alike."""
    num_seqs, prompt_len = len(prompts), len(prompts[0])
    engine = engine_for(model, checkpoint, num_seqs, prompt_len + max_tokens)
    loop = vllm_loop(checkpoint, engine, prompts, tokens) if tokens is not None else None
    rep = Rep(JaxkvRun(), VllmRun(loop.scheduler_name) if loop is not None else None)
    clock = RunnerClock(engine.runner)
    add_requests(engine, prompts, max_tokens, rep.jaxkv)
    gc.collect()
    while engine.has_unfinished or (loop is not None and loop.has_unfinished):
        if engine.has_unfinished:
            jaxkv_step(engine, clock, rep.jaxkv, num_seqs)
        if loop is not None and rep.vllm is not None and loop.has_unfinished:
            assert tokens is not None
            vllm_step(loop, tokens, rep.vllm, num_seqs)
    return rep


def paired_windows(reps: Sequence[Rep], figure: Any) -> list[float]:
    """``figure(jaxkv window ms, vLLM window ms)`` of each window of each repetition, window i
    of jaxkv's steps paired with window i of vLLM's (neighbours in time: the loops run in turn)."""
    out = []
    for rep in reps:
        if rep.vllm is None:
            continue
        host, vllm = window_means(rep.jaxkv.host_s), window_means(rep.vllm.total_s)
        runner, call = window_means(rep.jaxkv.runner_s), window_means(rep.jaxkv.call_s)
        if host is None or vllm is None or runner is None or call is None:
            continue
        out += [figure(*values) for values in zip(host, runner, call, vllm, strict=True)]
    return out


def pooled_ms(series: Iterable[Sequence[float]]) -> float | None:
    """Median of the window means of all repetitions' steps, in ms."""
    means = [m for steps in series for m in window_means(steps) or []]
    return statistics.median(means) if means else None


def engine_for(model: ServedModel, checkpoint: Checkpoint, num_seqs: int, tokens_per_seq: int, **kwargs: Any) -> Engine:
    """An engine of ``model`` for ``num_seqs`` sequences of ``tokens_per_seq`` tokens (its
    ``max_model_len``; the cache holds them all and a quarter more), with the
    checkpoint's tokenizer and EOS."""
    specs = model.layer_specs().values()
    bytes_per_token = sum(spec.page_size_bytes(BLOCK_SIZE) for spec in specs) / BLOCK_SIZE
    blocks = num_seqs * (cdiv(tokens_per_seq, BLOCK_SIZE) + 1)
    return Engine(
        model,
        memory_bytes=math.ceil(1.25 * blocks * BLOCK_SIZE * bytes_per_token),
        max_model_len=tokens_per_seq,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=FLAGS.max_num_batched_tokens,
        eos_token_ids=(EOS_TOKEN_ID,),
        tokenizer=checkpoint.tokenizer,
        **({"async_scheduling": FLAGS.async_scheduling} | kwargs),
    )


def engine_section(checkpoint: Checkpoint, batch_sizes: Sequence[int], peer: bool) -> list[dict]:
    """One row per setting and batch size: jaxkv's host ms per step beside vLLM's phases,
    over ``--reps`` lockstep repetitions after one untimed run (compilation, and the tokens
    vLLM is fed)."""
    preset = PresetTokens(checkpoint.model, checkpoint.tokenizer.encode(PRESET_TEXT))
    rows = []
    for setting in FLAGS.settings:
        model, prompt_len = (
            (checkpoint.model, FLAGS.tiny_prompt_len) if setting == "tiny" else (preset, FLAGS.stub_prompt_len)
        )
        for num_seqs in batch_sizes:
            max_tokens = max_tokens_for(num_seqs, prompt_len, FLAGS.max_num_batched_tokens)
            prompts = random_prompts(checkpoint.tokenizer, num_seqs, prompt_len, seed=num_seqs)
            first = run_jaxkv(engine_for(model, checkpoint, num_seqs, prompt_len + max_tokens), prompts, max_tokens)
            reps = [
                run_lockstep(checkpoint, model, prompts, max_tokens, first.tokens if peer else None)
                for _ in range(FLAGS.reps)
            ]
            runs = [rep.jaxkv for rep in reps]
            vllm = [rep.vllm for rep in reps if rep.vllm is not None]
            row: dict[str, Any] = {
                "setting": setting,
                "running": num_seqs,
                "prompt_len": prompt_len,
                "max_tokens": max_tokens,
                "reps": FLAGS.reps,
                "tokens_as_preset": preset.drew(first.tokens.values(), prompt_len) if model is preset else None,
                "tokens_same_every_rep": all(run.tokens == first.tokens for run in runs),
                "jaxkv_host_ms": pooled_ms(run.host_s for run in runs),
                "jaxkv_runner_ms": pooled_ms(run.runner_s for run in runs),
                "jaxkv_rest_ms": pooled_ms(
                    [h - r for h, r in zip(run.host_s, run.runner_s, strict=True)] for run in runs
                ),
                "jaxkv_call_ms": pooled_ms(run.call_s for run in runs),
                "jaxkv_wall_ms": pooled_ms(run.wall_s for run in runs),
            }
            for phase in ("schedule", "update", "output", "total"):
                row[f"vllm_{phase}_ms"] = pooled_ms(getattr(v, f"{phase}_s") for v in vllm) if vllm else None
            row["vllm_scheduler"] = vllm[0].scheduler if vllm else None
            ratios = paired_windows(reps, lambda host, runner, call, total: host / total)
            rest = paired_windows(reps, lambda host, runner, call, total: (host - runner) / total)
            less = paired_windows(reps, lambda host, runner, call, total: (host - call) / total)
            q1, median, q3 = quartiles(ratios) if ratios else (None, None, None)
            row.update(ratio=median, ratio_q1=q1, ratio_q3=q3, num_windows=len(ratios))
            row["rest_ratio"] = statistics.median(rest) if rest else None
            row["less_call_ratio"] = statistics.median(less) if less else None
            rows.append(row)
            print(f"  {setting} x{num_seqs}: jaxkv {row['jaxkv_host_ms']} ms, ratio {median}", file=sys.stderr)
    return rows


class DeviceStep:
    """The engine's compiled step alone, on a fresh cache of its plan (compiled for the
    shapes of ``output``'s chunks: every full decode step has them)."""

    def __init__(self, engine: Engine, output: SchedulerOutput) -> None:
        self._runner = engine.runner
        self._compiled = self._runner.lower(output.chunks).compile()
        self._sampling = greedy_inputs(bucket(len(output.chunks), self._runner.buckets.seqs, "seqs"))
        self._previous = jax.numpy.zeros(max(self._runner.buckets.seqs), jax.numpy.int32)  # no token fed
        self._cache = allocate_cache(engine.manager.config)

    def seconds(self, output: SchedulerOutput) -> float:
        """Wall seconds of one call on ``output``'s metadata (built and sent beforehand, untimed)."""
        meta = jax.block_until_ready(jax.device_put(self._runner.metadata(output.chunks)))
        start = time.perf_counter()
        runner = self._runner
        _, _, drawn, self._cache = self._compiled(
            runner.params, self._cache, meta, runner.idle_delta, self._sampling, self._previous
        )
        jax.block_until_ready(drawn)
        return time.perf_counter() - start


def overlap_section(checkpoint: Checkpoint, async_scheduling: bool) -> dict:
    """Wall ms per decode step against max(host, device) on a model whose device step is
    comparable to the host's work. All three are wall times, taken step by step in turn
    so that a loaded machine slows them alike: wall, the real engine's step; host, the
    step of a second engine that serves the same prompts in lockstep with the model
    stubbed (:class:`PresetTokens`); device, the compiled step alone on the real step's
    chunks (:class:`DeviceStep`). The real step's thread CPU time is reported beside them.
    Both engines overlap the host with the device when ``async_scheduling``."""
    base = get_model_config("tiny-llama")
    config = replace(
        base,
        vocab_size=checkpoint.model.vocab_size,
        hidden_size=FLAGS.overlap_hidden,
        mlp_dim=4 * FLAGS.overlap_hidden,
        windows=(None,) * FLAGS.overlap_layers,
    )
    model = TinyLM(config, seed=0, name="overlap-llama")
    num_seqs, prompt_len = FLAGS.overlap_batch, FLAGS.tiny_prompt_len
    max_tokens = max_tokens_for(num_seqs, prompt_len, FLAGS.max_num_batched_tokens)
    outputs: list[SchedulerOutput | None] = []  # each step's, from the engine's step_check hook
    real = engine_for(
        model,
        checkpoint,
        num_seqs,
        prompt_len + max_tokens,
        step_check=outputs.append,
        async_scheduling=async_scheduling,
    )
    stub = PresetTokens(model, checkpoint.tokenizer.encode(PRESET_TEXT))
    host = engine_for(stub, checkpoint, num_seqs, prompt_len + max_tokens, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in random_prompts(checkpoint.tokenizer, num_seqs, prompt_len, seed=1):
        real.add_request(prompt, params)
        host.add_request(prompt, params)
    times: dict[str, list[float]] = {"wall": [], "host": [], "host_cpu": [], "device": []}
    device: DeviceStep | None = None
    gc.collect()
    while real.has_unfinished:
        full = real.num_running == num_seqs and real.num_waiting == 0
        start, wall = time.thread_time(), time.perf_counter()
        step = real.step()
        cpu, wall = time.thread_time() - start, time.perf_counter() - wall
        start = time.perf_counter()
        host_step = host.step()  # the same schedule: same prompts, budget and lengths
        host_wall = time.perf_counter() - start
        if full and step.num_tokens == host_step.num_tokens == num_seqs and not step.finished:
            decode = outputs[-1]
            assert decode is not None  # the engine passes None only at the end of generate
            device = device or DeviceStep(real, decode)
            for name, value in zip(times, (wall, host_wall, cpu, device.seconds(decode)), strict=True):
                times[name].append(value)
    ms = {name: windowed_ms(values) for name, values in times.items()}
    bound = max(ms["host"] or 0.0, ms["device"] or 0.0)
    wall_ms, host_ms, device_ms = ms["wall"], ms["host"], ms["device"]
    return {
        "model": f"{FLAGS.overlap_layers} layers, hidden {FLAGS.overlap_hidden}",
        "loop": "async" if async_scheduling else "sync",
        "running": num_seqs,
        "host_ms": host_ms,
        "host_cpu_ms": ms["host_cpu"],
        "device_ms": device_ms,
        "wall_ms": wall_ms,
        "device_over_host": device_ms / host_ms if device_ms is not None and host_ms else None,
        "wall_over_max": wall_ms / bound if wall_ms is not None and bound else None,
        "serial_bound": (host_ms + device_ms) / bound if host_ms is not None and device_ms is not None else None,
    }


def cell(value: object, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def print_engine_table(rows: list[dict]) -> None:
    columns = [
        ("setting", "setting", "s"),
        ("running", "running seqs", "d"),
        ("jaxkv_host_ms", "jaxkv host ms/step", ".2f"),
        ("jaxkv_runner_ms", "of which runner", ".2f"),
        ("jaxkv_rest_ms", "of which the rest", ".2f"),
        ("vllm_schedule_ms", "vLLM schedule", ".2f"),
        ("vllm_update_ms", "vLLM update", ".2f"),
        ("vllm_output_ms", "vLLM output proc.", ".2f"),
        ("vllm_total_ms", "vLLM total", ".2f"),
        ("jaxkv_call_ms", "of which the jitted call", ".2f"),
        ("ratio", "ratio jaxkv/vLLM", ".2f"),
        ("ratio_q1", "ratio Q1", ".2f"),
        ("ratio_q3", "ratio Q3", ".2f"),
        ("rest_ratio", "rest/vLLM", ".2f"),
        ("less_call_ratio", "(jaxkv - jitted call)/vLLM", ".2f"),
    ]
    print(
        "[engine] thread CPU ms per decode step (median of the windows of all repetitions; "
        "ratios: median and quartiles of paired windows)"
    )
    print("| " + " | ".join(title for _, title, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(cell(row[key], fmt) for key, _, fmt in columns) + " |")


def print_overlap_table(rows: Sequence[dict]) -> None:
    print(f"[overlap] {rows[0]['model']}, {rows[0]['running']} sequences decoding")
    print(
        "| loop | host ms (stubbed model) | host CPU ms | device ms | wall ms | device/host "
        "| wall / max(host, device) | (host+device) / max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    keys = ("host_ms", "host_cpu_ms", "device_ms", "wall_ms", "device_over_host", "wall_over_max", "serial_bound")
    for row in rows:
        print(f"| {row['loop']} | " + " | ".join(cell(row[k], ".2f") for k in keys) + " |")


def batch_sizes() -> list[int]:
    try:
        sizes = [int(b) for b in FLAGS.batch_sizes]
    except ValueError:
        exit_error(PROG, f"--batch_sizes must be positive ints, got {','.join(FLAGS.batch_sizes)}")
    if not sizes or min(sizes) < 1:
        exit_error(PROG, f"--batch_sizes must be positive ints, got {','.join(FLAGS.batch_sizes)}")
    return sizes


def main(argv: Sequence[str]) -> None:
    for name, allowed in (("sections", SECTIONS), ("settings", SETTINGS)):
        unknown = [s for s in FLAGS[name].value if s not in allowed]
        if unknown:
            exit_error(PROG, f"unknown {name} {unknown}; choose from {', '.join(allowed)}")
    sizes = batch_sizes()
    if FLAGS.quick:
        sizes = [min(sizes)]
        FLAGS.tiny_prompt_len = FLAGS.stub_prompt_len = 32
        FLAGS.max_num_batched_tokens = 64
        FLAGS.windows, FLAGS.window_steps, FLAGS.warmup_steps, FLAGS.reps = 3, 2, 2, 1
        FLAGS.overlap_batch, FLAGS.overlap_hidden, FLAGS.overlap_layers = 8, 64, 1
    peer = FLAGS.peer and vllm_available()
    report: dict[str, Any] = {"peer": "vllm 0.33" if peer else None, "jax": jax.__version__, "quick": FLAGS.quick}
    budget = FLAGS.max_num_batched_tokens
    max_model_len = max(
        p + max_tokens_for(b, p, budget)
        for p, b in [(FLAGS.tiny_prompt_len, FLAGS.overlap_batch)]
        + [(FLAGS.tiny_prompt_len if s == "tiny" else FLAGS.stub_prompt_len, max(sizes)) for s in FLAGS.settings]
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = tiny_checkpoint(Path(tmp), max_model_len)
            for section in FLAGS.sections:
                if section == "engine":
                    rows = engine_section(checkpoint, sizes, peer)
                    print_engine_table(rows)
                    report["engine"] = {"rows": rows}
                else:  # the overlapped loop, with the synchronous one's figures of the same run beside it
                    sync, overlapped = (overlap_section(checkpoint, mode) for mode in (False, True))
                    print_overlap_table([sync, overlapped])
                    report["overlap"] = overlapped | {"sync": sync}
    except (JaxkvError, PeerError) as err:
        exit_error(PROG, err, status=1)
    if FLAGS.out:
        write_json(PROG, FLAGS.out, report)


if __name__ == "__main__":
    app.run(main, flags_parser=flags_parser(PROG))
