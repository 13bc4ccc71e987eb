"""Generation with continuous batching: scheduler, KV cache manager, runner and sampler.

:class:`Engine` owns a :class:`~jaxkv.core.manager.KVCacheManager`, a
:class:`~jaxkv.serving.runner.ModelRunner` (weights and the device cache) and one
:class:`~jaxkv.serving.scheduler.Scheduler`; all outlive a request, so a later request
hits the prefix cache of an earlier one. A server drives it step by step
(:meth:`Engine.add_request` whenever a request arrives, :meth:`Engine.step` while any
is unfinished: a request added between steps joins the running batch; each step
returns every running sequence's new tokens and text as a :class:`RequestDelta`);
:meth:`Engine.generate` is that loop over one batch of prompts, timing each request's
first token (TTFT, from its arrival) and the KV pool usage of every step.

Each request generates as its :class:`~jaxkv.serving.sampling_params.SamplingParams`
say (a bare ``max_new_tokens`` is greedy decoding): tokens are drawn on the device
(:mod:`jaxkv.serving.sampler`), a sequence stops at a stop token or string
(:mod:`jaxkv.serving.stopping`; the checkpoint's EOS ids by default) and frees its
blocks at once, what it computed staying in the prefix cache. The ``n`` sequences of
one request share its prompt's blocks: the first is admitted alone, the others once it
has computed the prompt, so they find every full prompt block in the prefix cache.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxkv.core.manager import KVCacheManager, KVCacheManagerError, Request, token_id_list
from jaxkv.device.mesh import MODEL_AXIS, mesh_axis_size
from jaxkv.device.metadata import Buckets
from jaxkv.errors import JaxkvError, OwnerThread
from jaxkv.ints import is_int
from jaxkv.models.protocol import ServedModel
from jaxkv.models.text import TextTokenizer, load_tokenizer
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.planner import TPU_HEAD_DIM_MULTIPLE, KVCacheConfig, PlanOptions, StatePoolOptions, plan_kv_cache
from jaxkv.serving.offload_connector import OffloadConfig, OffloadConnector
from jaxkv.serving.runner import ModelRunner, default_buckets
from jaxkv.serving.sampler import RowSampling, SampledTokens
from jaxkv.serving.sampling_params import MAX_MASKED_STOP_IDS, FinishReason, SamplingParams
from jaxkv.serving.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, SeqState, check_positive_int
from jaxkv.serving.stats import EngineStats
from jaxkv.serving.stopping import StopChecker

if TYPE_CHECKING:
    from jaxkv.serving.kv_events import KVEventPublisher

DEFAULT_MAX_NUM_SEQS = 8


class EngineError(JaxkvError, ValueError):
    """An engine set-up or a generate call the engine cannot serve; nothing was run."""


@dataclass(frozen=True)
class CacheAudit:
    """Blocks (device: attention blocks and state rows) held by nobody, found between
    ``generate`` calls (both must be 0)."""

    device_blocks_leaked: int
    host_blocks_leaked: int


def resolve_head_dim_multiple(head_dim_multiple: int | None) -> int:
    """The planner's ``head_dim_multiple``: the given value, or by default
    :data:`~jaxkv.planner.TPU_HEAD_DIM_MULTIPLE` on TPU (lane-aligned heads for the
    Mosaic kernels) and 1 elsewhere (no padding where nothing gains from it)."""
    if head_dim_multiple is not None:
        return head_dim_multiple
    return TPU_HEAD_DIM_MULTIPLE if jax.default_backend() == "tpu" else 1


DEFAULT_MAX_NUM_BATCHED_TOKENS = 256
"""The step's token budget an engine plans for when not told."""

DEFAULT_CHECKPOINT_SHARE = 0.1
"""Share of ``memory_bytes`` an engine's state pool keeps for state checkpoints when not told."""


