"""The public device ops on a :class:`~jaxkv.device.cache.KVCache` (and the recurrent
:class:`~jaxkv.device.state_cache.StateCache`), dispatched by backend.

Implementations (:data:`IMPLEMENTATIONS`):

- ``reference``: :mod:`jaxkv.pallas.reference`, plain jnp (CPU default, the oracle);
- ``pallas_tpu``: the Mosaic TPU kernels of :mod:`jaxkv.pallas.tpu` (TPU default; on
  other backends they run in Pallas interpret mode);
- ``pallas_gpu``: the Mosaic GPU paged-attention kernel of :mod:`jaxkv.pallas.gpu` for
  Hopper (wgmma, TMA), with ``xla_gpu``'s writes and copies; on other backends it runs
  in the Mosaic GPU interpreter. Asked for by name, shapes its tiles do not fit are
  :class:`KVShapeError`;
- ``xla_gpu``: :mod:`jaxkv.pallas.xla` for GPUs: paged attention as an
  online-softmax loop over chunks of each sequence's pages, bounded by the batch's real
  kv lengths; writes and block copies as single scatters declared in-bounds with unique
  indices (padding repeats only the null block's); gathers and scatters of whole blocks
  are the reference ops.
- ``auto`` (the default): :mod:`jaxkv.device.auto` picks by the device and, for paged
  attention, by the call's shapes: ``pallas_tpu`` on TPU; on a Hopper GPU (compute
  capability 9.x) ``pallas_gpu`` wherever the kernel takes the shapes, ``xla_gpu``
  for the rest; ``xla_gpu`` on other GPUs; ``reference`` elsewhere. Each choice is
  made once per shape and logged with its reason
  (:func:`jaxkv.device.auto.attention_choice` returns it).

Each implementation is one row of a dispatch table (:data:`_DISPATCH`): the function
of each op, the Pallas ones imported on first use. Every public op runs under a
``jax.named_scope`` of its name (``jaxkv.paged_attention``...), so a profile shows
jaxkv's ops by name.

The choice is read when a function is traced: a jitted step keeps the implementation
it was traced with. Pick it per call with ``impl=``, or process-wide with
:func:`set_implementation` (also a context manager that restores the previous choice).
Every op is pure: the cache goes in and a new cache comes out; donate it in jit.

A layer's ops take the layer's name and the step's :class:`~jaxkv.device.metadata.StepMetadata`:
the cache supplies the layer's window (its planned spec) and the metadata the layer's
group (block table, slot mapping), so a caller cannot pass another layer's.

Inputs are trusted: shapes are checked (:class:`KVShapeError`), but block ids, slots and
lengths are not, on device (a slot of -1 wraps into the last block, an out-of-range
scatter is dropped). They are checked where the metadata is built, by
:func:`jaxkv.device.metadata.build_step_metadata`; build them there.

Tile alignment: a cache planned with ``head_dim_multiple`` (see
:func:`jaxkv.planner.plan_kv_cache`) has a head dim D larger than the model's d.
:func:`write_kv` and :func:`paged_attention` take q / k / v with any last dim d <= D,
zero-pad them to D before any implementation runs and slice the attention output back
to d. Zero q columns make the padded K columns irrelevant and V's padded columns are
written as zeros, so the result is exactly the unpadded attention; ``sm_scale`` stays
the caller's (1/sqrt(d)). With d == D nothing extra is traced.
"""

from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from types import ModuleType, TracebackType
from typing import Any, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.device import auto
from jaxkv.device.cache import KVCache
from jaxkv.device.metadata import StepMetadata
from jaxkv.device.state_cache import StateCache
from jaxkv.errors import JaxkvError
from jaxkv.pallas import reference, xla
from jaxkv.pallas.reference import KVShapeError
from jaxkv.specs import FullAttentionSpec, SlidingWindowSpec

IMPLEMENTATIONS = ("auto", "reference", "pallas_tpu", "pallas_gpu", "xla_gpu")
_TPU_KERNELS = "jaxkv.pallas.tpu"
_GPU_KERNELS = "jaxkv.pallas.gpu"


