"""The public device ops on a :class:`~jaxkv.cache.KVCache`, dispatched by backend.

Implementations (:data:`IMPLEMENTATIONS`):

- ``reference``: :mod:`jaxkv.pallas.reference`, plain jnp (CPU default, the oracle);
- ``pallas_tpu``: the Mosaic TPU kernels of :mod:`jaxkv.pallas.tpu` (TPU default; on
  other backends they run in Pallas interpret mode);
- ``xla_gpu``: an XLA formulation for GPUs (default there): paged attention as an
  online-softmax loop over chunks of each sequence's pages, bounded by the batch's real
  kv lengths; writes, copies, gathers and scatters are single XLA scatters/gathers,
  which already are the best XLA formulation, so they are the reference ops.
- ``auto``: pick by ``jax.default_backend()``.

The choice is read when a function is traced: a jitted step keeps the implementation
it was traced with. Pick it per call with ``impl=``, or process-wide with
:func:`set_implementation` (also a context manager that restores the previous choice).
Every op is pure: the cache goes in and a new cache comes out; donate it in jit.

Tile alignment: a cache planned with ``head_dim_multiple`` (see
:func:`jaxkv.planner.plan_kv_cache`) has a head dim D larger than the model's d.
:func:`write_kv` and :func:`paged_attention` take q / k / v with any last dim d <= D,
zero-pad them to D before any implementation runs and slice the attention output back
to d. Zero q columns make the padded K columns irrelevant and V's padded columns are
written as zeros, so the result is exactly the unpadded attention; ``sm_scale`` stays
the caller's (1/sqrt(d)). With d == D nothing extra is traced.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType, TracebackType
from typing import Any

import jax
import jax.numpy as jnp

from jaxkv.cache import KVCache
from jaxkv.pallas import reference
from jaxkv.pallas.reference import KVShapeError

IMPLEMENTATIONS = ("auto", "reference", "pallas_tpu", "xla_gpu")
_BACKEND_DEFAULTS = {"tpu": "pallas_tpu", "gpu": "xla_gpu", "cuda": "xla_gpu", "rocm": "xla_gpu"}
_TPU_KERNELS = "jaxkv.pallas.tpu"
XLA_CHUNK_BYTES = 64 << 20
"""Default size of the pages one step of the ``xla_gpu`` attention loop gathers."""
XLA_MAX_CHUNK_TOKENS = 512
"""Most kv positions one step of the ``xla_gpu`` attention loop covers."""


class UnknownImplementationError(ValueError):
    """An implementation name not in :data:`IMPLEMENTATIONS`."""


class KernelUnavailableError(ImportError):
    """The chosen implementation's kernels cannot be imported."""


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
        raise UnknownImplementationError(
            f"unknown implementation {name!r}; valid: {', '.join(IMPLEMENTATIONS)}"
        )
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
    """The concrete implementation an op would use now (``impl`` overrides the setting)."""
    name = _check_name(_current[0] if impl is None else impl)
    if name == "auto":
        return _BACKEND_DEFAULTS.get(jax.default_backend(), "reference")
    return name


def _tpu_kernel(name: str) -> tuple[Any, Any]:
    """The Pallas TPU kernel ``name`` and the ``interpret`` value to call it with."""
    try:
        module: ModuleType = importlib.import_module(_TPU_KERNELS)
        kernel = getattr(module, name)
    except (ImportError, AttributeError) as err:
        raise KernelUnavailableError(
            f"implementation 'pallas_tpu' needs {_TPU_KERNELS}.{name}, which cannot be "
            f"loaded ({err}); use set_implementation('reference') or impl='reference'"
        ) from err
    interpret = _current[1]
    if interpret is None:
        if jax.default_backend() == "tpu":
            return kernel, False
        from jax.experimental.pallas import tpu as pltpu

        interpret = pltpu.InterpretParams()
    return kernel, interpret


