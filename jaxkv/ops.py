"""The public device ops on a :class:`~jaxkv.cache.KVCache` (and the recurrent
:class:`~jaxkv.state_cache.StateCache`), dispatched by backend.

Implementations (:data:`IMPLEMENTATIONS`):

- ``reference``: :mod:`jaxkv.pallas.reference`, plain jnp (CPU default, the oracle);
- ``pallas_tpu``: the Mosaic TPU kernels of :mod:`jaxkv.pallas.tpu` (TPU default; on
  other backends they run in Pallas interpret mode);
- ``pallas_gpu``: the Mosaic GPU paged-attention kernel of :mod:`jaxkv.pallas.gpu` for
  Hopper (wgmma, TMA), with ``xla_gpu``'s writes and copies; on other backends it runs
  in the Mosaic GPU interpreter. ``auto`` picks it on a Hopper GPU for the shapes its
  tiles fit (:func:`jaxkv.pallas.gpu.check_supported`), ``xla_gpu`` otherwise;
- ``xla_gpu``: :mod:`jaxkv.pallas.xla` for GPUs (other GPUs' default): paged attention as an
  online-softmax loop over chunks of each sequence's pages, bounded by the batch's real
  kv lengths; writes and block copies as single scatters declared in-bounds with unique
  indices (padding repeats only the null block's); gathers and scatters of whole blocks
  are the reference ops.
- ``auto``: pick by ``jax.default_backend()``.

The choice is read when a function is traced: a jitted step keeps the implementation
it was traced with. Pick it per call with ``impl=``, or process-wide with
:func:`set_implementation` (also a context manager that restores the previous choice).
Every op is pure: the cache goes in and a new cache comes out; donate it in jit.

A layer's ops take the layer's name and the step's :class:`~jaxkv.metadata.StepMetadata`:
the cache supplies the layer's window (its planned spec) and the metadata the layer's
group (block table, slot mapping), so a caller cannot pass another layer's.

Inputs are trusted: shapes are checked (:class:`KVShapeError`), but block ids, slots and
lengths are not, on device (a slot of -1 wraps into the last block, an out-of-range
scatter is dropped). They are checked where the metadata is built, by
:func:`jaxkv.metadata.build_step_metadata`; build them there.

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
from types import ModuleType, TracebackType
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxkv.cache import KVCache, UnknownLayerError
from jaxkv.errors import JaxkvError
from jaxkv.metadata import AttentionMetadata, StepMetadata
from jaxkv.pallas import reference, xla
from jaxkv.pallas.reference import KVShapeError
from jaxkv.specs import FullAttentionSpec, SlidingWindowSpec
from jaxkv.state_cache import StateCache

IMPLEMENTATIONS = ("auto", "reference", "pallas_tpu", "pallas_gpu", "xla_gpu")
_BACKEND_DEFAULTS = {"tpu": "pallas_tpu", "gpu": "xla_gpu", "cuda": "xla_gpu", "rocm": "xla_gpu"}
_TPU_KERNELS = "jaxkv.pallas.tpu"
_GPU_KERNELS = "jaxkv.pallas.gpu"
_HOPPER = "9"


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
    return name  # type: ignore[return-value]


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


def get_implementation(impl: str | None = None) -> str:
    """The concrete implementation an op would use now (``impl`` overrides the setting).

    ``auto`` on a Hopper GPU is ``pallas_gpu``; its paged attention falls back to
    ``xla_gpu`` for shapes the kernel's tiles do not fit (see :func:`paged_attention`).
    """
    name = _check_name(_current[0] if impl is None else impl)
    if name == "auto":
        if _is_hopper(jax.devices()[0]):
            return "pallas_gpu"
        return _BACKEND_DEFAULTS.get(jax.default_backend(), "reference")
    return name


def _is_hopper(device: jax.Device) -> bool:
    """Whether ``device`` is an sm_90 GPU (the wgmma / TMA generation the GPU kernel targets)."""
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith(_HOPPER + ".")


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


def _tpu_kernel(name: str) -> tuple[Any, Any]:
    """The Pallas TPU kernel ``name`` and the ``interpret`` value to call it with."""
    kernel = _kernel("pallas_tpu", _TPU_KERNELS, name)
    interpret = _current[1]
    if interpret is None:
        if jax.default_backend() == "tpu":
            return kernel, False
        from jax.experimental.pallas import tpu as pltpu

        interpret = pltpu.InterpretParams()
    return kernel, interpret


def _gpu_attention(q: jax.Array, buffer: jax.Array, requested: str) -> Any:
    """The Mosaic GPU kernel with its ``interpret`` bound, or None to use ``xla_gpu``
    (``auto`` on shapes the kernel's tiles do not fit; an explicit ``pallas_gpu``
    raises :class:`KVShapeError` naming the shape instead)."""
    try:
        _kernel("pallas_gpu", _GPU_KERNELS, "check_supported")(q, buffer)
    except KVShapeError:
        if requested == "auto":
            return None
        raise
    interpret = _current[1]
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return functools.partial(_kernel("pallas_gpu", _GPU_KERNELS, "paged_attention"), interpret=interpret)


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


def _attention_group(meta: StepMetadata, layer: str) -> AttentionMetadata:
    """``layer``'s block table and slot mapping; :class:`UnknownLayerError` when the
    step's metadata holds state rows for it (a recurrent layer has no pages)."""
    group = meta.group_of(layer)
    if not isinstance(group, AttentionMetadata):
        raise UnknownLayerError(f"layer {layer!r} is a recurrent layer in this step's metadata: it has no KV pages")
    return group


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
    slots are trusted, not checked on device: :func:`jaxkv.metadata.build_step_metadata`
    checked them (a slot of -1 would wrap into the last block).
    """
    buffer, layer_index = cache.layer_buffer(layer)
    slot_mapping = _attention_group(meta, layer).slot_mapping
    if k.shape != v.shape:
        raise KVShapeError(f"k {k.shape} and v {v.shape} must have the same shape")
    k, v = (_pad_head_dim(name, x, buffer.shape[-1]) for name, x in (("k", k), ("v", v)))
    name = get_implementation(impl)
    if name == "pallas_tpu":
        kernel, interpret = _tpu_kernel("write_kv")
        new = kernel(buffer, k, v, slot_mapping, layer_index=layer_index, interpret=interpret)
    elif name in ("pallas_gpu", "xla_gpu"):
        new = xla.write_kv(buffer, k, v, slot_mapping, layer_index=layer_index)
    else:
        new = reference.write_kv(buffer, k, v, slot_mapping, layer_index=layer_index)
    return cache.with_layer_buffer(layer, new)


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
    (:meth:`~jaxkv.metadata.StepMetadata.group_of`); a layer either does not know is
    :class:`UnknownLayerError`. ``soft_cap`` (``cap * tanh(s / cap)`` of the scaled
    scores) is the model's math, not the cache's. ``q``'s head dim ``d`` may be smaller
    than the cache's: q is zero-padded up to it and the output sliced back to ``d``.
    """
    buffer, layer_index = cache.layer_buffer(layer)
    window = _window(cache, layer)
    block_tables = _attention_group(meta, layer).block_tables
    padded = _pad_head_dim("q", q, buffer.shape[-1])
    args = (_shard_heads_like(padded, buffer), buffer, meta.kv_lens, block_tables, meta.cu_q_lens, meta.num_seqs)
    kwargs = {"layer_index": layer_index, "sm_scale": sm_scale, "sliding_window": window, "soft_cap": soft_cap}
    name = get_implementation(impl)
    gpu_kernel = _gpu_attention(padded, buffer, _current[0] if impl is None else impl) if name == "pallas_gpu" else None
    if name == "pallas_tpu":
        kernel, interpret = _tpu_kernel("paged_attention")
        out = kernel(*args, **kwargs, interpret=interpret)
    elif gpu_kernel is not None:
        out = gpu_kernel(*args, **kwargs)
    elif name in ("pallas_gpu", "xla_gpu"):
        out = xla.paged_attention(*args, **kwargs)
    else:
        out = reference.paged_attention(*args, **kwargs)
    return out if padded is q else out[..., : q.shape[-1]]


