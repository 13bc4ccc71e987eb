"""Greedy generation with continuous batching: scheduler, KV cache manager and runner.

:class:`Engine` owns a :class:`~jaxkv.manager.KVCacheManager` and a
:class:`~jaxkv.serving.runner.ModelRunner` (weights and the device cache); both outlive
a :meth:`Engine.generate` call, so a later call hits the prefix cache of an earlier one.
Each call queues its prompts on a fresh :class:`~jaxkv.serving.scheduler.Scheduler`
and steps until every request is done, timing each request's first token (TTFT, from
the start of the call) and the KV pool usage of every step.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jaxkv.manager import KVCacheManager, Request
from jaxkv.metadata import Buckets
from jaxkv.offload.connector import OffloadConfig, OffloadConnector
from jaxkv.planner import TPU_HEAD_DIM_MULTIPLE, KVCacheConfig, plan_kv_cache
from jaxkv.serving.models import TinyLM, get_model_config
from jaxkv.serving.runner import ModelRunner, default_buckets
from jaxkv.serving.scheduler import Scheduler, SeqState, check_positive_int


class EngineError(ValueError):
    """An engine set-up or a generate call the engine cannot serve; nothing was run."""


def resolve_head_dim_multiple(head_dim_multiple: int | None) -> int:
    """The planner's ``head_dim_multiple``: the given value, or by default
    :data:`~jaxkv.planner.TPU_HEAD_DIM_MULTIPLE` on TPU (lane-aligned heads for the
    Mosaic kernels) and 1 elsewhere (no padding where nothing gains from it)."""
    if head_dim_multiple is not None:
        return head_dim_multiple
    return TPU_HEAD_DIM_MULTIPLE if jax.default_backend() == "tpu" else 1


@dataclass(frozen=True)
class RequestOutput:
    """One request's result. Times are seconds from the start of its ``generate`` call."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_cached_tokens: int
    num_preemptions: int
    ttft_s: float
    finish_s: float


@dataclass(frozen=True)
class StepProgress:
    """A snapshot after one engine step, for progress callbacks."""

    step: int
    elapsed_s: float
    num_tokens: int
    num_waiting: int
    num_running: int
    num_finished: int
    num_requests: int
    usage: float


