"""Generation with continuous batching: the loop schedule -> execute -> update -> process.

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

The engine is the loop between vLLM v1's seams: requests are checked by
:mod:`jaxkv.serving.input_processor`, scheduled by :mod:`jaxkv.serving.scheduler`
(whose ``finish`` is the one path that frees a request's blocks), run by
:mod:`jaxkv.serving.runner`, and turned into outputs by
:mod:`jaxkv.serving.output_processor` (stops, text, logprobs, the ``n`` siblings); the
result types are in :mod:`jaxkv.serving.outputs`.

By default the loop overlaps the host with the device (vLLM's asynchronous scheduling):
a step schedules and dispatches step N+1 before it reads back step N's tokens, which stay
on the device and feed step N+1's decodes; the host learns them one step late. The
scheduler counts them as placeholders (a block is cached only once its tokens are known;
a request whose tokens in flight reach its length is not scheduled again), and a
sequence that stopped or was aborted at step N has its step N+1 token dropped. Step N's
output processing (stops, text, logprobs, deltas) and the host tier's stores run while
step N+1 runs on the device::

    host:   schedule N+1 | dispatch N+1 | read N | update, outputs N | schedule N+2 | ...
    device:  ... step N ...            |  step N+1 ....................|  step N+2

``async_scheduling=False`` keeps the synchronous loop (the host waits for each step's
tokens before it schedules the next); both give the same tokens.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import jax
import numpy as np
from jax.sharding import Mesh

from jaxkv.core.manager import KVCacheManager, KVCacheManagerError, Request
from jaxkv.core.request import checked_branch_points
from jaxkv.device.mesh import MODEL_AXIS, mesh_axis_size
from jaxkv.device.metadata import Buckets
from jaxkv.errors import OwnerThread
from jaxkv.ints import is_int
from jaxkv.models.protocol import ServedModel
from jaxkv.models.text import TextTokenizer, load_tokenizer
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.planner import TPU_HEAD_DIM_MULTIPLE, KVCacheConfig, PlanOptions, StatePoolOptions, plan_kv_cache
from jaxkv.serving.input_processor import EngineError, InputProcessor
from jaxkv.serving.offload_connector import OffloadConfig, OffloadConnector
from jaxkv.serving.output_processor import LiveSequence, OutputProcessor, ProcessedStep, SampledRows
from jaxkv.serving.outputs import (
    CacheAudit,
    EngineStep,
    GenerationResult,
    RequestDelta,
    RequestOutput,
    StepProgress,
    TokenLogprobs,
)
from jaxkv.serving.runner import Collected, InFlight, ModelRunner, default_buckets
from jaxkv.serving.sampler import RowSampling, SampledTokens
from jaxkv.serving.sampling_params import SamplingParams
from jaxkv.serving.scheduler import ScheduledChunk, Scheduler, SchedulerOutput, SeqState, check_positive_int
from jaxkv.serving.stats import EngineStats

if TYPE_CHECKING:
    from jaxkv.serving.kv_events import KVEventPublisher

__all__ = [  # the result types and EngineError live in their own modules; named here too, as before
    "CacheAudit",
    "Engine",
    "EngineError",
    "EngineStep",
    "GenerationResult",
    "RequestDelta",
    "RequestOutput",
    "StepProgress",
    "TokenLogprobs",
    "freeze_heap",
    "plan_for_model",
    "resolve_head_dim_multiple",
]

DEFAULT_MAX_NUM_SEQS = 8


class _Step(NamedTuple):
    """A dispatched step: what was scheduled, its outputs on the device, and (asynchronous
    scheduling) the row each drawing sequence's token has in them."""

    output: SchedulerOutput
    handle: InFlight
    rows: dict[SeqState, int]


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
    ``async_scheduling`` (default) overlaps the host with the device (see the module
    docstring); False runs each step to its end before the next is scheduled.

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
        async_scheduling: bool = True,
    ) -> None:
        if not isinstance(async_scheduling, bool):
            raise EngineError(f"async_scheduling must be a bool, got {async_scheduling!r}")
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
        self._owner = OwnerThread("Engine")
        self._inputs = InputProcessor(
            model.vocab_size, self.manager.max_model_len, self.eos_token_ids, has_tokenizer=tokenizer is not None
        )
        self._outputs = OutputProcessor(self.eos_token_ids, tokenizer, self._enqueue)
        self._scheduler = self._new_scheduler()
        self._aborting: set[str] | None = None  # during a step: the aborts it defers
        self.async_scheduling = async_scheduling
        self._in_flight: _Step | None = None  # asynchronous scheduling: the step dispatched, not read back
        self._step_observers: list[Callable[[EngineStats], None]] = []
        self._publish_events()  # a host tier reloaded from its file announces its blocks at once

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
        prompts, params, salts = self._inputs.check(prompts, max_new_tokens, cache_salt)
        if self._outputs.requests:
            raise EngineError(
                f"generate needs an idle engine; {len(self._outputs.requests)} added requests are unfinished"
            )
        compilations = self.runner.num_compilations
        start = time.perf_counter()
        ids = [
            self._outputs.add(prompt, p, salt, None, return_logits, start)
            for prompt, p, salt in zip(prompts, params, salts, strict=True)
        ]
        outputs: dict[tuple[str, int], RequestOutput] = {}
        steps: list[EngineStep] = []
        try:
            while self._outputs.requests:
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
        branch_points: Sequence[int] = (),
    ) -> str:
        """Queue one request (checked as ``generate`` checks a prompt; greedy for a bare
        ``max_new_tokens``); its id, given or made. It is admitted at a later :meth:`step`,
        beside the requests running then. ``branch_points``: positions of the prompt where
        later prompts are likely to leave it (a chat's message boundaries, as the server
        passes them); a recurrent model checkpoints its state there."""
        self._owner.check()
        [ids], [params], [salt] = self._inputs.check([prompt], max_new_tokens, cache_salt)
        try:
            points = checked_branch_points(branch_points, len(ids), "add_request")
        except KVCacheManagerError as err:
            raise EngineError(str(err)) from None
        if request_id is not None and (not isinstance(request_id, str) or self._outputs.taken(request_id, params.n)):
            raise EngineError(f"request_id must be a str not already unfinished, got {request_id!r}")
        return self._outputs.add(ids, params, salt, request_id, return_logits, time.perf_counter(), points)

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
        return bool(self._outputs.requests)

    def step(self) -> EngineStep:
        """Run one scheduler step over the unfinished requests (nothing when there are
        none): schedule, execute, update the scheduler, process the outputs. Every
        sequence that drew a token reports it (:class:`RequestDelta`), one that stopped is
        freed at once. With ``async_scheduling`` the tokens reported are those of the step
        dispatched by the previous call (read back once this call's step is dispatched).
        An exception in it drops every unfinished request (freed, the prefix cache exact:
        see the class docstring) and propagates."""
        self._owner.check()
        deltas = self._outputs.take_aborted()
        if not self._outputs.live:
            if deltas:  # the last requests were aborted: the gauges say so now, not at the next request
                self._observe()
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
                dispatched = self._dispatch(output)
                if self.async_scheduling:
                    if self.connector is not None:  # the blocks with known tokens, before a later step reuses them
                        self.connector.after_step(output.chunks)
                    self._scheduler.advance(output)
                    done_step, self._in_flight = self._in_flight, dispatched
                else:
                    done_step = dispatched
                read = self._read(done_step)
                if self.connector is not None and not self.async_scheduling:
                    self.connector.after_step(output.chunks)
            self._publish_events()
            if done_step is None or read is None:
                processed = ProcessedStep([], [], [])
            else:
                processed = self._update(done_step, read)
        except BaseException:
            self._aborting = None
            self._abort()
            raise
        aborted, self._aborting = self._aborting, None
        self._scheduler.finish(processed.stopped)
        deltas.extend(processed.deltas)
        finished = processed.finished
        if aborted:  # from step_check: effective now the step is over; their outputs are dropped
            for request_id in aborted:
                self.abort(request_id)
            deltas.extend(self._outputs.take_aborted())
            finished = [out for out in finished if out.request_id not in aborted]
        if not self._outputs.live:
            self._release()
        self._publish_events()  # early stops' frees (and host stores settled by _release)
        self._observe()
        return EngineStep(tuple(finished), output.num_tokens, usage, tuple(deltas))

    def _dispatch(self, output: SchedulerOutput) -> _Step | None:
        """Queue the step's chunks on the device (None: nothing scheduled, a step whose
        requests all wait for their tokens in flight). A decode of a token drawn by the step
        in flight is fed that token on the device."""
        if not output.chunks:
            return None
        fed = None
        if self._in_flight is not None:
            in_flight = self._in_flight.rows
            fed = {i: in_flight[c.seq] for i, c in enumerate(output.chunks) if c.seq.num_placeholders}
        sampling: list[RowSampling | None] = []
        with_logits = score_prompt = False  # score_prompt: a step scoring every new token
        for chunk, live in zip(output.chunks, self._outputs.sequences(output.chunks), strict=True):
            sampling.append(self._row(chunk, live))
            with_logits = with_logits or live.logits is not None
            score_prompt = score_prompt or live.scores_prompt
        handle = self.runner.dispatch(
            output.chunks, sampling, with_logits=with_logits, fed=fed, score_prompt=score_prompt
        )
        rows = {c.seq: k for k, c in enumerate(output.chunks) if c.samples} if self.async_scheduling else {}
        return _Step(output, handle, rows)

    def _read(self, step: _Step | None) -> Collected | None:
        """Wait for a dispatched step's draws (logits, prompt scores); None for no step."""
        return None if step is None else self.runner.collect(step.handle)

    def _update(self, step: _Step, read: Collected) -> ProcessedStep:
        """Hand a read-back step's tokens to the scheduler (lengths retire there) and the
        output processor (stops, text, logprobs, deltas); with asynchronous scheduling, only
        the sequences not retired since it was dispatched, and its write-through stores now."""
        sampled, logits, scores = read
        chunks = step.output.chunks
        if not self.async_scheduling:
            if scores is not None:  # before process: a first token's delta carries them
                self._outputs.add_prompt_logprobs(chunks, scores)
            if logits is not None:
                self._outputs.add_logits(chunks, logits)
            done = {seq.request_id for seq in self._scheduler.update(step.output, sampled.token_ids.tolist())}
            host = cast(SampledRows, sampled)  # the runner reads the draws back as numpy arrays
            return self._outputs.process(chunks, host, done, time.perf_counter())
        if self.connector is not None:  # the sequences holding their blocks, taken before resolve retires any
            held = [c for c in chunks if not c.seq.finished and self.manager.has_request(c.seq.request_id)]
        if scores is not None:
            scored = [i for i, c in enumerate(chunks) if not c.seq.finished]
            self._outputs.add_prompt_logprobs([chunks[i] for i in scored], [scores[i] for i in scored])
        keep = [i for i, c in enumerate(chunks) if c.samples and not c.seq.finished]
        done = {seq.request_id for seq in self._scheduler.resolve(step.output, sampled.token_ids.tolist())}
        if self.connector is not None:
            self.connector.after_step(held)  # the tokens are known now: the blocks have their hashes
        rows, kept = sampled, list(chunks)
        if len(keep) < len(chunks):  # some sequence drew nothing or was retired since the dispatch
            kept = [chunks[i] for i in keep]
            rows = SampledTokens(*(None if a is None else np.asarray(a)[keep] for a in sampled))  # type: ignore[arg-type]
            logits = None if logits is None else logits[keep]
        if logits is not None:
            self._outputs.add_logits(kept, logits)
        return self._outputs.process(kept, cast(SampledRows, rows), done, time.perf_counter())

    def _observe(self) -> None:
        """Hand the engine's stats to every step observer."""
        if self._step_observers:
            stats = self.stats()
            for observer in self._step_observers:
                observer(stats)

    @staticmethod
    def _row(chunk: ScheduledChunk, live: LiveSequence) -> RowSampling | None:
        """How this step draws the sequence's next token (None: the chunk draws nothing)."""
        if not chunk.samples:
            return None
        position = chunk.num_computed_tokens + chunk.num_new_tokens  # of the token drawn; the outputs before it:
        drawn = position - live.seq.request.num_prompt_tokens  # host-known, and the token fed when one is
        return RowSampling(live.params, live.seed, position, live.stopper.banned(drawn), live.seq.request)

    def abort(self, request_id: str) -> bool:
        """Drop one unfinished request (all its sequences, ``n`` > 1 siblings not yet
        queued included): its blocks and states freed (what it computed stays cached),
        its events published, an "abort" delta per sequence reported by the next step;
        False when no such request is unfinished. Host-tier pins last only within a
        step, so none is left to drop. Called during a step (from ``step_check``), it
        takes effect when the step ends and the request gets no output; a request of a
        ``generate`` call aborted from its ``progress`` callback is left out of the
        call's outputs."""
        self._owner.check()
        if not isinstance(request_id, str) or request_id not in self._outputs.requests:
            return False
        if self._aborting is not None:  # inside a step: its chunks and blocks are in use
            self._aborting.add(request_id)
            return True
        self._finish(self._outputs.abort(request_id))
        return True

    def set_inline_text(self, inline: bool) -> None:
        """Detokenize and check stop strings in :meth:`step` (True, the default with a
        tokenizer) or leave both to the caller (False: deltas and outputs carry token ids only,
        stop strings are the caller's to find, ending a sequence with :meth:`stop_sequence`;
        :class:`~jaxkv.serving.async_engine.AsyncEngine` does so on its event loop). Refused
        while requests are unfinished."""
        self._owner.check()
        if not isinstance(inline, bool):
            raise EngineError(f"inline must be a bool, got {inline!r}")
        if self._outputs.requests:
            raise EngineError(f"inline text can change only with no request unfinished; {self.num_running} run")
        self._outputs.set_inline_text(inline)

    def stop_sequence(self, request_id: str, index: int, num_output_tokens: int) -> RequestOutput | None:
        """End sequence ``index`` of ``request_id`` at a stop string the caller found after its
        first ``num_output_tokens`` tokens (those drawn past them are dropped and never
        reported): freed now, a "stop" delta reported by the next step; its output (cut there),
        or None when it is not running (finished or aborted since, or not admitted)."""
        self._owner.check()
        if not isinstance(request_id, str) or not is_int(index) or not is_int(num_output_tokens):
            raise EngineError(
                f"stop_sequence takes a request id, an index and a token count, got "
                f"{request_id!r:.80}, {index!r:.20}, {num_output_tokens!r:.20}"
            )
        if num_output_tokens < 1:
            raise EngineError(
                f"num_output_tokens must be >= 1 (a stop string ends after a token), got {num_output_tokens}"
            )
        if self._aborting is not None:
            raise EngineError("stop_sequence is called between steps, not from inside one")
        stopped = self._outputs.stop(request_id, index, num_output_tokens)
        if stopped is None:
            return None
        seq, output = stopped
        self._finish([seq])
        return output

    def _finish(self, seqs: list[SeqState]) -> None:
        """Free ``seqs`` between steps (through the scheduler, the one path that frees),
        settle the engine once no sequence is live, and publish the events."""
        self._scheduler.finish(seqs)
        if not self._outputs.live:
            self._release()
        self._publish_events()

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
            prefix_cache_misses_no_checkpoint=cache.num_missed_no_checkpoint,
            prefix_cache_misses_below_block=cache.num_missed_below_block,
            prefix_cache_misses_not_cached=cache.num_missed_not_cached,
            prefix_cache_misses_evicted=cache.num_missed_evicted,
            prefix_cache_misses_salt=cache.num_missed_salt,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the device prefix cache (published as ``AllBlocksCleared``); refused
        (False) while requests are unfinished."""
        self._owner.check()
        ok = not self._outputs.live and self.manager.reset_prefix_cache()
        self._publish_events()
        return ok

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(
            self.manager,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            admission=self.connector,
        )

    def _enqueue(self, request: Request, params: SamplingParams) -> SeqState:
        """Hand one sequence to the scheduler (the output processor's ``enqueue``)."""
        return self._scheduler.add_request(request, params.max_tokens or self.manager.max_model_len)

    def _abort(self) -> None:
        """Drop every unfinished request (freeing what it holds) and start a fresh scheduler."""
        try:
            self._scheduler.finish(self._outputs.clear())
            self._release()
        finally:
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

    def _release(self) -> None:
        """Drop the step in flight (its sequences are all gone), settle stores, and replace
        the cache if an interrupted step consumed it."""
        self._in_flight = None
        try:
            if self.connector is not None:
                self.connector.finish_stores()
        finally:
            if not self.runner.cache_is_intact():
                self.runner.reallocate_cache()
                if self.connector is not None:
                    self.connector.discard_reused()
                self.manager.reset_prefix_cache()


def freeze_heap() -> int:
    """Collect garbage once, then exempt every object alive from later collections
    (``gc.freeze``), as vLLM's engine core does after start-up; returns how many are frozen.

    Why: a full collection walks every object of the process (with a 128-sequence engine
    and its imports, about 120,000: 45-50 ms on a CPU core, a stall of many steps), frozen
    ones excepted. Call it once, after the engine's first steps, in a process that serves
    that engine for its life: an engine holds reference cycles, so one frozen and dropped
    later is never collected (its device cache included). Not automatic for that reason.
    ``gc.unfreeze()`` undoes it."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
