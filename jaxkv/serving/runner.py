"""Run scheduled chunks on the device: step metadata and sampling parameters in, next tokens out.

:class:`ModelRunner` runs any :class:`~jaxkv.models.protocol.ServedModel`: it owns the
model's params and the device :class:`~jaxkv.device.cache.KVCache` (with a
:class:`~jaxkv.device.state_cache.StateCache` beside it, as one
:class:`~jaxkv.device.state_cache.HybridCache`, when the model has recurrent layers; with
``shared_pages`` the states live in the KV pages and the HybridCache holds their layout,
:mod:`jaxkv.device.state_pages`).
Each step it builds the metadata of the scheduled chunks (:mod:`jaxkv.device.metadata`: one
host-to-device transfer, shapes padded to :class:`~jaxkv.device.metadata.Buckets`), or, for a
steady decode step (the last step's sequences, each one token further), advances the last
step's metadata, kept on the device, by a small delta of what changed
(:mod:`jaxkv.device.steady`), and calls one jitted step function ``(params, cache, metadata,
delta, sampling, previous) -> (sampled, metadata, drawn, cache)`` with the cache donated, so
its buffers are updated in place (the tokens come out once, as ``drawn``; ``sampled`` holds the
log-probabilities when asked). Tokens are drawn on the device
(:mod:`jaxkv.serving.sampler`: each request's parameters are rows of the step's inputs,
so no parameter set compiles anything; the rows are kept on the device across steps,
:class:`~jaxkv.serving.sampler.SamplingBatch`, re-sent only when a row's parameters change,
and the step sets each row's position from its metadata); only ``num_seqs`` tokens and their top
log-probabilities come back to the host (and their logits, from a step compiled apart,
when a token check asks for them).

A step may take input tokens the previous step drew without the host seeing them
(asynchronous scheduling): :meth:`ModelRunner.dispatch` returns as soon as the step is
queued on the device, with ``fed`` naming, for a decode chunk, the row of the previous
step whose token it decodes; the step reads it from the previous step's ``drawn`` tokens
(kept on the device), and :meth:`ModelRunner.collect` reads the step's draws back later.

The step is traced once per bucket combination (and :mod:`jaxkv.device.ops` implementation,
read at each step); :attr:`ModelRunner.num_compilations` counts the traces, so tests
can bound them.

Tensor parallel: given a ``mesh``, the runner splits the model over its model axis
(:mod:`jaxkv.device.mesh`): KV heads of the cache and the annotated weights sharded,
recurrent state, metadata and sampled tokens replicated. The step is then jitted with
these shardings as its explicit ``in_shardings`` / ``out_shardings`` (the same sharding
objects every step, so nothing recompiles); without a mesh it runs on the default device.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxkv.device import ops
from jaxkv.device.block_table import BlockTables
from jaxkv.device.cache import KVCache, allocate_kv_cache
from jaxkv.device.mesh import MODEL_AXIS, auto_axes, place, replicated, weight_shardings
from jaxkv.device.metadata import (
    Buckets,
    MetadataBuilder,
    StepMetadata,
    bucket,
    place_values,
)
from jaxkv.device.state_cache import HybridCache, StateCache, allocate_state_cache, num_state_rows
from jaxkv.device.state_pages import StatePages, StateUnits, check_mesh, state_pages
from jaxkv.device.steady import SteadyDecode, advance
from jaxkv.errors import JaxkvError
from jaxkv.ints import cdiv
from jaxkv.models.protocol import ServedModel
from jaxkv.offload.host_buffers import HostKVBuffers
from jaxkv.offload.transfer import Transfer, TransferEngine
from jaxkv.planner import KVCacheConfig, pad_head_size
from jaxkv.serving.prompt_logprobs import (
    PromptLogprobs,
    ScoredInputs,
    every_position,
    next_token_ids,
    score_positions,
    split_by_chunk,
)
from jaxkv.serving.sampler import (
    RowSampling,
    SampledTokens,
    SamplingBatch,
    SamplingInputs,
    at_positions,
    greedy_inputs,
    sample,
)
from jaxkv.serving.scheduler import ScheduledChunk
from jaxkv.specs import KVCacheSpec, MambaSpec

DevicePlace = int | tuple[int, ...]
"""Where the host tier finds a block on device: its id (a KV block or a state row), or for a
state kept in the KV pages (shared pages) all blocks of its unit."""


class RunnerError(JaxkvError, ValueError):
    """The runner cannot be set up for this model and KV cache config."""


def default_buckets(config: KVCacheConfig, max_num_seqs: int, max_num_batched_tokens: int) -> Buckets:
    """Two step shapes, so a serving run compiles at most twice.

    Tokens: a decode-only batch (``max_num_seqs``) or the whole step budget; one batch
    size; one table width (``max_model_len`` in the smallest blocks). Pass finer
    :class:`Buckets` to trade compilations for less padding (see ``Buckets.powers_of_two``).
    """
    if config.max_model_len is None:
        raise RunnerError("the KV cache config has max_model_len=None; block table widths are sized by it")
    tokens = sorted({min(max_num_seqs, max_num_batched_tokens), max_num_batched_tokens})
    return Buckets(tuple(tokens), (max_num_seqs,), (cdiv(config.max_model_len, config.hash_block_size),))


def _holds(planned: KVCacheSpec, spec: KVCacheSpec) -> bool:
    """Whether a group planned as ``planned`` holds a layer of ``spec``.

    Either the same spec, or ``spec`` with its head_size padded up to the group's
    (tile alignment; :mod:`jaxkv.device.ops` zero-pads q/k/v): rounding the layer's head up to
    a multiple of the group's gives exactly the group's head when it is no larger.
    """
    head = getattr(planned, "head_size", None)
    return planned == spec or (isinstance(head, int) and pad_head_size(spec, head) == planned)


def check_plan(model: ServedModel, config: KVCacheConfig) -> None:
    """:class:`RunnerError` unless every layer of ``model`` is in a group of ``config``
    planned for its spec (see :func:`_holds`) and the plan holds no layer the model lacks."""
    if not isinstance(model, ServedModel):
        raise RunnerError(
            f"{type(model).__name__} is not a ServedModel (name, vocab_size, params, layer_specs, "
            "partition_specs, forward)"
        )
    specs = model.layer_specs()
    planned = {name: g.spec for g in config.groups for name in g.layer_names}
    for name, spec in specs.items():
        if name not in planned:
            raise RunnerError(
                f"layer {name!r} of {model.name} is in no KV cache group of the plan; planned: {list(planned)}"
            )
        if not _holds(planned[name], spec):
            raise RunnerError(f"layer {name!r} needs {spec!r}, but its group is planned for {planned[name]!r}")
    extra = [name for name in planned if name not in specs]
    if extra:
        raise RunnerError(f"the plan holds layers {extra} that {model.name} does not have")


_num_step_traces = 0
"""Traces of the step functions in this process (one per compiled shape), all runners together."""


def _feed(meta: StepMetadata, previous: jax.Array) -> StepMetadata:
    """``meta`` with each input id ``-(k + 1)`` replaced by the token row ``k`` of the
    previous step drew (``previous``: that step's drawn tokens, kept on the device)."""
    start, _ = meta.packing.offsets["input_ids"]
    ids = meta.input_ids
    fed = jnp.where(ids < 0, previous[jnp.maximum(-ids - 1, 0)], ids)
    return dataclasses.replace(meta, packed=jax.lax.dynamic_update_slice(meta.packed, fed, (start,)))


def _step_with_logits(
    model: ServedModel,
    impl: str,
    params: Any,
    cache: KVCache | HybridCache,
    meta: StepMetadata,
    sampling: SamplingInputs,
    previous: jax.Array,
) -> tuple[SampledTokens, jax.Array, jax.Array, KVCache | HybridCache]:
    """One forward step over ``meta``'s tokens, some fed from ``previous`` (:func:`_feed`),
    and its draw (:func:`jaxkv.serving.sampler.sample`): ``(sampled, logits (S, vocab),
    drawn, cache)``, ``drawn`` the tokens padded to ``previous``'s length (the next step's
    ``previous``)."""
    global _num_step_traces
    _num_step_traces += 1  # runs once per trace, i.e. per compiled shape
    meta = _feed(meta, previous)
    logits, cache = model.forward(params, cache, meta, impl=impl)
    sampling = at_positions(sampling, meta.positions[meta.logits_indices] + 1)
    sampled = sample(logits, sampling, meta.input_ids[meta.logits_indices])
    drawn = jnp.pad(sampled.token_ids, (0, previous.shape[0] - sampled.token_ids.shape[0]))
    return sampled, logits, drawn, cache


def _step(
    model: ServedModel,
    impl: str,
    params: Any,
    cache: KVCache | HybridCache,
    meta: StepMetadata,
    sampling: SamplingInputs,
    previous: jax.Array,
) -> tuple[SampledTokens, jax.Array, KVCache | HybridCache]:
    """One forward step and its draw: ``(sampled, drawn, cache)``."""
    sampled, _, drawn, cache = _step_with_logits(model, impl, params, cache, meta, sampling, previous)
    return sampled, drawn, cache


def _step_with_prompt_logprobs(
    model: ServedModel,
    impl: str,
    params: Any,
    cache: KVCache | HybridCache,
    meta: StepMetadata,
    sampling: ScoredInputs,
    previous: jax.Array,
) -> tuple[SampledTokens, jax.Array | None, PromptLogprobs, jax.Array, KVCache | HybridCache]:
    """One forward step with logits at every new token (:mod:`jaxkv.serving.prompt_logprobs`):
    ``(sampled, the drawn rows' logits (S, vocab) when ``sampling.with_logits`` else None,
    each new token's successor scored, drawn, cache)``."""
    global _num_step_traces
    _num_step_traces += 1
    meta = _feed(meta, previous)
    logits, cache = model.forward(params, cache, every_position(meta), impl=impl)
    last = meta.logits_indices
    sampled = sample(logits[last], at_positions(sampling, meta.positions[last] + 1), meta.input_ids[last])
    scored = score_positions(logits, meta, jnp.asarray(sampling.next_ids))
    drawn = jnp.pad(sampled.token_ids, (0, previous.shape[0] - sampled.token_ids.shape[0]))
    return sampled, logits[last] if sampling.with_logits else None, scored, drawn, cache


StepShardings = tuple[tuple[jax.sharding.Sharding, ...], object] | None
"""The flattened ``(in_shardings, out_shardings)`` of a step, ``(leaves, treedef)``
(hashable, a cache key), or None: no mesh, the default device."""


@functools.cache
def jitted_step(
    fn: Callable, model: ServedModel, impl: str, block_sizes: tuple[int, ...], shardings: StepShardings
) -> jax.stages.Wrapped:
    """``fn`` (:func:`_step` or :func:`_step_with_logits`) with its static arguments
    bound, jitted with the cache donated: ``(params, cache, meta, delta, sampling, previous) ->
    (*outputs, packed, drawn, cache)``. ``meta`` is first advanced by ``delta``
    (:func:`jaxkv.device.steady.advance`, ``block_sizes`` the groups'), and ``packed`` is the
    advanced metadata, kept on the device for the next step's delta. The drawn tokens come out
    once, as ``drawn`` (padded; the first output's ``token_ids`` is None): one output buffer less.

    Keyed by the model object (by its ``__hash__``/``__eq__``: identity unless the model
    defines them) and shared by all runners: the same model, ops implementation, bucket
    shapes and shardings compile once per process. The cache holds the model for the
    process's life. The static arguments are bound here rather than passed at each
    call, where JAX would hash them every step. The step with logits is a separate
    compilation, used only when logits are asked for (token checks, not serving).
    """

    def step(
        params: Any,
        cache: KVCache | HybridCache,
        meta: StepMetadata,
        delta: jax.Array,
        sampling: SamplingInputs,
        previous: jax.Array,
    ) -> tuple:
        meta = advance(meta, delta, block_sizes)
        sampled, *outputs, drawn, cache = fn(model, impl, params, cache, meta, sampling, previous)
        return (sampled._replace(token_ids=None), *outputs, meta.packed, drawn, cache)

    if shardings is None:
        return jax.jit(step, donate_argnums=(1,))
    leaves, treedef = shardings
    in_shardings, out_shardings = jax.tree.unflatten(treedef, leaves)
    return jax.jit(step, donate_argnums=(1,), in_shardings=in_shardings, out_shardings=out_shardings)


def _flat(shardings: object) -> StepShardings:
    """``(in_shardings, out_shardings)`` as a hashable ``(leaves, treedef)``."""
    leaves, treedef = jax.tree.flatten(shardings)
    return tuple(leaves), treedef


def allocate_cache(
    config: KVCacheConfig, mesh: Mesh | None = None, model_axis: str = MODEL_AXIS
) -> KVCache | HybridCache:
    """The device cache a model planned by ``config`` reads: its KV pages (KV heads split
    over ``model_axis`` of ``mesh``), plus state rows (replicated) when the plan has
    recurrent groups, or, with ``shared_pages``, the layout of the states kept in the KV
    pages (refused on a mesh splitting them: :func:`jaxkv.device.state_pages.check_mesh`).

    Without a mesh the cache is committed to the default device, as the host tier's
    loads leave it (their staged blocks are placed on it): the step and the transfers
    then see one placement and compile once, not again after the first load."""
    check_mesh(config, mesh, model_axis)
    kv = allocate_kv_cache(config, mesh=mesh, kv_axis=model_axis)
    cache: KVCache | HybridCache = kv
    if config.shared_states is not None:
        cache = HybridCache(kv, state_pages(config, kv))
    elif any(isinstance(g.spec, MambaSpec) for g in config.groups):
        cache = HybridCache(kv, allocate_state_cache(config, mesh=mesh))
    return cache if mesh is not None else jax.device_put(cache, jax.devices()[0], donate=True)


def _local(x: jax.Array) -> np.ndarray:
    """A replicated output as numpy: the array itself when this process holds all of it (no
    shard object made), else this process's first copy."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


class InFlight(NamedTuple):
    """A dispatched step: its outputs on the device (the draws; the logits and the prompt
    scores when asked) and its chunks (the real rows of those outputs)."""

    outputs: list[Any]
    chunks: Sequence[ScheduledChunk]


class Collected(NamedTuple):
    """A step read back: its draws as numpy rows of its chunks, the logits they were drawn
    from (when asked), and per chunk the scores of its new tokens (a scoring step)."""

    sampled: SampledTokens
    logits: np.ndarray | None
    prompt_scores: list[PromptLogprobs] | None


class ModelRunner:
    """A model, its paged KV cache (in ``config.pages.layout``), and the one jitted step.

    ``mesh`` splits the model over its ``model_axis`` (tensor parallel; see the module
    docstring); the model's ``num_kv_heads`` must be a multiple of the axis size
    (:class:`~jaxkv.device.cache.KVCacheShardingError` otherwise). ``num_compilations`` counts
    the step shapes this runner had to compile (shapes another runner of the same
    architecture and shardings compiled before are reused). A ``shared_pages`` plan needs
    ``unit_blocks``, the owner's map from a state's head block to all its blocks
    (:meth:`jaxkv.core.manager.KVCacheManager.state_blocks`), to read states from the pages.
    """

    def __init__(
        self,
        model: ServedModel,
        config: KVCacheConfig,
        buckets: Buckets,
        *,
        mesh: Mesh | None = None,
        model_axis: str = MODEL_AXIS,
        unit_blocks: Callable[[int], Sequence[int]] | None = None,
    ) -> None:
        check_plan(model, config)
        if (config.shared_states is not None) != (unit_blocks is not None):
            raise RunnerError(
                "unit_blocks (the blocks of a state's unit) is needed exactly when states live in the KV pages "
                f"(state_layout='shared_pages'); shared_states={config.shared_states!r}, unit_blocks={unit_blocks!r}"
            )
        self.unit_blocks = unit_blocks
        self.model = model
        self.config = config
        self.buckets = buckets
        self.mesh = None if mesh is None else auto_axes(mesh, model_axis)
        self.model_axis = model_axis
        self.block_sizes = tuple(g.block_size for g in config.groups)
        self.state_groups = tuple(i for i, g in enumerate(config.groups) if isinstance(g.spec, MambaSpec))
        self.group_layers = tuple(g.layer_names for g in config.groups)
        self._num_states = num_state_rows(config) if self.state_groups else None
        self.cache: KVCache | HybridCache = allocate_cache(config, self.mesh, model_axis)
        self.params = model.params
        self._meta_sharding = None if self.mesh is None else replicated(self.mesh)
        shared = config.shared_states
        drawn_at = self._meta_sharding if self.mesh is not None else jax.devices()[0]
        self._builder = MetadataBuilder(
            self.block_sizes,
            buckets,
            num_blocks=config.num_blocks,
            state_groups=self.state_groups,
            num_states=self._num_states,
            group_layers=self.group_layers,
            unit_blocks=unit_blocks,
            pages_per_state=0 if shared is None else shared.pages_per_state,
            device=drawn_at,
        )
        """The step metadata's builder, its constant arguments checked once (the metadata placed
        where a step's kept metadata is, so a built step and an advanced one compile once)."""
        self._steady = SteadyDecode(
            self._builder, capacity=2 * max(buckets.seqs) + 8, place=functools.partial(place_values, device=drawn_at)
        )
        """The last step's metadata kept on the device, and a steady decode step's delta from it
        (the deltas without pairs placed once: a steady step's call then sends nothing)."""
        self._tables = BlockTables(self._builder.limits, rows=max(buckets.seqs), width=max(buckets.blocks))
        plain = with_logits = scored = None
        if self.mesh is not None:
            params = weight_shardings(model.partition_specs(), self.mesh, model_axis)
            self.params = place(self.params, params)
            cache = jax.tree.map(lambda buf: buf.sharding, self.cache)
            rep = self._meta_sharding
            ins = (params, cache, rep, rep, rep, rep)
            plain = _flat((ins, (rep, rep, rep, cache)))
            with_logits = _flat((ins, (rep, rep, rep, rep, cache)))
            scored = _flat((ins, (rep, rep, rep, rep, rep, cache)))
        self._shardings = {_step: plain, _step_with_logits: with_logits, _step_with_prompt_logprobs: scored}
        self._steps: dict[tuple[Callable, str], jax.stages.Wrapped] = {}
        self._drawn = place_values(np.zeros(max(buckets.seqs), np.int32), drawn_at)
        """The last step's drawn tokens on the device, padded: what a fed input token reads
        (committed where the cache is, as every step's output is: the first step compiles once)."""
        self._sampling = SamplingBatch(functools.partial(place_values, device=drawn_at))
        """The sampling inputs kept across steps (re-sent only when the rows' parameters change)."""
        self.num_compilations = 0
        self.dispatch_s = 0.0
        """Seconds spent in JAX's call of the jitted step (argument checks, dispatch to every
        device of the mesh), built metadata in hand: JAX's host time, not jaxkv's."""
        self.dispatch_cpu_s = 0.0
        """The same calls' thread CPU seconds: JAX's dispatch, and on the CPU backend whatever
        of the computation it runs on the calling thread (on an accelerator, the device's)."""
        self.device_wait_s = 0.0
        """Seconds the host spent waiting for steps' outputs (the rest of a step is host work)."""

    def metadata(self, chunks: Sequence[ScheduledChunk], fed: Mapping[int, int] | None = None) -> StepMetadata:
        """The device metadata of one step's chunks (decodes first, as the scheduler orders them).

        Block ids go through the runner's block tables, kept across steps: only the ids a
        request gained (or that changed) since its last step are converted and checked.
        ``fed`` maps a decode chunk's index to the row of the previous step whose drawn token
        it decodes (its request does not hold it yet): its input id is ``-(row + 1)``."""
        return self._builder.build(chunks, self._token_ids(chunks, fed), [c.block_ids for c in chunks], self._tables)

    def _token_ids(self, chunks: Sequence[ScheduledChunk], fed: Mapping[int, int] | None) -> list[list[int]]:
        """Each chunk's new tokens; a fed decode's is its row's placeholder (see :meth:`metadata`)."""
        fed = fed or {}
        num_drawn = self._drawn.shape[0]
        for i, row in fed.items():
            chunk = chunks[i]
            if chunk.num_new_tokens != 1 or chunk.num_computed_tokens != chunk.seq.request.num_tokens:
                raise RunnerError(
                    f"chunk {i} (request {chunk.seq.request_id!r}) is fed the token the previous step drew, "
                    "but it is not a decode of its request's next unknown token"
                )
            if not 0 <= row < num_drawn:
                raise RunnerError(f"chunk {i} is fed row {row} of the previous step, which has {num_drawn}")
        # a fed decode's id is its row's placeholder: its request's tokens are not sliced for it
        return [c.token_ids if i not in fed else [-1 - fed[i]] for i, c in enumerate(chunks)]

    def release(self, request_id: str) -> bool:
        """Forget a finished or preempted sequence's block table row (False if it had none).

        Optional: the tables stay exact without it (a row whose request is gone is reclaimed
        when rows run out), but a loop that frees a sequence's blocks may call it there."""
        self._steady.forget()
        return self._tables.release(request_id)

    def execute(self, chunks: Sequence[ScheduledChunk]) -> np.ndarray:
        """Run one step; the greedy next token after each chunk's last token, ``(len(chunks),)``."""
        sampled, _ = self.execute_sampled(chunks)
        return np.asarray(sampled.token_ids)

    def execute_sampled(
        self, chunks: Sequence[ScheduledChunk], rows: Sequence[RowSampling | None] = (), *, with_logits: bool = False
    ) -> tuple[SampledTokens, np.ndarray | None]:
        """Run one step, drawing each chunk's next token as ``rows`` say (one per chunk;
        none: greedy): what was drawn, and with ``with_logits`` the float32 logits each
        token was drawn from, ``(len(chunks), vocab)`` (a step compiled apart)."""
        sampled, logits, _ = self.collect(self.dispatch(chunks, rows, with_logits=with_logits))
        return sampled, logits

    def dispatch(
        self,
        chunks: Sequence[ScheduledChunk],
        rows: Sequence[RowSampling | None] = (),
        *,
        with_logits: bool = False,
        fed: Mapping[int, int] | None = None,
        score_prompt: bool = False,
    ) -> InFlight:
        """Queue one step on the device (as :meth:`execute_sampled`; ``fed`` as in
        :meth:`metadata`; ``score_prompt``: the step compiled apart that also scores the
        token after each new token, :mod:`jaxkv.serving.prompt_logprobs`) and return without
        waiting for it: :meth:`collect` reads it back."""
        num_rows = bucket(len(chunks), self.buckets.seqs, "seqs")
        inputs = self._sampling.inputs(rows, num_rows)
        if score_prompt:
            scored = ScoredInputs(
                inputs.packed,
                inputs.penalties,
                inputs.logprobs,
                next_ids=next_token_ids(chunks, num_rows),
                with_logits=with_logits,
            )
            return self._run(_step_with_prompt_logprobs, chunks, scored, fed)
        return self._run(_step_with_logits if with_logits else _step, chunks, inputs, fed)

    def collect(self, step: InFlight) -> Collected:
        """Wait for a dispatched step and read it back (:class:`Collected`). Outputs are
        replicated: each is read from this process's first copy, which is all a process holds
        of an array whose devices span processes."""
        sampled, *rest = step.outputs
        start = time.perf_counter()
        sampled.token_ids.block_until_ready()  # one call's outputs: all ready once one is
        self.device_wait_s += time.perf_counter() - start
        num_rows = len(step.chunks)
        read = np.asarray if self.mesh is None else _local  # without a mesh every output is whole here

        def rows(x: jax.Array) -> np.ndarray:
            return read(x)[:num_rows]

        drawn = SampledTokens(rows(sampled.token_ids), *(None if x is None else rows(x) for x in sampled[1:]))
        host = [jax.tree.map(rows, o) for o in rest]
        scores = split_by_chunk(host[1], step.chunks) if len(host) > 1 else None
        return Collected(drawn, host[0] if host else None, scores)

    def _jitted(self, fn: Callable) -> jax.stages.Wrapped:
        """``fn`` jitted for this runner's model and the :mod:`jaxkv.device.ops` implementation
        setting (looked up by its name, read at each step; ``auto`` is resolved by the ops
        per call, so a shape the chosen kernel does not take falls back rather than fails)."""
        impl = ops.implementation_setting()
        key = (fn, impl)
        if key not in self._steps:
            self._steps[key] = jitted_step(fn, self.model, impl, self.block_sizes, self._shardings[fn])
        return self._steps[key]

    def _run(
        self, fn: Callable, chunks: Sequence[ScheduledChunk], sampling: SamplingInputs, fed: Mapping[int, int] | None
    ) -> InFlight:
        """Call the jitted ``fn`` on these chunks (the cache donated), without waiting for it: a
        steady decode step advances the last step's metadata on the device
        (:mod:`jaxkv.device.steady`), any other is built in full."""
        token_ids = self._token_ids(chunks, fed)
        block_ids = [c.block_ids for c in chunks]
        plan = self._steady.plan(chunks, token_ids, block_ids, self._tables)
        if plan is None:
            meta = self._builder.build(chunks, token_ids, block_ids, self._tables)
            delta, record = self._steady.idle, self._steady.start(chunks, token_ids, meta)
        else:
            meta, delta, record = plan
        step = self._jitted(fn)
        before = _num_step_traces
        start, cpu = time.perf_counter(), time.thread_time()
        sent = (
            delta
            if self.mesh is None or not isinstance(delta, np.ndarray)
            else place_values(delta, self._meta_sharding)
        )
        sampled, *outputs, packed, self._drawn, self.cache = step(
            self.params, self.cache, meta, sent, sampling, self._drawn
        )
        self.dispatch_cpu_s += time.thread_time() - cpu
        self.dispatch_s += time.perf_counter() - start
        self.num_compilations += _num_step_traces - before
        self._steady.keep(record, packed)
        return InFlight([sampled._replace(token_ids=self._drawn), *outputs], chunks)

    def cache_is_intact(self) -> bool:
        """False when a step was interrupted after donating the cache (its buffers are gone)."""
        return not any(buf.is_deleted() for buf in jax.tree.leaves(self.cache))

    def reallocate_cache(self) -> None:
        """A fresh, zeroed cache after :meth:`cache_is_intact` turned False; every block's
        KV (and state) is lost, so the caller must also drop the prefix cache."""
        self.cache = allocate_cache(self.config, self.mesh, self.model_axis)

    # ------------------------------------------------------------ host tier
    @property
    def kv_cache(self) -> KVCache:
        """The attention KV pages (what the host tier moves)."""
        return self.cache.kv if isinstance(self.cache, HybridCache) else self.cache

    def host_buffers(self, host_bytes: int, *, memory_kind: str | None = None) -> HostKVBuffers:
        """A set of host buffers of whole blocks of this runner's KV cache, as many as fit in ``host_bytes``."""
        return HostKVBuffers.for_cache(self.kv_cache, host_bytes, memory_kind=memory_kind)

    def store_blocks(self, transfers: TransferEngine, block_ids: Sequence[int], host_blocks: Sequence[int]) -> Transfer:
        """Issue a copy of device blocks into host blocks (the cache is only read)."""
        return transfers.store(self.kv_cache, block_ids, host_blocks)

    def load_blocks(self, transfers: TransferEngine, block_ids: Sequence[int], host_blocks: Sequence[int]) -> Transfer:
        """Issue a copy of host blocks into device blocks of the (donated) KV cache."""
        kv, transfer = transfers.load(self.kv_cache, block_ids, host_blocks)
        assert isinstance(kv, KVCache)  # load returns the kind of cache it is given
        self.cache = dataclasses.replace(self.cache, kv=kv) if isinstance(self.cache, HybridCache) else kv
        return transfer

    @property
    def hybrid_cache(self) -> HybridCache:
        """The KV pages and recurrent states of a model with recurrent layers;
        :class:`RunnerError` for a model without (it has no state)."""
        if not isinstance(self.cache, HybridCache):
            raise RunnerError(f"model {self.model.name} has no recurrent layers: its cache holds no state")
        return self.cache

    @property
    def state_rows(self) -> StateCache | StateUnits:
        """The recurrent states as the host tier moves them: the state rows, or with shared
        pages the KV pages seen as whole states (one row: a unit's blocks)."""
        cache = self.hybrid_cache
        return StateUnits(cache.kv, cache.states) if isinstance(cache.states, StatePages) else cache.states

    def state_nbytes(self) -> int:
        """Device bytes of recurrent states (what the host tier splits its bytes by): the state
        rows', or with shared pages, where the split is decided at run time, the pool's bytes
        times the share of states in a max_model_len request's blocks."""
        cache = self.hybrid_cache
        if isinstance(cache.states, StateCache):
            return cache.states.nbytes
        per_request = self.config.blocks_per_request()
        states = sum(per_request[g] for g in self.state_groups)
        return cache.kv.nbytes * states // sum(per_request)

    def state_host_buffers(self, host_bytes: int, *, memory_kind: str | None = None) -> HostKVBuffers:
        """A set of host buffers of whole states of this runner's recurrent layers (one per host block)."""
        return HostKVBuffers.for_cache(self.state_rows, host_bytes, memory_kind=memory_kind)

    def state_places(self, state_ids: Sequence[int]) -> list[DevicePlace]:
        """Where the host tier finds states the manager names by ``state_ids`` (a recurrent
        group's block ids): the ids themselves for state rows, each unit's blocks with shared
        pages (read them while the units stand: a reused unit dissolves)."""
        if self.unit_blocks is None:
            return list(state_ids)
        return [tuple(self.unit_blocks(i)) for i in state_ids]

    def store_states(
        self, transfers: TransferEngine, places: Sequence[DevicePlace], host_blocks: Sequence[int]
    ) -> Transfer:
        """Issue a copy of states (at :meth:`state_places`) into host blocks (the states are only read)."""
        return transfers.store(self.state_rows, places, host_blocks)

    def load_states(
        self, transfers: TransferEngine, places: Sequence[DevicePlace], host_blocks: Sequence[int]
    ) -> Transfer:
        """Issue a copy of host blocks into states (at :meth:`state_places`; the cache is donated)."""
        cache = self.hybrid_cache
        states, transfer = transfers.load(self.state_rows, places, host_blocks)
        if isinstance(states, StateUnits):
            self.cache = dataclasses.replace(cache, kv=states.kv)
        else:
            assert isinstance(states, StateCache)  # load returns the kind of cache it is given
            self.cache = dataclasses.replace(cache, states=states)
        return transfer

    def lower(self, chunks: Sequence[ScheduledChunk]) -> jax.stages.Lowered:
        """The step lowered for these chunks' shapes (``.compile().memory_analysis()``)."""
        meta = self.metadata(chunks)
        sampling = greedy_inputs(bucket(len(chunks), self.buckets.seqs, "seqs"))
        return self._jitted(_step).lower(self.params, self.cache, meta, self.idle_delta, sampling, self._drawn)

    @property
    def idle_delta(self) -> np.ndarray | jax.Array:
        """The delta a step built in full is called with (its metadata as it is): what a caller
        of :meth:`lower`'s compiled step passes after the metadata."""
        return self._steady.idle