@dataclass(frozen=True)
class GenerationResult:
    """What one ``generate`` call did.

    ``num_cached_prompt_tokens`` counts each request's prefix-cache hit at its first
    admission; ``num_compilations`` the step-function traces during this call.
    """

    outputs: tuple[RequestOutput, ...]
    wall_s: float
    num_steps: int
    num_prompt_tokens: int
    num_cached_prompt_tokens: int
    num_generated_tokens: int
    num_scheduled_tokens: int
    num_preemptions: int
    peak_usage: float
    mean_usage: float
    num_compilations: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_cached_prompt_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def scheduled_tokens_per_s(self) -> float:
        """Prefill and decode tokens computed per second."""
        return self.num_scheduled_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def mean_ttft_s(self) -> float:
        return float(np.mean([o.ttft_s for o in self.outputs])) if self.outputs else 0.0

    def to_dict(self) -> dict:
        """Counters, rates and per-request outputs as a JSON-able dict."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "outputs"}
        out.update(
            prefix_hit_rate=self.prefix_hit_rate,
            output_tokens_per_s=self.output_tokens_per_s,
            scheduled_tokens_per_s=self.scheduled_tokens_per_s,
            mean_ttft_s=self.mean_ttft_s,
            outputs=[dataclasses.asdict(o) for o in self.outputs],
        )
        return out


class Engine:
    """Serves a :class:`TinyLM` over a paged KV cache planned by ``kv_config``.

    ``max_num_batched_tokens`` (the step's token budget) defaults to the plan's own and
    may not exceed it: the plan sized sliding-window spans for that chunk size.
    ``offload`` adds a host-memory tier (:mod:`jaxkv.offload.connector`): blocks are
    stored to host when the device reuses them (or once filled, per its ``store``
    policy) and loaded back on admission.
    """

    def __init__(
        self,
        model: TinyLM,
        kv_config: KVCacheConfig,
        *,
        enable_caching: bool = True,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int | None = None,
        buckets: Buckets | None = None,
        hash_algo: str = "sha256",
        offload: OffloadConfig | None = None,
    ) -> None:
        budget = kv_config.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", budget)
        if budget > kv_config.max_num_batched_tokens:
            raise EngineError(
                f"max_num_batched_tokens={budget} exceeds the plan's "
                f"max_num_batched_tokens={kv_config.max_num_batched_tokens}"
            )
        self.model = model
        self.manager = KVCacheManager(kv_config, enable_caching=enable_caching, hash_algo=hash_algo)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = budget
        buckets = buckets if buckets is not None else default_buckets(kv_config, max_num_seqs, budget)
        self.runner = ModelRunner(model, kv_config, buckets)
        self.connector = OffloadConnector.create(self.manager, self.runner, offload) if offload else None
        self._ids = itertools.count()

    @classmethod
    def build(
        cls,
        model_name: str = "tiny-hybrid",
        *,
        memory_bytes: int,
        max_model_len: int,
        block_size: int = 16,
        layout: str = "cross_layer",
        max_num_batched_tokens: int = 256,
        seed: int = 0,
        head_dim_multiple: int | None = None,
        **kwargs: object,
    ) -> Engine:
        """A named tiny model with seeded weights and a KV cache planned for ``memory_bytes``.

        ``head_dim_multiple`` goes to the planner (None: see
        :func:`resolve_head_dim_multiple`, 128 on TPU, else 1). Other keyword
        arguments go to :class:`Engine`.
        """
        model = TinyLM(get_model_config(model_name), seed=seed)
        config = plan_kv_cache(
            model.config.layer_specs(),
            memory_bytes,
            max_model_len=max_model_len,
            block_size=block_size,
            layout=layout,
            max_num_batched_tokens=max_num_batched_tokens,
            head_dim_multiple=resolve_head_dim_multiple(head_dim_multiple),
        )
        return cls(model, config, **kwargs)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | Sequence[int],
        *,
        progress: Callable[[StepProgress], None] | None = None,
    ) -> GenerationResult:
        """Greedy continuations of ``prompts`` (``max_new_tokens`` each, or one limit per prompt).

        A request also stops at ``max_model_len`` tokens. Bad prompts raise
        :class:`EngineError` before anything runs.
        """
        limits = self._check(prompts, max_new_tokens)
        scheduler = Scheduler(
            self.manager,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            admission=self.connector,
        )
        seqs = [
            scheduler.add_request(Request(f"req-{next(self._ids)}", prompt), limit)
            for prompt, limit in zip(prompts, limits)
        ]
        compilations = self.runner.num_compilations
        ttft: dict[str, float] = {}
        finish: dict[str, float] = {}
        usages: list[float] = []
        start = time.perf_counter()
        try:
            while scheduler.has_unfinished:
                output = scheduler.schedule()
                usages.append(self.manager.usage)
                if self.connector is not None:
                    self.connector.before_step()  # reads reused blocks before the step writes them
                tokens = self.runner.execute(output.chunks)
                if self.connector is not None:
                    self.connector.after_step(output.chunks)
                done = scheduler.update(output, tokens.tolist())
                now = time.perf_counter() - start
                for chunk in output.chunks:
                    if chunk.samples:
                        ttft.setdefault(chunk.seq.request_id, now)
                for seq in done:
                    finish[seq.request_id] = now
                if progress is not None:
                    progress(
                        StepProgress(
                            len(usages), now, output.num_tokens, len(scheduler.waiting),
                            len(scheduler.running), len(finish), len(seqs), usages[-1],
                        )
                    )
        finally:
            if self.connector is not None:
                self.connector.finish_stores()
            for seq in scheduler.running:
                self.manager.free(seq.request)
        return GenerationResult(
            outputs=tuple(self._output(s, ttft, finish) for s in seqs),
            wall_s=time.perf_counter() - start,
            num_steps=len(usages),
            num_prompt_tokens=sum(s.request.num_prompt_tokens for s in seqs),
            num_cached_prompt_tokens=sum(s.num_cached_tokens for s in seqs),
            num_generated_tokens=sum(s.num_output_tokens for s in seqs),
            num_scheduled_tokens=scheduler.num_scheduled_tokens,
            num_preemptions=scheduler.num_preemptions,
            peak_usage=max(usages, default=0.0),
            mean_usage=float(np.mean(usages)) if usages else 0.0,
            num_compilations=self.runner.num_compilations - compilations,
        )

    def _check(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> list[int]:
        """Per-prompt limits; raise :class:`EngineError` naming the first bad prompt or limit."""
        if not prompts:
            raise EngineError("generate needs at least one prompt")
        limits = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
        if len(limits) != len(prompts):
            raise EngineError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
        vocab = self.model.config.vocab_size
        for i, (prompt, limit) in enumerate(zip(prompts, limits)):
            if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
                raise EngineError(f"prompt {i}: max_new_tokens must be a positive int, got {limit!r}")
            if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence | np.ndarray):
                raise EngineError(f"prompt {i} must be a sequence of token ids, got {prompt!r:.60}")
            if len(prompt) == 0:
                raise EngineError(f"prompt {i} is empty")
            bad = [t for t in prompt if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
            if bad:
                raise EngineError(f"prompt {i}: token {bad[0]!r} is not an id in [0, {vocab})")
            if len(prompt) >= self.manager.max_model_len:
                raise EngineError(
                    f"prompt {i} has {len(prompt)} tokens; max_model_len={self.manager.max_model_len} "
                    "leaves no room for an output token"
                )
        return limits

    @staticmethod
    def _output(seq: SeqState, ttft: dict[str, float], finish: dict[str, float]) -> RequestOutput:
        req = seq.request
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            output_token_ids=tuple(req.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            ttft_s=ttft[req.request_id],
            finish_s=finish[req.request_id],
        )
