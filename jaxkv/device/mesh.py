"""Tensor parallelism on a device mesh: where the runner puts weights, cache and metadata.

A runner given a :class:`jax.sharding.Mesh` splits the model over one of its axes (the
model axis, MODEL_AXIS by default):

- the KV cache's heads (:func:`jaxkv.device.cache.allocate_kv_cache` with ``kv_axis``), each
  device holding whole KV heads; recurrent state rows are replicated
  (:func:`jaxkv.device.state_cache.allocate_state_cache`);
- the weights, by the model's partition specs (``ServedModel.partition_specs``: column-
  then row-parallel attention and MLP, the rest replicated);
- step metadata and sampled tokens replicated.

Inside the step the mesh's axes are automatic (:func:`auto_axes`): XLA's partitioner
propagates these shardings through the model and adds the collectives (one all-reduce
after each row-parallel projection), whatever axis types the caller's mesh has.

Arrays are placed with their global shape and sharding; a sharding whose devices span
processes (multi-host) is filled from each process's own copy
(:func:`jax.make_array_from_callback`, every process holding the same values), never by
sending the whole array to one device.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxkv.device.metadata import place_values
from jaxkv.errors import JaxkvError
from jaxkv.ints import check_int

MODEL_AXIS = "model"
"""The axis name models annotate their split weights with; the runner renames it to the
mesh's own model axis."""


class MeshError(JaxkvError, ValueError):
    """A mesh, axis or device count the runner cannot split a model over."""


def model_mesh(num_devices: int, *, model_axis: str = MODEL_AXIS, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A one-axis mesh over the first ``num_devices`` devices (default ``jax.devices()``,
    all processes' devices in order); :class:`MeshError` when there are fewer."""
    check_int("num_devices", num_devices, minimum=1, error=MeshError)
    devices = list(jax.devices() if devices is None else devices)
    if num_devices > len(devices):
        raise MeshError(
            f"num_devices={num_devices} exceeds the {len(devices)} {jax.default_backend()} device(s) available "
            "(on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported)"
        )
    return Mesh(np.array(devices[:num_devices]), (model_axis,), axis_types=(AxisType.Auto,))


def mesh_axis_size(mesh: Mesh, model_axis: str) -> int:
    """Devices along ``model_axis`` of ``mesh``; :class:`MeshError` when it is not a mesh
    or the axis is not one of its axes."""
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be a jax.sharding.Mesh, got {mesh!r:.80}")
    if model_axis not in mesh.axis_names:
        raise MeshError(f"model_axis {model_axis!r} is not an axis of the mesh {dict(mesh.shape)}")
    return mesh.shape[model_axis]


def auto_axes(mesh: Mesh, model_axis: str) -> Mesh:
    """``mesh`` (same devices, same axis names) with every axis automatic (checked as by
    :func:`mesh_axis_size`)."""
    mesh_axis_size(mesh, model_axis)
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def replicated(mesh: Mesh) -> NamedSharding:
    """Every device holds the whole array (metadata, sampled tokens, recurrent state)."""
    return NamedSharding(mesh, PartitionSpec())


def _on_axis(spec: PartitionSpec, model_axis: str) -> PartitionSpec:
    """An annotation's spec with :data:`MODEL_AXIS` renamed to the runner's axis."""
    return PartitionSpec(*(model_axis if name == MODEL_AXIS else name for name in spec))


def weight_shardings(specs: object, mesh: Mesh, model_axis: str) -> object:
    """The sharding of every weight from its annotated partition spec (a pytree of
    :class:`PartitionSpec`, :data:`MODEL_AXIS` where a weight is split; empty: replicated)."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, _on_axis(spec, model_axis)),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def place(tree: object, shardings: object) -> object:
    """``tree``'s arrays with ``shardings`` (a matching pytree). Across processes, each
    process fills its own devices' shards from its copy of the values
    (:func:`jaxkv.device.metadata.place_values`)."""
    return jax.tree.map(place_values, tree, shardings)