def _pad_head_dim(name: str, x: jax.Array, head_dim: int) -> jax.Array:
    """``x`` with its last dim zero-padded to the cache buffer's ``head_dim``.

    ``x`` itself when the dims already match (or ``x`` is a scalar, left to the
    implementation's shape checks); a last dim larger than ``head_dim`` is a
    :class:`KVShapeError` naming both, raised before anything runs.
    """
    if x.ndim == 0 or x.shape[-1] == head_dim:
        return x
    if x.shape[-1] > head_dim:
        raise KVShapeError(
            f"{name} {x.shape} has head dim {x.shape[-1]}, larger than the cache's head_dim "
            f"{head_dim}"
        )
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, head_dim - x.shape[-1])])


def write_kv(
    cache: KVCache,
    layer: str,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    impl: str | None = None,
) -> KVCache:
    """Write new K/V ``(T, H, d)`` of ``layer`` into their global slots; returns the cache.

    ``d`` may be smaller than the cache's head dim: K and V are zero-padded up to it.
    Padding tokens must map into the null block (slot 0).
    """
    buffer, layer_slot = cache.layer_buffer(layer)
    if k.shape != v.shape:
        raise KVShapeError(f"k {k.shape} and v {v.shape} must have the same shape")
    k, v = (_pad_head_dim(name, x, buffer.shape[-1]) for name, x in (("k", k), ("v", v)))
    if get_implementation(impl) == "pallas_tpu":
        kernel, interpret = _tpu_kernel("write_kv")
        new = kernel(buffer, k, v, slot_mapping, layer_slot=layer_slot, interpret=interpret)
    else:
        new = reference.write_kv(buffer, k, v, slot_mapping, layer_slot=layer_slot)
    return cache.with_layer_buffer(layer, new)