def plan_for_model(
    model: ServedModel,
    memory_bytes: int,
    *,
    max_model_len: int,
    options: PlanOptions | None = None,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    tensor_parallel: int = 1,
) -> KVCacheConfig:
    """The KV cache plan of ``model.layer_specs()`` in ``memory_bytes`` (the whole cache's,
    over ``tensor_parallel`` devices, a mesh's model axis), with ``options`` (None:
    ``PlanOptions()``) completed by what an engine knows: its step budget
    ``max_num_batched_tokens`` and the device's head tile
    (:func:`resolve_head_dim_multiple`) where the options leave them None, the mesh's
    ``tensor_parallel``, and, where no
    :class:`~jaxkv.planner.StatePoolOptions` are given and a state pool may be picked,
    live states for ``max_num_seqs`` requests and :data:`DEFAULT_CHECKPOINT_SHARE` of the
    memory for checkpoints."""
    options = PlanOptions() if options is None else options
    if not isinstance(options, PlanOptions):
        raise EngineError(f"plan must be a PlanOptions or None, got {options!r}")
    if options.tensor_parallel not in (1, tensor_parallel):
        raise EngineError(
            f"plan tensor_parallel={options.tensor_parallel} differs from the mesh's model axis of {tensor_parallel}"
        )
    pool = options.state_pool
    if pool is None and options.state_layout in (None, "state_pool"):
        pool = StatePoolOptions(max_num_seqs, int(DEFAULT_CHECKPOINT_SHARE * memory_bytes))
    options = dataclasses.replace(
        options,
        max_num_batched_tokens=options.max_num_batched_tokens or max_num_batched_tokens,
        head_dim_multiple=resolve_head_dim_multiple(options.head_dim_multiple),
        tensor_parallel=tensor_parallel,
        state_pool=pool,
    )
    return plan_kv_cache(model.layer_specs(), memory_bytes, max_model_len=max_model_len, options=options)


