"""jaxkv inside tpu-inference (vLLM's TPU backend): its metadata and page layout from jaxkv's.

tpu-inference's attention (``ragged_paged_attention`` v3 and its reference) and its
recurrent ops read one ``AttentionMetadata`` per KV cache group and one page buffer per
layer. This module maps jaxkv's step metadata (:class:`~jaxkv.device.metadata.StepMetadata`)
and cache (:class:`~jaxkv.device.cache.KVCache`) onto them, so an engine keeps jaxkv's
manager and cache and calls tpu-inference's kernels:

- :func:`attention_metadata` / :func:`grouped_attention_metadata`: block tables flattened,
  ``seq_lens`` = jaxkv's ``kv_lens``, ``query_start_loc`` = ``cu_q_lens``,
  ``request_distribution`` = ``[decodes, decodes, seqs]`` (jaxkv orders decodes first; no
  prefill-only part), ``mamba_state_indices`` = the recurrent group's write rows. Their
  recurrent op reads and writes that one row, so a step whose state starts in another row
  (a checkpoint hit, a state that moves to a new checkpoint block) first copies it over:
  :func:`carry_states`.
- :func:`layer_pages` / :func:`with_layer_pages`: jaxkv's per-layer page ``(N, bs, 2H, D)``
  already interleaves K and V per head as tpu-inference's does; their
  ``(N, bs, 2H/p, p, D)`` (``p`` rows per 32 bits: 1 for float32, 2 for bfloat16, 4 for
  8-bit) is a reshape of it, a bitcast, no copy, when ``D`` is a multiple of 128 and ``2H``
  of ``p``. Otherwise (and for every ``cross_layer`` cache, whose layer pages are strided)
  the page is copied out and written back: :func:`pages_copy_reason` says why.

Their kernel writes the step's new K/V into the pages itself, so jaxkv's slot mapping is
not used on this path (their TPU kernel also takes ``update_kv_cache=False``: then
:func:`jaxkv.device.ops.write_kv` writes by the slot mapping and their kernel only reads).
tpu-inference is imported only by :func:`load_tpu_inference`, inside
:func:`tpu_inference_environment`, which supplies what its import needs off a TPU VM (the
``TPU_*`` variables and, when vLLM is absent, a stand-in for ``vllm.logger``). What was
checked on CPU and what needs a TPU: BUILD.md, "jaxkv inside tpu-inference".
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.device.cache import KVCache
from jaxkv.device.metadata import StateMetadata, StepMetadata
from jaxkv.device.state_cache import StateCache
from jaxkv.errors import JaxkvError
from jaxkv.ints import cdiv
from jaxkv.specs import FullAttentionSpec, SlidingWindowSpec

INSTALL = "pip install --no-deps tpu-inference==0.32.0"
"""How to install tpu-inference beside jaxkv: its declared dependencies pin jax 0.11.2,
libtpu and torchvision, none of which its attention entry points need."""

TPU_ENVIRONMENT = {"TPU_ACCELERATOR_TYPE": "cpu", "TPU_NAME": "cpu", "TPU_WORKER_ID": "0"}
"""What tpu-inference's import reads to describe the TPU VM; unset, it asks the GCE
metadata server (a network call that hangs off Google Cloud)."""

LANES = 128
"""tpu-inference pads the head dim of its pages to a multiple of this."""


class TpuInferenceUnavailableError(JaxkvError, ImportError):
    """tpu-inference (or what its import needs) is not installed."""


class TpuInferenceMappingError(JaxkvError, ValueError):
    """A layer, group or cache that tpu-inference's metadata or kernels cannot take."""


def _stand_in_vllm() -> dict[str, types.ModuleType]:
    """``vllm`` and ``vllm.logger`` with the two names tpu-inference's logger imports."""
    root = types.ModuleType("vllm", "jaxkv's stand-in for vLLM while tpu-inference is imported")
    root.__path__ = []
    logger = types.ModuleType("vllm.logger")
    logger.__dict__.update(_VllmLogger=logging.Logger, init_logger=logging.getLogger)
    root.__dict__["logger"] = logger
    return {"vllm": root, "vllm.logger": logger}