class UnknownImplementationError(JaxkvError, ValueError):
    """An implementation name not in :data:`IMPLEMENTATIONS`."""


class KernelUnavailableError(JaxkvError, ImportError):
    """The chosen implementation's kernels cannot be imported."""


class UnsupportedAttentionError(JaxkvError, ValueError):
    """A layer whose spec no paged attention implementation masks (chunked-local attention)."""


_lock = threading.Lock()
_current: tuple[str, Any] = ("auto", None)  # (name, interpret); replaced whole, read atomically


class _Restore:
    """Context manager returned by :func:`set_implementation`: restores on exit."""

    def __init__(self, previous: tuple[str, Any]) -> None:
        self._previous = previous

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        global _current
        with _lock:
            _current = self._previous


def _check_name(name: object) -> str:
    if name not in IMPLEMENTATIONS:
        raise UnknownImplementationError(f"unknown implementation {name!r}; valid: {', '.join(IMPLEMENTATIONS)}")
    return name


def set_implementation(name: str, *, interpret: Any = None) -> _Restore:
    """Choose the implementation process-wide; usable as ``with set_implementation(...)``.

    ``interpret`` goes to the Pallas kernels (None: interpret mode, with
    ``pltpu.InterpretParams()``, unless running on TPU). The setting is shared by all
    threads; for a per-thread choice pass ``impl=`` to each op instead.
    """
    global _current
    _check_name(name)
    with _lock:
        previous, _current = _current, (name, interpret)
    return _Restore(previous)


def implementation_setting() -> str:
    """The implementation name in force (``auto`` unless :func:`set_implementation` chose
    another): what a jitted step passes to the ops, which resolve ``auto`` per call."""
    return _current[0]


def get_implementation(impl: str | None = None) -> str:
    """The concrete implementation an op would use now (``impl`` overrides the setting).

    ``auto`` is the device's (:func:`jaxkv.device.auto.device_choice`): ``pallas_tpu`` on
    TPU, ``pallas_gpu`` on a Hopper GPU, ``xla_gpu`` on other GPUs, ``reference``
    elsewhere. Paged attention under ``auto`` on Hopper takes ``xla_gpu`` for shapes
    the Mosaic GPU kernel does not take (:func:`jaxkv.device.auto.attention_choice`).
    """
    name = _check_name(_current[0] if impl is None else impl)
    if name == "auto":
        return auto.device_choice().impl
    return name


def _kernel(implementation: str, path: str, name: str) -> Any:
    """``path.name``, imported on first use (its Pallas backend may be missing)."""
    try:
        module: ModuleType = importlib.import_module(path)
        return getattr(module, name)
    except (ImportError, AttributeError) as err:
        raise KernelUnavailableError(
            f"implementation {implementation!r} needs {path}.{name}, which cannot be "
            f"loaded ({err}); use set_implementation('reference') or impl='reference'"
        ) from err


def _tpu_op(name: str) -> Callable[..., Any]:
    """The Pallas TPU kernel ``name`` with its ``interpret`` bound (the interpreter off TPU)."""
    kernel = _kernel("pallas_tpu", _TPU_KERNELS, name)
    interpret = _current[1]
    if interpret is None:
        if jax.default_backend() == "tpu":
            return functools.partial(kernel, interpret=False)
        from jax.experimental.pallas import tpu as pltpu

        interpret = pltpu.InterpretParams()
    return functools.partial(kernel, interpret=interpret)