def paged_attention(
    q: jax.Array,
    cache: KVCache,
    layer: str,
    block_tables: jax.Array,
    kv_lens: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Causal paged attention of ``layer`` over a ragged batch; ``(T, QH, d)`` out.

    Semantics are those of :func:`jaxkv.pallas.reference.paged_attention`;
    ``block_tables`` is the table of ``layer``'s KV cache group. ``q``'s head dim ``d``
    may be smaller than the cache's: q is zero-padded up to it and the output sliced
    back to ``d``.
    """
    buffer, layer_slot = cache.layer_buffer(layer)
    padded = _pad_head_dim("q", q, buffer.shape[-1])
    args = (padded, buffer, kv_lens, block_tables, cu_q_lens, num_seqs)
    kwargs = dict(
        layer_slot=layer_slot, sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap
    )
    name = get_implementation(impl)
    if name == "pallas_tpu":
        kernel, interpret = _tpu_kernel("paged_attention")
        out = kernel(*args, **kwargs, interpret=interpret)
    elif name == "xla_gpu":
        out = xla_paged_attention(*args, **kwargs)
    else:
        out = reference.paged_attention(*args, **kwargs)
    return out if padded is q else out[..., : q.shape[-1]]


def copy_blocks(
    cache: KVCache, src: jax.Array, dst: jax.Array, *, impl: str | None = None
) -> KVCache:
    """Copy whole blocks (all layer slots) ``src[i] -> dst[i]``; pad with ``0 -> 0``.

    Contract (the kernels copy concurrently): real ``dst`` ids are distinct and none is
    also the ``src`` of another pair.
    """
    if get_implementation(impl) == "pallas_tpu":
        kernel, interpret = _tpu_kernel("copy_blocks")
        return cache.replace(kernel(cache.buffers, src, dst, interpret=interpret))
    return cache.replace(reference.copy_blocks(cache.buffers, src, dst))


def gather_blocks(cache: KVCache, ids: jax.Array) -> jax.Array:
    """Whole blocks ``(n, num_slots, block_size, 2*H, D)`` (the offload staging format).

    Cross-layer: one contiguous slice per block. The same format in both layouts.
    """
    return reference.gather_blocks(cache.buffers, ids)


def scatter_blocks(cache: KVCache, ids: jax.Array, data: jax.Array) -> KVCache:
    """Write whole blocks gathered by :func:`gather_blocks` back at ``ids``."""
    return cache.replace(reference.scatter_blocks(cache.buffers, ids, data))


def xla_paged_attention(
    q: jax.Array,
    kv_buffer: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    layer_slot: int | None = None,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    chunk_tokens: int | None = None,
) -> jax.Array:
    """The ``xla_gpu`` paged attention: same contract as the reference, built for speed.

    Each token reads only its own sequence's pages, through its block table,
    ``chunk_tokens`` kv positions (rounded down to whole blocks; default: what fits
    :data:`XLA_CHUNK_BYTES` for T tokens, at most :data:`XLA_MAX_CHUNK_TOKENS`) per loop
    step, with an online softmax in float32: memory O(T * chunk) instead of
    O(T * table width). The loop runs only over the chunks some token can see (lowest
    window start to longest kv length in the batch), so bucketed table widths and empty
    padding cost nothing.
    A decode token reads each of its pages once; a prefill chunk re-reads its pages per
    query token, the price of staying in plain XLA.
    """
    reference.check_paged_attention_args(
        q, kv_buffer, kv_lens, block_tables, cu_q_lens, num_seqs,
        layer_slot=layer_slot, sliding_window=sliding_window, soft_cap=soft_cap,
    )
    block_size, combined, head_dim = kv_buffer.shape[-3:]
    num_kv_heads = combined // 2
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    if chunk_tokens is None:
        token_bytes = num_tokens * combined * head_dim * kv_buffer.dtype.itemsize
        chunk_tokens = min(XLA_MAX_CHUNK_TOKENS, XLA_CHUNK_BYTES // max(token_bytes, 1))
    chunk_blocks = max(1, min(block_tables.shape[1], chunk_tokens // block_size))
    chunk = chunk_blocks * block_size
    width = -(-block_tables.shape[1] // chunk_blocks) * chunk_blocks
    tables = jnp.pad(block_tables, ((0, 0), (0, width - block_tables.shape[1])))

    seq, position, valid = reference.token_sequences(num_tokens, cu_q_lens, kv_lens, num_seqs)
    token_tables = tables[seq]  # (T, width)
    lowest = jnp.zeros_like(position) if sliding_window is None else position - sliding_window + 1
    first = jnp.min(jnp.where(valid, jnp.maximum(lowest, 0), width * block_size)) // chunk
    last = -(-jnp.max(jnp.where(valid, position + 1, 0)) // chunk)

    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    precision = jax.lax.Precision.HIGHEST

    def step(j: jax.Array, carry: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        row_max, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(token_tables, j * chunk_blocks, chunk_blocks, 1)
        kv = kv_buffer[pages] if layer_slot is None else kv_buffer[pages, layer_slot]
        kv = kv.reshape(num_tokens, chunk, combined, head_dim)  # keeps the 2H axis whole
        logits = jnp.einsum(
            "thgd,tlhd->thgl", qg, kv[:, :, 0::2],
            precision=precision, preferred_element_type=jnp.float32,
        ) * sm_scale
        if soft_cap is not None:
            logits = soft_cap * jnp.tanh(logits / soft_cap)
        kv_pos = j * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = (kv_pos[None, :] <= position[:, None]) & valid[:, None]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > position[:, None] - sliding_window
        logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=-1))
        safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
        scale = jnp.exp(row_max - safe_max)
        probs = jnp.exp(logits - safe_max[..., None])
        denom = denom * scale + jnp.sum(probs, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum(
            "thgl,tlhd->thgd", probs.astype(kv.dtype), kv[:, :, 1::2],
            precision=precision, preferred_element_type=jnp.float32,
        )
        return new_max, denom, acc

    shape = (num_tokens, num_kv_heads, group)
    init = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape + (head_dim,), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(first, last, step, init)
    out = acc / jnp.where(denom > 0, denom, 1.0)[..., None]
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