@contextmanager
def tpu_inference_environment() -> Iterator[None]:
    """Import tpu-inference modules inside this on a machine that is not a TPU VM.

    Sets the ``TPU_*`` variables that are unset (:data:`TPU_ENVIRONMENT`) and, when no
    ``vllm`` can be imported, puts a stand-in ``vllm`` / ``vllm.logger`` in ``sys.modules``;
    on exit both are undone (a stand-in module is removed only if it is still the one put
    there), so a later real vLLM import is unaffected. What tpu-inference's own import
    sets (``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``, two ``VLLM_*`` variables) stays, as it would
    without jaxkv.
    """
    added_env = [name for name in TPU_ENVIRONMENT if name not in os.environ]
    os.environ.update({name: TPU_ENVIRONMENT[name] for name in added_env})
    stand_in = {} if "vllm" in sys.modules or importlib.util.find_spec("vllm") else _stand_in_vllm()
    sys.modules.update(stand_in)
    try:
        yield
    finally:
        for name in added_env:
            os.environ.pop(name, None)
        for name, module in stand_in.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]


@dataclass(frozen=True)
class TpuInference:
    """tpu-inference's entry points this module maps jaxkv onto (see :func:`load_tpu_inference`)."""

    AttentionMetadata: type
    GroupedAttentionMetadata: type
    ragged_paged_attention: Callable[..., Any]
    """Their v3 Pallas kernel: needs a TPU."""
    ref_ragged_paged_attention: Callable[..., Any]
    """Its plain-jnp reference: runs anywhere (eagerly: it loops over the sequences in Python)."""
    ragged_gated_delta_rule: Callable[..., Any]
    """Their Gated DeltaNet reference over ``state_indices``: runs anywhere."""


@functools.cache
def load_tpu_inference() -> TpuInference:
    """Import tpu-inference (inside :func:`tpu_inference_environment`); raise
    :class:`TpuInferenceUnavailableError` with the install line when it is missing."""
    try:
        with tpu_inference_environment():
            gdn = importlib.import_module("tpu_inference.kernels.gdn.reference.ragged_gated_delta_rule_ref")
            rpa = importlib.import_module("tpu_inference.kernels.ragged_paged_attention.v3.kernel")
            md = importlib.import_module("tpu_inference.layers.common.attention_metadata")
    except ImportError as error:
        raise TpuInferenceUnavailableError(
            f"tpu-inference cannot be imported ({error}); install it with `{INSTALL}` "
            "(and `pip install requests`, which its import uses)"
        ) from error
    return TpuInference(
        AttentionMetadata=md.AttentionMetadata,
        GroupedAttentionMetadata=md.GroupedAttentionMetadata,
        ragged_paged_attention=rpa.ragged_paged_attention,
        ref_ragged_paged_attention=rpa.ref_ragged_paged_attention,
        ragged_gated_delta_rule=gdn.ragged_gated_delta_rule,
    )


# ---------------------------------------------------------------- step metadata


def request_distribution(md: StepMetadata) -> jax.Array:
    """``(3,)`` int32 ``[decodes, decodes, seqs]``: tpu-inference's decode / prefill /
    mixed split. jaxkv puts every one-token sequence first (decodes, or a one-token chunk:
    their decode case takes any query of one token) and the rest is their mixed case."""
    q_lens = md.cu_q_lens[1:] - md.cu_q_lens[:-1]
    real = jnp.arange(q_lens.shape[0]) < md.num_seqs[0]
    decodes = jnp.sum((q_lens == 1) & real, dtype=jnp.int32)
    return jnp.stack([decodes, decodes, md.num_seqs[0]]).astype(jnp.int32)


def _state_indices(md: StepMetadata) -> jax.Array | None:
    """The write rows of the step's one recurrent group (None without one): the
    ``mamba_state_indices`` tpu-inference's runner sets on every group."""
    states = [g for g in md.groups if isinstance(g, StateMetadata)]
    if len(states) > 1:
        raise TpuInferenceMappingError(
            f"{len(states)} recurrent groups: tpu-inference's AttentionMetadata holds one mamba_state_indices; "
            "map each recurrent layer with attention_metadata(md, layer)"
        )
    return states[0].write_rows if states else None