@dataclass(frozen=True)
class TokenLogprobs:
    """A drawn token's log-probability and the ``logprobs`` most likely tokens' (the model's
    raw distribution), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RequestOutput:
    """One finished sequence (``index`` of its request's ``n``). Times are seconds from its
    arrival (:meth:`Engine.add_request`; ``generate`` adds its prompts at the start of the call)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_cached_tokens: int
    num_preemptions: int
    ttft_s: float
    finish_s: float
    logits: np.ndarray | None = None
    """``(len(output_token_ids), vocab)`` float32: the logits each output token was
    sampled from, when ``generate(..., return_logits=True)``; else None."""
    finish_reason: FinishReason = "length"
    index: int = 0
    text: str | None = None
    """The output as text (the stop string left out), when the engine has a tokenizer."""
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """One per output token when the request asked for ``logprobs``."""


@dataclass(frozen=True)
class RequestDelta:
    """What one step added to one sequence: its new tokens (none for a prefill chunk that
    drew nothing is never reported), their text and log-probabilities, and
    ``finish_reason`` once the sequence ended (its blocks are then free)."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprobs, ...] | None
    finish_reason: FinishReason | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
class EngineStep:
    """What one :meth:`Engine.step` did: the sequences it finished, the new output of every
    sequence that drew a token or ended (aborts since the last step included), the
    tokens it computed and the KV pool usage once it was scheduled."""

    finished: tuple[RequestOutput, ...]
    num_tokens: int
    usage: float
    deltas: tuple[RequestDelta, ...] = ()


def _sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences: its own for one, ``id#index`` for several."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


@dataclass(frozen=True)
class _HeldSequence:
    """A sequence not yet handed to the scheduler (a sibling of an ``n`` > 1 request)."""

    request_id: str
    index: int
    seed: int
    request: Request
    params: SamplingParams
    arrival: float
    return_logits: bool


@dataclass(eq=False)
class _LiveRequest:
    """One sequence between :meth:`Engine.add_request` and its output (``seq`` is keyed
    by its own id: the request's id, with ``#index`` when the request has ``n`` > 1)."""

    seq: SeqState
    request_id: str
    index: int
    seed: int
    stopper: StopChecker
    arrival: float
    first_token: float | None = None
    logits: list[np.ndarray] | None = None
    logprobs: list[TokenLogprobs] | None = None

    @property
    def params(self) -> SamplingParams:
        return self.stopper.params

    def row(self, chunk: ScheduledChunk) -> RowSampling | None:
        """How this step draws the sequence's next token (None: the chunk draws nothing)."""
        if not chunk.samples:
            return None
        position = chunk.num_computed_tokens + chunk.num_new_tokens
        return RowSampling(self.params, self.seed, position, self.stopper.banned(self.seq.num_output_tokens))


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
            outputs=[{k: v for k, v in dataclasses.asdict(o).items() if k != "logits"} for o in self.outputs],
        )
        return out


class Engine:
    """Serves any :class:`~jaxkv.models.protocol.ServedModel` over a paged KV cache:
    planned by ``kv_config``, or for ``memory_bytes`` and ``max_model_len`` with the
    :class:`~jaxkv.planner.PlanOptions` ``plan`` (one or the other; :func:`plan_for_model`).

    ``max_num_batched_tokens`` (the step's token budget) defaults to the plan's own and
    may not exceed it: the plan sized sliding-window spans for that chunk size. A plan
    whose ``max_num_batched_tokens`` is None is made for the engine's (default
    :data:`DEFAULT_MAX_NUM_BATCHED_TOKENS`).
    ``offload`` adds a host-memory tier (:mod:`jaxkv.serving.offload_connector`): blocks are
    stored to host when the device reuses them (or once filled, per its ``store``
    policy) and loaded back on admission. ``kv_events`` publishes the cache events of
    every step (device and host blocks stored and removed) for a KV-aware router
    (:mod:`jaxkv.serving.kv_events`). ``mesh`` runs the model tensor-parallel over its
    ``model_axis`` (:class:`~jaxkv.serving.runner.ModelRunner`): the same tokens as on
    one device, the host-side scheduling unchanged; the host tier keeps each device's
    shard of a block. ``step_check`` is called with each step's
    :class:`~jaxkv.serving.scheduler.SchedulerOutput` right after scheduling, before
    any device work, and with ``None`` when a ``generate`` call has no step left; an
    exception from it aborts the call like any other. Multi-process engines pass a
    :class:`~jaxkv.cluster.lockstep.LockstepCheck` there, so that every process is
    shown to decide the same before a step runs. ``eos_token_ids`` (the checkpoint's:
    :meth:`from_pretrained` reads them) stop a sequence unless it ignores EOS;
    ``tokenizer`` gives outputs their text and lets requests stop at strings.

    Single-owner, like the manager: only the creating thread may call it. Each step
    runs in :meth:`~jaxkv.core.manager.KVCacheManager.step_transaction`, so an exception
    anywhere in a step (an interrupt, a failed compile, a failing callback) drops
    the hashes of the blocks that step would have written, frees every unfinished
    request, and leaves the engine usable with an exact prefix cache.
    """

    def __init__(
        self,
        model: ServedModel,
        kv_config: KVCacheConfig | None = None,
        *,
        memory_bytes: int | None = None,
        max_model_len: int | None = None,
        plan: PlanOptions | None = None,
        enable_caching: bool = True,
        max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens: int | None = None,
        buckets: Buckets | None = None,
        hash_algo: str = "sha256",
        offload: OffloadConfig | None = None,
        kv_events: KVEventPublisher | None = None,
        mesh: Mesh | None = None,
        model_axis: str = MODEL_AXIS,
        step_check: Callable[[SchedulerOutput | None], None] | None = None,
        eos_token_ids: Sequence[int] = (),
        tokenizer: TextTokenizer | None = None,
    ) -> None:
        if step_check is not None and not callable(step_check):
            raise EngineError(f"step_check must be None or a callable, got {step_check!r}")
        if kv_events is not None and not callable(getattr(kv_events, "publish_step", None)):
            raise EngineError(f"kv_events must be None or a KVEventPublisher, got {kv_events!r}")
        check_positive_int("max_num_seqs", max_num_seqs)
        if isinstance(eos_token_ids, (str, bytes)) or not all(is_int(t) and t >= 0 for t in eos_token_ids):
            raise EngineError(f"eos_token_ids must be a list of token ids, got {eos_token_ids!r}")
        if tokenizer is not None and not isinstance(tokenizer, TextTokenizer):
            raise EngineError(f"tokenizer must be None or a TextTokenizer, got {tokenizer!r:.80}")
        if kv_config is None:
            if memory_bytes is None or max_model_len is None:
                raise EngineError(
                    f"an engine needs a kv_config, or memory_bytes and max_model_len to plan one; got "
                    f"memory_bytes={memory_bytes!r}, max_model_len={max_model_len!r}"
                )
            kv_config = plan_for_model(
                model,
                memory_bytes,
                max_model_len=max_model_len,
                options=plan,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
                tensor_parallel=1 if mesh is None else mesh_axis_size(mesh, model_axis),
            )
        elif memory_bytes is not None or max_model_len is not None or plan is not None:
            raise EngineError(
                f"memory_bytes={memory_bytes!r}, max_model_len={max_model_len!r} and plan={plan!r} plan a cache; "
                "a kv_config is one already: give one or the other"
            )
        budget = kv_config.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        check_positive_int("max_num_batched_tokens", budget)
        if budget > kv_config.max_num_batched_tokens:
            raise EngineError(
                f"max_num_batched_tokens={budget} exceeds the plan's "
                f"max_num_batched_tokens={kv_config.max_num_batched_tokens}"
            )
        self.model = model
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer
        self.manager = KVCacheManager(
            kv_config, enable_caching=enable_caching, hash_algo=hash_algo, enable_events=kv_events is not None
        )
        self.kv_events = kv_events
        self.step_check = step_check
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = budget
        buckets = buckets if buckets is not None else default_buckets(kv_config, max_num_seqs, budget)
        unit_blocks = self.manager.state_blocks if kv_config.shared_states is not None else None
        self.runner = ModelRunner(model, kv_config, buckets, mesh=mesh, model_axis=model_axis, unit_blocks=unit_blocks)
        self.connector = OffloadConnector.create(self.manager, self.runner, offload) if offload else None
        self._ids = itertools.count()
        self._owner = OwnerThread("Engine")
        self._scheduler = self._new_scheduler()
        self._live: dict[str, _LiveRequest] = {}  # by sequence id
        self._requests: dict[str, list[str]] = {}  # a request's unfinished sequence ids
        self._held: dict[str, list[_HeldSequence]] = {}  # siblings queued once the first has drawn
        self._aborted: list[RequestDelta] = []  # reported by the next step
        self._seeds = np.random.default_rng()
        self._aborting: set[str] | None = None  # during a step: the aborts it defers
        self._step_observers: list[Callable[[EngineStats], None]] = []

    @classmethod
    def build(cls, model_name: str = "tiny-hybrid", *, seed: int = 0, **kwargs: Any) -> Engine:
        """A named tiny model with seeded weights; ``kwargs`` are :class:`Engine`'s (``memory_bytes``,
        ``max_model_len`` and ``plan`` plan its cache: :func:`plan_for_model`)."""
        return cls(TinyLM(get_model_config(model_name), seed=seed, name=model_name), **kwargs)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        memory_bytes: int,
        max_model_len: int,
        dtype: str | None = None,
        **engine_kwargs: Any,
    ) -> Engine:
        """An engine of the Hugging Face-format checkpoint in the local directory ``path``
        (:func:`jaxkv.models.checkpoint.load_pretrained`: weights cast to ``dtype``, None:
        the checkpoint's, and placed straight onto ``mesh``'s shardings when
        ``engine_kwargs`` has one). Its EOS ids (``generation_config.json``, else
        ``config.json``) and its tokenizer (``tokenizer.json``, when the ``tokenizers``
        extra is installed) are the engine's unless ``engine_kwargs`` names others. The
        rest are :class:`Engine` keyword arguments (``plan`` included)."""
        from jaxkv.models.checkpoint import eos_token_ids, load_pretrained  # the loaders import safetensors

        model = load_pretrained(
            path,
            dtype=dtype,
            mesh=engine_kwargs.get("mesh"),
            model_axis=engine_kwargs.get("model_axis", MODEL_AXIS),
            max_model_len=max_model_len,
        )
        engine_kwargs.setdefault("eos_token_ids", eos_token_ids(path))
        if "tokenizer" not in engine_kwargs:
            engine_kwargs["tokenizer"] = load_tokenizer(path)
        return cls(model, memory_bytes=memory_bytes, max_model_len=max_model_len, **engine_kwargs)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int | SamplingParams | Sequence[int | SamplingParams],
        *,
        cache_salt: str | Sequence[str | None] | None = None,
        progress: Callable[[StepProgress], None] | None = None,
        return_logits: bool = False,
    ) -> GenerationResult:
        """Continuations of ``prompts``: greedy ones of up to ``max_new_tokens`` tokens, or as
        :class:`SamplingParams` say (one for all prompts, or one per prompt); the outputs
        in prompt order, a prompt's ``n`` sequences by index.

        ``cache_salt`` (one for all prompts, or one per prompt) separates tenants:
        prompts with different salts never share a cached block (see README on the
        hash algorithm). A request also stops at ``max_model_len`` tokens. Bad input
        raises :class:`EngineError` before anything runs, and so does a call while
        requests added with :meth:`add_request` are unfinished; an exception during
        the run leaves nothing held and the prefix cache exact. ``return_logits`` also
        brings back the logits of every sampled token (:attr:`RequestOutput.logits`; a
        step compiled apart, for token checks such as :mod:`jaxkv.serving.logit_check`).
        """
        self._owner.check()
        prompts, params, salts = self._check(prompts, max_new_tokens, cache_salt)
        if self._requests:
            raise EngineError(f"generate needs an idle engine; {len(self._requests)} added requests are unfinished")
        compilations = self.runner.num_compilations
        start = time.perf_counter()
        ids = [
            self._add(prompt, p, salt, None, return_logits)
            for prompt, p, salt in zip(prompts, params, salts, strict=True)
        ]
        outputs: dict[tuple[str, int], RequestOutput] = {}
        steps: list[EngineStep] = []
        try:
            while self._requests:
                steps.append(self.step())
                outputs.update(((o.request_id, o.index), o) for o in steps[-1].finished)
                if progress is not None:
                    progress(
                        StepProgress(
                            len(steps),
                            time.perf_counter() - start,
                            steps[-1].num_tokens,
                            self.num_waiting,
                            self.num_running,
                            len(outputs),
                            sum(p.n for p in params),
                            steps[-1].usage,
                        )
                    )
            if self.step_check is not None:
                self.step_check(None)
        except BaseException:
            self._abort()
            raise
        results = [outputs[i, k] for i, p in zip(ids, params, strict=True) for k in range(p.n) if (i, k) in outputs]
        usages = [s.usage for s in steps]
        return GenerationResult(
            outputs=tuple(results),
            wall_s=time.perf_counter() - start,
            num_steps=len(steps),
            num_prompt_tokens=sum(len(o.prompt_token_ids) for o in results),
            num_cached_prompt_tokens=sum(o.num_cached_tokens for o in results),
            num_generated_tokens=sum(len(o.output_token_ids) for o in results),
            num_scheduled_tokens=sum(s.num_tokens for s in steps),
            num_preemptions=sum(o.num_preemptions for o in results),
            peak_usage=max(usages, default=0.0),
            mean_usage=float(np.mean(usages)) if usages else 0.0,
            num_compilations=self.runner.num_compilations - compilations,
        )

    # ------------------------------------------------------- step by step
    def add_request(
        self,
        prompt: Sequence[int],
        max_new_tokens: int | SamplingParams,
        *,
        cache_salt: str | None = None,
        request_id: str | None = None,
        return_logits: bool = False,
    ) -> str:
        """Queue one request (checked as ``generate`` checks a prompt; greedy for a bare
        ``max_new_tokens``); its id, given or made. It is admitted at a later :meth:`step`,
        beside the requests running then."""
        self._owner.check()
        [ids], [params], [salt] = self._check([prompt], max_new_tokens, cache_salt)
        if request_id is not None and (not isinstance(request_id, str) or self._taken(request_id, params.n)):
            raise EngineError(f"request_id must be a str not already unfinished, got {request_id!r}")
        return self._add(ids, params, salt, request_id, return_logits)

    @property
    def num_running(self) -> int:
        """Requests admitted and not finished."""
        return len(self._scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests queued (new or preempted) and not admitted."""
        return len(self._scheduler.waiting)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def step(self) -> EngineStep:
        """Run one scheduler step over the unfinished requests (nothing when there are
        none): every sequence that drew a token reports it (:class:`RequestDelta`), one
        that stopped is freed at once. An exception in it drops every unfinished request
        (freed, the prefix cache exact: see the class docstring) and propagates."""
        self._owner.check()
        deltas, self._aborted = self._aborted, []
        if not self._live:
            return EngineStep((), 0, self.manager.usage, tuple(deltas))
        self._aborting = set()
        try:
            with self.manager.step_transaction():
                output = self._scheduler.schedule()
                if self.step_check is not None:
                    self.step_check(output)
                usage = self.manager.usage
                if self.connector is not None:
                    self.connector.before_step()  # reads reused blocks before the step writes them
                live = [self._live[c.seq.request_id] for c in output.chunks]
                sampled, logits = self.runner.execute_sampled(
                    output.chunks,
                    [r.row(c) for c, r in zip(output.chunks, live, strict=True)],
                    with_logits=any(r.logits is not None for r in live),
                )
                if logits is not None:
                    for chunk, row, request in zip(output.chunks, logits, live, strict=True):
                        if chunk.samples and request.logits is not None:
                            request.logits.append(row)
                if self.connector is not None:
                    self.connector.after_step(output.chunks)
            self._publish_events()
            done = {seq.request_id for seq in self._scheduler.update(output, sampled.token_ids.tolist())}
        except BaseException:
            self._aborting = None
            self._abort()
            raise
        aborted, self._aborting = self._aborting, None
        now = time.perf_counter()
        finished = []
        for i, (chunk, request) in enumerate(zip(output.chunks, live, strict=True)):
            if chunk.samples:
                delta = self._take_token(request, sampled, i, chunk.seq.request_id in done, now)
                deltas.append(delta)
                if delta.finish_reason is not None:
                    finished.append(self._output(request, now, delta.finish_reason))
        if aborted:  # from step_check: effective now the step is over; their outputs are dropped
            for request_id in aborted:
                self.abort(request_id)
            deltas.extend(self._aborted)
            self._aborted = []
            finished = [out for out in finished if out.request_id not in aborted]
        if not self._live:
            self._release(())
        self._publish_events()  # early stops' frees (and host stores settled by _release)
        if self._step_observers:
            stats = self.stats()
            for observer in self._step_observers:
                observer(stats)
        return EngineStep(tuple(finished), output.num_tokens, usage, tuple(deltas))

    def _take_token(
        self, request: _LiveRequest, sampled: SampledTokens, row: int, at_limit: bool, now: float
    ) -> RequestDelta:
        """Record the token ``row`` of ``sampled`` drew for ``request``: its text, whether it
        stops the sequence (then freed, unless the scheduler freed it at its limit), and
        the first token's time (the held siblings queued then)."""
        sid = request.seq.request_id
        if request.first_token is None:
            request.first_token = now
            for held in self._held.pop(sid, ()):  # it has computed the prompt: its siblings will hit it
                self._queue(held)
        token = int(sampled.token_ids[row])
        logprobs = None
        if request.params.logprobs is not None:
            k = request.params.logprobs
            assert sampled.logprob is not None and sampled.top_ids is not None and sampled.top_logprobs is not None
            top = tuple(zip(sampled.top_ids[row, :k].tolist(), sampled.top_logprobs[row, :k].tolist(), strict=True))
            logprobs = (TokenLogprobs(token, float(sampled.logprob[row]), top),)
            assert request.logprobs is not None  # made for a request with logprobs
            request.logprobs.append(logprobs[0])
        text, reason = request.stopper.update(token, request.seq.num_output_tokens)
        if reason is None and at_limit:
            text, reason = text + request.stopper.finish(), "length"
        elif reason is not None and not at_limit:
            self._scheduler.remove(request.seq)
            self.manager.free(request.seq.request)
        if reason is not None:
            self._forget(request)
        return RequestDelta(request.request_id, request.index, (token,), text, logprobs, reason)

    def abort(self, request_id: str) -> bool:
        """Drop one unfinished request (all its sequences): its blocks and states freed
        (what it computed stays cached), its events published, an "abort" delta reported
        by the next step; False when no such request is unfinished. Host-tier pins last
        only within a step, so none is left to drop. Called during a step (from
        ``step_check``), it takes effect when the step ends and the request gets no
        output; a request of a ``generate`` call aborted from its ``progress`` callback is
        left out of the call's outputs."""
        self._owner.check()
        sids = self._requests.get(request_id) if isinstance(request_id, str) else None
        if not sids:
            return False
        if self._aborting is not None:  # inside a step: its chunks and blocks are in use
            self._aborting.add(request_id)
            return True
        for sid in list(sids):
            for held in self._held.pop(sid, ()):
                self._aborted.append(RequestDelta(request_id, held.index, (), "", None, "abort"))
            request = self._live[sid]
            self._scheduler.remove(request.seq)
            if self.manager.has_request(sid):
                self.manager.free(request.seq.request)
            self._aborted.append(RequestDelta(request_id, request.index, (), request.stopper.finish(), None, "abort"))
            self._forget(request)
        if not self._live:
            self._release(())
        self._publish_events()
        return True

    def add_step_observer(self, observer: Callable[[EngineStats], None]) -> None:
        """Call ``observer`` with :meth:`stats` after every step (a metrics exporter:
        :class:`jaxkv.serving.metrics.PrometheusMetrics`)."""
        self._owner.check()
        self._step_observers.append(observer)

    def stats(self) -> EngineStats:
        """Usage, queue lengths and cumulative counters of the engine now."""
        cache = self.manager.prefix_cache_stats()
        host = self.connector.stats if self.connector is not None else None
        return EngineStats(
            kv_cache_usage=self.manager.usage,
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_preemptions=self._scheduler.num_preemptions,
            prefix_cache_queries=cache.num_queried_tokens,
            prefix_cache_hits=cache.num_hit_tokens,
            host_cache_queries=host.num_queried_tokens if host else 0,
            host_cache_hits=host.num_loaded_tokens if host else 0,
            offload_stored_bytes=host.num_stored_bytes if host else 0,
            offload_loaded_bytes=host.num_loaded_bytes if host else 0,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the device prefix cache (published as ``AllBlocksCleared``); refused
        (False) while requests are unfinished."""
        self._owner.check()
        ok = not self._live and self.manager.reset_prefix_cache()
        self._publish_events()
        return ok

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(
            self.manager,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            admission=self.connector,
        )

    def _taken(self, request_id: str, n: int) -> bool:
        """Whether ``request_id`` (or one of its ``n`` sequence ids) names an unfinished sequence."""
        return request_id in self._requests or any(sid in self._live for sid in _sequence_ids(request_id, n))

    def _add(
        self, prompt: list[int], params: SamplingParams, salt: str | None, request_id: str | None, return_logits: bool
    ) -> str:
        rid = request_id
        if rid is None:
            rid = f"req-{next(self._ids)}"
            while self._taken(rid, params.n):  # a made id never takes a caller's
                rid = f"req-{next(self._ids)}"
        arrival = time.perf_counter()
        first = None
        sids = _sequence_ids(rid, params.n)
        for index, sid in enumerate(sids):
            seed = params.seed + index if params.seed is not None else int(self._seeds.integers(2**32))
            held = _HeldSequence(
                rid, index, seed, Request(sid, prompt, cache_salt=salt), params, arrival, return_logits
            )
            if first is None:
                first = self._queue(held)
            else:
                self._held.setdefault(first.seq.request_id, []).append(held)
        self._requests[rid] = sids
        return rid

    def _queue(self, held: _HeldSequence) -> _LiveRequest:
        """Hand one sequence to the scheduler."""
        params = held.params
        seq = self._scheduler.add_request(held.request, params.max_tokens or self.manager.max_model_len)
        detokenizer = None if self.tokenizer is None else self.tokenizer.detokenizer()
        live = _LiveRequest(
            seq,
            held.request_id,
            held.index,
            held.seed,
            StopChecker(params, self.eos_token_ids, detokenizer),
            held.arrival,
            logits=[] if held.return_logits else None,
            logprobs=[] if params.logprobs is not None else None,
        )
        self._live[held.request.request_id] = live
        return live

    def _forget(self, request: _LiveRequest) -> None:
        """Drop a finished or aborted sequence from the engine's books."""
        sid = request.seq.request_id
        self._live.pop(sid, None)
        sids = self._requests[request.request_id]
        sids.remove(sid)
        if not sids:
            del self._requests[request.request_id]

    def _abort(self) -> None:
        """Drop every unfinished request (freeing what it holds) and start a fresh scheduler."""
        try:
            self._release([r.seq for r in self._live.values()])
        finally:
            self._live.clear()
            self._requests.clear()
            self._held.clear()
            self._aborted.clear()
            self._scheduler = self._new_scheduler()

    def audit(self) -> CacheAudit:
        """Count blocks held by nobody; call it between ``generate`` calls (when no
        request is live, every usable device block is free and every host block
        belongs to a stored key)."""
        self._owner.check()
        leaked = self.manager.config.num_blocks - 1 - self.manager.num_free_blocks
        states = self.manager.state_pool
        if states is not None:
            leaked += states.num_blocks - 1 - states.num_free_blocks
        host = self.connector.num_leaked_host_blocks() if self.connector is not None else 0
        return CacheAudit(leaked, host)

    def _publish_events(self) -> None:
        """Publish the cache events since the last call (with ``kv_events``); a failed
        call's events go out with the next step."""
        if self.kv_events is not None:
            self.kv_events.publish_step(self.manager, self.connector)

    def _release(self, seqs: Sequence[SeqState]) -> None:
        """Settle stores, free what ``seqs`` still hold (requests dropped by an
        exception), and replace the cache if an interrupted step consumed it."""
        try:
            if self.connector is not None:
                self.connector.finish_stores()
        finally:
            for seq in seqs:
                if self.manager.has_request(seq.request_id):
                    self.manager.free(seq.request)
            if not self.runner.cache_is_intact():
                self.runner.reallocate_cache()
                if self.connector is not None:
                    self.connector.discard_reused()
                self.manager.reset_prefix_cache()

    def _check(
        self,
        prompts: object,
        max_new_tokens: object,
        cache_salt: object,
    ) -> tuple[list[list[int]], list[SamplingParams], list[str | None]]:
        """Prompts as token lists, per-prompt sampling parameters and salts;
        :class:`EngineError` naming the first bad value."""
        if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
            raise EngineError(f"prompts must be a list of token-id sequences, got {prompts!r:.80}")
        if not len(prompts):
            raise EngineError("generate needs at least one prompt")
        if is_int(prompts[0]):
            raise EngineError("prompts must be a list of prompts, got a flat list of ints (wrap one prompt in a list)")
        n = len(prompts)
        limits = self._per_prompt(
            "max_new_tokens",
            max_new_tokens,
            n,
            scalar=lambda v: isinstance(v, SamplingParams) or not isinstance(v, Sequence),
        )
        salts = self._per_prompt("cache_salt", cache_salt, n, scalar=lambda v: v is None or isinstance(v, str))
        vocab = self.model.vocab_size
        max_len = self.manager.max_model_len
        out = []
        params = []
        for i, (prompt, limit, salt) in enumerate(zip(prompts, limits, salts, strict=True)):
            params.append(self._params(i, limit))
            if salt is not None and not isinstance(salt, str):
                raise EngineError(f"prompt {i}: cache_salt must be a str or None, got {salt!r}")
            try:
                ids = token_id_list(prompt, f"prompt {i}")
            except KVCacheManagerError as err:
                raise EngineError(str(err)) from None
            if not ids:
                raise EngineError(f"prompt {i} is empty")
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise EngineError(f"prompt {i}: token {bad!r} is not an id in [0, {vocab})")
            if len(ids) >= max_len:
                raise EngineError(
                    f"prompt {i} has {len(ids)} tokens; max_model_len={max_len} leaves no room for an output token"
                )
            out.append(ids)
        return out, params, salts

    def _params(self, i: int, limit: object) -> SamplingParams:
        """Prompt ``i``'s sampling parameters (a bare limit: greedy), checked against this engine."""
        if not isinstance(limit, SamplingParams):
            if not is_int(limit) or limit <= 0:
                raise EngineError(
                    f"prompt {i}: max_new_tokens must be a positive int, got {limit!r} (or a SamplingParams)"
                )
            return SamplingParams.greedy(int(limit))
        if limit.stop and self.tokenizer is None:
            raise EngineError(f"prompt {i}: stop strings {limit.stop!r} need a tokenizer, and this engine has none")
        vocab = self.model.vocab_size
        bad = next((t for t in limit.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise EngineError(f"prompt {i}: stop token {bad} is not an id in [0, {vocab})")
        stop_ids = StopChecker(limit, self.eos_token_ids, None).stop_token_ids
        if limit.min_tokens and len(stop_ids) > MAX_MASKED_STOP_IDS:
            raise EngineError(
                f"prompt {i}: min_tokens={limit.min_tokens} masks at most {MAX_MASKED_STOP_IDS} stop ids, "
                f"got {len(stop_ids)} (EOS included)"
            )
        return limit

    @staticmethod
    def _per_prompt(name: str, value: object, n: int, *, scalar: Callable[[object], bool]) -> list:
        """One value per prompt: ``value`` repeated when it is a scalar, else its items."""
        if scalar(value):
            return [value] * n
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
            raise EngineError(f"{name} must be one value or one per prompt, got {value!r:.80}")
        if len(value) != n:
            raise EngineError(f"{len(value)} {name} values for {n} prompts")
        return list(value)

    def _output(self, request: _LiveRequest, now: float, reason: FinishReason) -> RequestOutput:
        seq = request.seq
        req = seq.request
        # A finished request was admitted (its prefix hit counted) and sampled at least once.
        assert seq.num_cached_tokens is not None and request.first_token is not None
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=tuple(req.prompt_token_ids),
            output_token_ids=tuple(req.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens,
            num_preemptions=seq.num_preemptions,
            ttft_s=request.first_token - request.arrival,
            finish_s=now - request.arrival,
            logits=None if request.logits is None else np.stack(request.logits),
            finish_reason=reason,
            index=request.index,
            text=None if self.tokenizer is None else request.stopper.text,
            logprobs=None if request.logprobs is None else tuple(request.logprobs),
        )