def copy_blocks(cache: KVCache, src: jax.Array, dst: jax.Array, *, impl: str | None = None) -> KVCache:
    """Copy whole blocks (every layer's page) ``src[i] -> dst[i]``; pad with ``0 -> 0``.

    Contract (the kernels copy concurrently): real ``dst`` ids are distinct and none is
    also the ``src`` of another pair. Ids are trusted, not checked on device.
    """
    name = get_implementation(impl)
    if name == "pallas_tpu":
        kernel, interpret = _tpu_kernel("copy_blocks")
        return cache.replace(kernel(cache.buffers, src, dst, interpret=interpret))
    if name in ("pallas_gpu", "xla_gpu"):
        return cache.replace(xla.copy_blocks(cache.buffers, src, dst))
    return cache.replace(reference.copy_blocks(cache.buffers, src, dst))


def copy_states(cache: StateCache, src: jax.Array, dst: jax.Array, *, impl: str | None = None) -> StateCache:
    """Copy recurrent state rows ``src[i] -> dst[i]`` in every layer's buffers (a prefix-cache
    checkpoint into a request's running slot); pad with ``0 -> 0``. The contract of
    :func:`copy_blocks`; rows are trusted, not checked on device."""
    name = get_implementation(impl)
    buffers = cache.flat_buffers
    if name == "pallas_tpu":
        kernel, interpret = _tpu_kernel("copy_states")
        flat = kernel(buffers, src, dst, interpret=interpret)
    elif name in ("pallas_gpu", "xla_gpu"):
        flat = xla.copy_states(buffers, src, dst)
    else:
        flat = reference.copy_states(buffers, src, dst)
    rows = iter(flat)
    return cache.replace([[next(rows) for _ in layer] for layer in cache.buffers])


def gather_blocks(cache: KVCache, ids: jax.Array) -> jax.Array:
    """Whole blocks ``(n, num_layers_per_block, block_size, 2*H, D)`` (the offload staging format).

    Cross-layer: one contiguous slice per block. The same format in both layouts. Ids
    are trusted, not checked on device (a -1 gathers the last block).
    """
    return reference.gather_blocks(cache.buffers, ids)


def scatter_blocks(cache: KVCache, ids: jax.Array, data: jax.Array) -> KVCache:
    """Write whole blocks gathered by :func:`gather_blocks` back at ``ids`` (trusted ids)."""
    return cache.replace(reference.scatter_blocks(cache.buffers, ids, data))