def _their_metadata(tpu: TpuInference, md: StepMetadata, group: int, state_indices: jax.Array | None) -> Any:
    meta = md.groups[group]
    if isinstance(meta, StateMetadata):
        tables, state_indices = None, meta.write_rows
    else:
        tables = meta.block_tables.reshape(-1)
    return tpu.AttentionMetadata(
        input_positions=md.positions,
        block_tables=tables,
        seq_lens=md.kv_lens,
        query_start_loc=md.cu_q_lens,
        request_distribution=request_distribution(md),
        mamba_state_indices=state_indices,
        padded_num_reqs=md.kv_lens.shape[0],
    )


def _group_index(md: StepMetadata, layer: str) -> int:
    """The index of ``layer``'s group; :class:`~jaxkv.device.cache.UnknownLayerError` (from
    :meth:`~jaxkv.device.metadata.StepMetadata.group_of`) for a layer in none."""
    md.group_of(layer)
    return next(g for g, names in enumerate(md.group_layers) if layer in names)


def attention_metadata(md: StepMetadata, layer: str) -> Any:
    """tpu-inference's ``AttentionMetadata`` for ``layer``'s KV cache group in step ``md``.

    An attention layer gets its group's block table flattened (``(S * W,)``) and, in a
    hybrid, the recurrent group's write rows as ``mamba_state_indices``; a recurrent layer
    gets no block table and its own group's write rows (see :func:`carry_states`). ``md``
    needs ``group_layers`` (:func:`~jaxkv.device.metadata.build_step_metadata`'s); an
    unknown layer is :class:`~jaxkv.device.cache.UnknownLayerError`.
    """
    tpu = load_tpu_inference()
    group = _group_index(md, layer)
    shared = None if isinstance(md.groups[group], StateMetadata) else _state_indices(md)
    return _their_metadata(tpu, md, group, shared)


def grouped_attention_metadata(md: StepMetadata) -> Any:
    """tpu-inference's ``GroupedAttentionMetadata`` (``{layer: AttentionMetadata}``, one
    object per group) of every layer of step ``md``, as their runner builds for a model of
    several KV cache groups."""
    tpu = load_tpu_inference()
    shared = _state_indices(md)
    groups = tuple(_their_metadata(tpu, md, g, shared) for g in range(len(md.group_layers)))
    return tpu.GroupedAttentionMetadata(groups, md.group_layers)


def carry_states(states: StateCache, md: StepMetadata, layer: str) -> StateCache:
    """``states`` with the state each sequence of ``layer``'s recurrent group starts from
    copied into the row it writes, for every layer of that group.

    jaxkv reads a step's state from ``read_rows`` and writes ``write_rows``; tpu-inference's
    recurrent op reads and writes one row, ``mamba_state_indices`` (the write rows). Rows
    already equal (a state updated in place) and fresh sequences (their op zeroes the
    state of a sequence with nothing computed) copy nothing; the copies of a step are
    distinct rows. Call it before the step's recurrent layers run.
    """
    meta = md.states_of(layer)
    move = (meta.read_rows != meta.write_rows) & (meta.fresh == 0)
    src = jnp.where(move, meta.read_rows, 0)
    dst = jnp.where(move, meta.write_rows, 0)
    for name in md.group_layers[_group_index(md, layer)]:
        states = states.with_layer_states(name, [b.at[dst].set(b[src]) for b in states.layer_states(name)])
    return states


# ---------------------------------------------------------------- pages


def kv_packing(dtype: Any) -> int:
    """Rows of a dtype per 32-bit word: tpu-inference's ``p`` (1, 2 or 4)."""
    return 32 // jnp.dtype(dtype).itemsize // 8