def _gpu_paged_attention() -> Callable[..., jax.Array]:
    """The Mosaic GPU kernel with its ``interpret`` bound (the interpreter off GPU); a shape
    its tiles do not fit is :class:`KVShapeError` naming it."""
    check = _kernel("pallas_gpu", _GPU_KERNELS, "check_supported")
    kernel = _kernel("pallas_gpu", _GPU_KERNELS, "paged_attention")
    interpret = _current[1] if _current[1] is not None else jax.default_backend() != "gpu"

    def attend(q: jax.Array, buffer: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        check(q, buffer)
        out: jax.Array = kernel(q, buffer, *args, **kwargs, interpret=interpret)
        return out

    return attend


_OPS = ("write_kv", "paged_attention", "copy_blocks", "copy_states")
_XLA: dict[str, Callable[[], Callable[..., Any]]] = {op: functools.partial(getattr, xla, op) for op in _OPS}
_DISPATCH: dict[str, dict[str, Callable[[], Callable[..., Any]]]] = {
    "reference": {op: functools.partial(getattr, reference, op) for op in _OPS},
    "xla_gpu": _XLA,
    "pallas_gpu": {**_XLA, "paged_attention": _gpu_paged_attention},
    "pallas_tpu": {op: functools.partial(_tpu_op, op) for op in _OPS},
}
"""Implementation -> op -> a function returning the op's implementation (Pallas kernels
are imported, and their ``interpret`` bound, when an op is traced)."""


def _implementation_of(op: str, impl: str | None) -> Callable[..., Any]:
    """The function implementing ``op`` under ``impl`` (default: the implementation in force)."""
    return _DISPATCH[get_implementation(impl)][op]()


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _named(op: Callable[_P, _R]) -> Callable[_P, _R]:
    """``op`` run under ``jax.named_scope("jaxkv.<name>")``: labelled in profiles and HLO."""
    scope = f"jaxkv.{op.__name__}"

    @functools.wraps(op)
    def scoped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with jax.named_scope(scope):
            return op(*args, **kwargs)

    return scoped


def _pad_head_dim(name: str, x: jax.Array, head_dim: int) -> jax.Array:
    """``x`` with its last dim zero-padded to the cache buffer's ``head_dim``.

    ``x`` itself when the dims already match (or ``x`` is a scalar, left to the
    implementation's shape checks); a last dim larger than ``head_dim`` is a
    :class:`KVShapeError` naming both, raised before anything runs.
    """
    if x.ndim == 0 or x.shape[-1] == head_dim:
        return x
    if x.shape[-1] > head_dim:
        raise KVShapeError(f"{name} {x.shape} has head dim {x.shape[-1]}, larger than the cache's head_dim {head_dim}")
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, head_dim - x.shape[-1])])


def _shard_heads_like(q: jax.Array, buffer: jax.Array) -> jax.Array:
    """``q`` resharded over its head axis as ``buffer``'s KV-head axis is, under explicit mesh axes.

    With explicit axes a replicated q cannot meet a head-sharded cache in one einsum
    (jax 0.11 refuses it); every device needs the query heads of its own KV heads,
    which is this split, since query heads are grouped by KV head in order. ``q``
    itself when the buffer's type names no mesh axis for its head dim (no mesh, or
    automatic axes, whose shardings are not part of the type).
    """
    sharding = jax.typeof(buffer).sharding
    head_dim_axis = buffer.ndim - 2
    if not isinstance(sharding, NamedSharding) or len(sharding.spec) <= head_dim_axis:
        return q
    head_axis = sharding.spec[head_dim_axis]
    if head_axis is None:
        return q
    spec = PartitionSpec(*([None] * (q.ndim - 2)), head_axis, None)
    return jax.sharding.reshard(q, NamedSharding(sharding.mesh, spec))


def _window(cache: KVCache, layer: str) -> int | None:
    """The sliding window of ``layer``'s planned spec (None: full attention);
    :class:`UnsupportedAttentionError` for a spec no implementation masks."""
    spec = cache.spec(layer)
    if isinstance(spec, SlidingWindowSpec):
        return spec.sliding_window
    if type(spec) is FullAttentionSpec:
        return None
    raise UnsupportedAttentionError(
        f"layer {layer!r} has spec {spec!r}; paged attention masks only full and sliding-window attention"
    )


