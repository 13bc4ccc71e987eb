"""What ``auto`` means for :mod:`jaxkv.device.ops`: the implementation picked for the device
in hand and, for paged attention, for the shapes of one call, each with its reason.

The rule (the fastest implementation that passed on such a device, BUILD.md "GPU runs"):

- TPU: ``pallas_tpu``;
- an NVIDIA Hopper GPU (compute capability 9.x): ``pallas_gpu``, whose paged attention is
  the Mosaic GPU kernel (38x ``xla_gpu``'s cold TTFT on llama-1b, H100) wherever
  :func:`jaxkv.pallas.gpu.check_supported` takes the shapes and the cache is on one
  device; any other attention call there (fp32, a head dim or GQA ratio its tiles do
  not fit, a cache split over a mesh) is ``xla_gpu``, as its writes and copies are;
- any other GPU: ``xla_gpu`` (the kernel is wgmma and TMA: Hopper only);
- anything else (CPU): ``reference``.

Each decision is made once per device and shape (cached) and logged then, at INFO for
attention (``logging.getLogger("jaxkv.device.auto")``), so a server's log says which
kernel each shape runs and why. :func:`attention_choice` returns the same
``(impl, reason)`` to a caller. The device is :func:`default_device` (tests replace it
with a fake one).
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxkv.pallas.reference import KVShapeError

_log = logging.getLogger(__name__)
_HOPPER = re.compile(r"9\.\d+")
"""Compute capability of the GPUs the Mosaic GPU kernel (wgmma, TMA) is written for."""
_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


class AutoChoice(NamedTuple):
    """An implementation name of :data:`jaxkv.device.ops.IMPLEMENTATIONS` and why ``auto`` took it."""

    impl: str
    reason: str


def default_device() -> Any:
    """The device whose kind decides ``auto``: the default backend's first device."""
    return jax.devices()[0]


def _device_key(device: Any) -> tuple[str, str | None]:
    """(platform, compute capability or None): all of a device the rule reads."""
    capability = getattr(device, "compute_capability", None)
    return str(device.platform), None if capability is None else str(capability)


@functools.cache
def _device_rule(platform: str, capability: str | None) -> AutoChoice:
    if platform == "tpu":
        choice = AutoChoice("pallas_tpu", "TPU: the Mosaic TPU kernels")
    elif platform in _GPU_PLATFORMS and capability is not None and _HOPPER.fullmatch(capability):
        choice = AutoChoice("pallas_gpu", f"Hopper GPU (compute capability {capability}): the Mosaic GPU kernel")
    elif platform in _GPU_PLATFORMS:
        choice = AutoChoice(
            "xla_gpu", f"GPU of compute capability {capability}: the Mosaic GPU kernel needs Hopper (9.x)"
        )
    else:
        choice = AutoChoice("reference", f"{platform}: no kernels, the jnp reference")
    _log.debug("auto on %s %s: %s (%s)", platform, capability or "", choice.impl, choice.reason)
    return choice


def device_choice(device: Any = None) -> AutoChoice:
    """``auto`` for every op but paged attention on ``device`` (None: :func:`default_device`)."""
    return _device_rule(*_device_key(default_device() if device is None else device))


def _mesh_size(x: Any) -> int:
    """Devices ``x``'s type spreads it over (1 outside a mesh, or for a plain shape)."""
    try:
        mesh = jax.typeof(x).sharding.mesh
    except (AttributeError, TypeError):
        return 1
    return int(getattr(mesh, "size", 1) or 1)


def attention_choice(q: Any, kv_buffer: Any, *, device: Any = None) -> AutoChoice:
    """``auto``'s implementation of paged attention for ``q`` over ``kv_buffer`` (arrays,
    tracers or ``jax.ShapeDtypeStruct``) on ``device`` (None: :func:`default_device`).

    Decided once per device, shapes, dtypes and mesh size; the first decision of each
    is logged at INFO.
    """
    device = default_device() if device is None else device
    return _attention_rule(
        _device_key(device),
        (tuple(q.shape), jnp.dtype(q.dtype).name),
        (tuple(kv_buffer.shape), jnp.dtype(kv_buffer.dtype).name),
        _mesh_size(kv_buffer),
    )


@functools.cache
def _attention_rule(
    device: tuple[str, str | None], q: tuple[tuple[int, ...], str], kv: tuple[tuple[int, ...], str], mesh_size: int
) -> AutoChoice:
    choice = _device_rule(*device)
    if choice.impl == "pallas_gpu":
        choice = _hopper_attention(q, kv, mesh_size, choice.reason)
    _log.info("auto paged attention, q %s %s over cache %s %s: %s (%s)", *q, *kv, choice.impl, choice.reason)
    return choice


def _hopper_attention(
    q: tuple[tuple[int, ...], str], kv: tuple[tuple[int, ...], str], mesh_size: int, hopper: str
) -> AutoChoice:
    """The Mosaic GPU kernel where it takes the call, ``xla_gpu`` (with why not) elsewhere."""
    if mesh_size > 1:
        return AutoChoice("xla_gpu", f"the cache is split over {mesh_size} devices; the Mosaic GPU kernel runs on one")
    try:
        from jaxkv.pallas.gpu import check_supported
    except ImportError as err:
        return AutoChoice("xla_gpu", f"the Mosaic GPU kernel cannot be loaded ({err})")
    try:
        check_supported(jax.ShapeDtypeStruct(*q), jax.ShapeDtypeStruct(*kv))
    except KVShapeError as err:
        return AutoChoice("xla_gpu", f"the Mosaic GPU kernel does not take these shapes: {err}")
    return AutoChoice("pallas_gpu", hopper)