def pages_shape(cache: KVCache) -> tuple[int, ...]:
    """tpu-inference's ``(N, bs, 2H/p, p, D)`` for ``cache``'s pages: ``2H`` rounded up to
    ``p``, ``D`` to 128, as their ``get_kv_cache_shape`` gives."""
    p = kv_packing(cache.dtype)
    rows = cdiv(2 * cache.num_kv_heads, p) * p
    return (cache.num_blocks, cache.block_size, rows // p, p, cdiv(cache.head_dim, LANES) * LANES)


def pages_copy_reason(cache: KVCache) -> str | None:
    """Why :func:`layer_pages` must copy ``cache``'s pages (None: it reshapes them in place)."""
    if cache.layout != "per_layer":
        return f"layout {cache.layout!r}: a layer's pages are strided in the shared buffer"
    _, _, rows, p, head_dim = pages_shape(cache)
    if head_dim != cache.head_dim:
        return f"head_dim {cache.head_dim} is padded to {head_dim} (plan with PlanOptions(head_dim_multiple=128))"
    if rows * p != 2 * cache.num_kv_heads:
        return f"2 * num_kv_heads = {2 * cache.num_kv_heads} is padded to a multiple of {p} for {cache.dtype}"
    return None


def layer_pages(cache: KVCache, layer: str) -> jax.Array:
    """``layer``'s pages in tpu-inference's layout ``(N, bs, 2H/p, p, D)`` (:func:`pages_shape`).

    A reshape of the layer's buffer (a bitcast under jit: donated, the output is the same
    memory) when :func:`pages_copy_reason` is None; otherwise a copy, zero-padded. An
    unknown layer is :class:`~jaxkv.device.cache.UnknownLayerError`.
    """
    buffer, index = cache.layer_buffer(layer)
    page = buffer if index is None else buffer[:, index]
    shape = pages_shape(cache)
    rows, head_dim = shape[2] * shape[3], shape[4]
    pads = [(0, 0), (0, 0), (0, rows - page.shape[2]), (0, head_dim - page.shape[3])]
    if any(after for _, after in pads):
        page = jnp.pad(page, pads)
    return page.reshape(shape)


def with_layer_pages(cache: KVCache, layer: str, pages: jax.Array) -> KVCache:
    """``cache`` with ``layer``'s pages replaced by ``pages`` in tpu-inference's layout (what
    their kernel returns): the inverse of :func:`layer_pages`, padding dropped; into a
    cross-layer buffer it is a write of the layer's pages (in place when the cache is
    donated)."""
    shape = pages_shape(cache)
    if pages.shape != shape or pages.dtype != cache.dtype:
        raise TpuInferenceMappingError(
            f"pages {pages.shape} {pages.dtype} for layer {layer!r} must be {shape} {cache.dtype}"
        )
    page = pages.reshape(*shape[:2], shape[2] * shape[3], shape[4])[:, :, : 2 * cache.num_kv_heads, : cache.head_dim]
    buffer, index = cache.layer_buffer(layer)
    return cache.with_layer_buffer(layer, page if index is None else buffer.at[:, index].set(page))


def attention_options(cache: KVCache, layer: str) -> dict[str, int | None]:
    """The keyword arguments of tpu-inference's attention that the cache knows for
    ``layer``: its ``sliding_window`` (None: full attention). A chunked-local layer (which
    their kernel does not mask) is :class:`TpuInferenceMappingError`."""
    spec = cache.spec(layer)
    if isinstance(spec, SlidingWindowSpec):
        return {"sliding_window": spec.sliding_window}
    if type(spec) is FullAttentionSpec:
        return {"sliding_window": None}
    raise TpuInferenceMappingError(
        f"layer {layer!r} has spec {spec!r}: tpu-inference's ragged paged attention masks only full and sliding-window"
    )


__all__ = [
    "INSTALL",
    "TPU_ENVIRONMENT",
    "TpuInference",
    "TpuInferenceMappingError",
    "TpuInferenceUnavailableError",
    "attention_metadata",
    "attention_options",
    "carry_states",
    "grouped_attention_metadata",
    "kv_packing",
    "layer_pages",
    "load_tpu_inference",
    "pages_copy_reason",
    "pages_shape",
    "request_distribution",
    "tpu_inference_environment",
    "with_layer_pages",
]