@_named
def write_kv(
    cache: KVCache,
    layer: str,
    k: jax.Array,
    v: jax.Array,
    meta: StepMetadata,
    *,
    impl: str | None = None,
) -> KVCache:
    """Write new K/V ``(T, H, d)`` of ``layer`` into the slots ``meta`` gives its group; returns the cache.

    ``d`` may be smaller than the cache's head dim: K and V are zero-padded up to it.
    A layer the cache or the metadata does not know is :class:`UnknownLayerError`. The
    slots are trusted, not checked on device: :func:`jaxkv.device.metadata.build_step_metadata`
    checked them (a slot of -1 would wrap into the last block).
    """
    buffer, layer_index = cache.layer_buffer(layer)
    slot_mapping = meta.attention_of(layer).slot_mapping
    if k.shape != v.shape:
        raise KVShapeError(f"k {k.shape} and v {v.shape} must have the same shape")
    k, v = (_pad_head_dim(name, x, buffer.shape[-1]) for name, x in (("k", k), ("v", v)))
    new = _implementation_of("write_kv", impl)(buffer, k, v, slot_mapping, layer_index=layer_index)
    return cache.with_layer_buffer(layer, new)


@_named
def paged_attention(
    q: jax.Array,
    cache: KVCache,
    layer: str,
    meta: StepMetadata,
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Causal paged attention of ``layer`` over the ragged batch of ``meta``; ``(T, QH, d)`` out.

    Semantics are those of :func:`jaxkv.pallas.reference.paged_attention`. What the
    cache and the metadata know of ``layer`` comes from them: its sliding window from
    the cache's spec of the layer, its block table from its group's metadata
    (:meth:`~jaxkv.device.metadata.StepMetadata.group_of`); a layer either does not know is
    :class:`UnknownLayerError`. ``soft_cap`` (``cap * tanh(s / cap)`` of the scaled
    scores) is the model's math, not the cache's. ``q``'s head dim ``d`` may be smaller
    than the cache's: q is zero-padded up to it and the output sliced back to ``d``.
    """
    buffer, layer_index = cache.layer_buffer(layer)
    window = _window(cache, layer)
    block_tables = meta.attention_of(layer).block_tables
    padded = _pad_head_dim("q", q, buffer.shape[-1])
    args = (_shard_heads_like(padded, buffer), buffer, meta.kv_lens, block_tables, meta.cu_q_lens, meta.num_seqs)
    kwargs = {"layer_index": layer_index, "sm_scale": sm_scale, "sliding_window": window, "soft_cap": soft_cap}
    name = _check_name(_current[0] if impl is None else impl)
    if name == "auto":
        name = auto.attention_choice(padded, buffer).impl
    out = _implementation_of("paged_attention", name)(*args, **kwargs)
    return out if padded is q else out[..., : q.shape[-1]]


@_named
def copy_blocks(cache: KVCache, src: jax.Array, dst: jax.Array, *, impl: str | None = None) -> KVCache:
    """Copy whole blocks (every layer's page) ``src[i] -> dst[i]``; pad with ``0 -> 0``.

    Contract (the kernels copy concurrently): real ``dst`` ids are distinct and none is
    also the ``src`` of another pair. Ids are trusted, not checked on device.
    """
    return cache.replace(_implementation_of("copy_blocks", impl)(cache.buffers, src, dst))


@_named
def copy_states(cache: StateCache, src: jax.Array, dst: jax.Array, *, impl: str | None = None) -> StateCache:
    """Copy recurrent state rows ``src[i] -> dst[i]`` in every layer's buffers (a prefix-cache
    checkpoint into a request's running slot); pad with ``0 -> 0``. The contract of
    :func:`copy_blocks`; rows are trusted, not checked on device."""
    flat = _implementation_of("copy_states", impl)(cache.flat_buffers, src, dst)
    rows = iter(flat)
    return cache.replace([[next(rows) for _ in layer] for layer in cache.buffers])


@_named
def gather_blocks(cache: KVCache, ids: jax.Array) -> jax.Array:
    """Whole blocks ``(n, num_layers_per_block, block_size, 2*H, D)`` (the offload staging format).

    Cross-layer: one contiguous slice per block. The same format in both layouts. Ids
    are trusted, not checked on device (a -1 gathers the last block).
    """
    return reference.gather_blocks(cache.buffers, ids)


@_named
def scatter_blocks(cache: KVCache, ids: jax.Array, data: jax.Array) -> KVCache:
    """Write whole blocks gathered by :func:`gather_blocks` back at ``ids`` (trusted ids)."""
    return cache.replace(reference.scatter_blocks(cache.buffers, ids, data))
