"""Load a Hugging Face-format checkpoint directory into a served model.

The directory holds ``config.json`` and the weights as one ``model.safetensors`` or
several ``*.safetensors`` shards with their ``model.safetensors.index.json``. The
config's ``architectures[0]`` picks the builder (:mod:`jaxkv.models.registry`); the
model declares every tensor it reads by its checkpoint name and shape, and the loader
checks them all before reading any (a missing tensor or a shape mismatch is a typed
error naming it, and nothing is loaded). Weights are cast to ``dtype`` (None: the
checkpoint's own, that of its embedding table).

With a mesh, each weight is placed straight onto its sharding (the model's
:meth:`partition_specs`, :data:`jaxkv.device.mesh.MODEL_AXIS` renamed to ``model_axis``):
every device's shard is read from the file as its own slice
(``safe_open(...).get_slice``, :func:`jax.make_array_from_callback`), so no device
ever holds a whole split weight. A local path only: nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxkv.device.mesh import MODEL_AXIS, mesh_axis_size, weight_shardings
from jaxkv.errors import JaxkvError
from jaxkv.models import registry
from jaxkv.specs import canonical_dtype

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class CheckpointError(JaxkvError, ValueError):
    """A checkpoint directory that cannot be loaded (the message names the file or value)."""


class UnknownArchitectureError(CheckpointError):
    """``config.json`` names an architecture no builder in :mod:`jaxkv.models.registry` knows."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the model reads is not in the checkpoint."""

    def __str__(self) -> str:
        return str(self.args[0])


class ShapeMismatchError(CheckpointError):
    """A checkpoint tensor's shape differs from the one the config implies."""


def read_config(directory: Path) -> dict[str, Any]:
    """The directory's ``config.json``; :class:`CheckpointError` when missing or not JSON."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist (a local path only)")
    try:
        return json.loads((directory / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {directory / CONFIG}: {err}") from err


def eos_token_ids(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """The end-of-sequence ids of the checkpoint in ``path``: ``eos_token_id`` of its
    ``generation_config.json`` (what generation reads first), else of its ``config.json``;
    one id or a list of them; none when neither names any."""
    directory = Path(path)
    for name in (GENERATION_CONFIG, CONFIG):
        file = directory / name
        if not file.exists():
            continue
        try:
            value = json.loads(file.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError) as err:
            raise CheckpointError(f"cannot read eos_token_id from {file}: {err}") from err
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise CheckpointError(f"{file}: eos_token_id must be an id or a list of ids, got {value!r}")
        return tuple(ids)
    return ()


def tensor_files(directory: Path) -> dict[str, Path]:
    """Which ``*.safetensors`` file holds each tensor: the index's ``weight_map`` when there
    is one, otherwise every safetensors file's own header."""
    from safetensors import safe_open

    index = directory / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"cannot read the weight_map of {index}: {err}") from err
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has no *.safetensors file")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="numpy") as handle:
            where |= dict.fromkeys(handle.keys(), file)
    return where


def builder_of(config: Mapping[str, Any]) -> Any:
    """The class that builds ``config``'s ``architectures[0]``; :class:`UnknownArchitectureError` if none does."""
    architecture = (config.get("architectures") or [None])[0]
    try:
        return registry.builder(architecture)
    except (KeyError, TypeError):
        raise UnknownArchitectureError(
            f"unknown architecture {architecture!r}; known: {', '.join(registry.ARCHITECTURES)}"
        ) from None


def build_model(config: Mapping[str, Any], dtype: Any) -> Any:
    """An unloaded model of ``config`` (no weights yet); a config without a field its builder
    needs is a :class:`CheckpointError` naming the field."""
    cls = builder_of(config)
    try:
        return cls(config, dtype)
    except KeyError as err:
        raise CheckpointError(f"config.json of {cls.__name__} lacks the field {err.args[0]!r}") from None


def _check_split(name: str, shape: tuple[int, ...], spec: PartitionSpec, devices: int) -> None:
    """Refuse a weight whose split dimension does not divide over ``devices``."""
    for size, axis in zip(shape, spec, strict=False):  # a spec may name fewer dims
        if axis is not None and size % devices:
            raise ShapeMismatchError(f"{name} {shape}: dimension {size} does not split over {devices} devices")


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: str | None = None,
    mesh: Mesh | None = None,
    model_axis: str = MODEL_AXIS,
) -> Any:
    """The model saved in the checkpoint directory ``path``, its ``params`` loaded (see the module doc)."""
    from safetensors import safe_open

    directory = Path(path)
    config = read_config(directory)
    builder_of(config)  # an unknown architecture is refused before any file is opened
    where = tensor_files(directory)
    with contextlib.ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(str(file), framework="flax")) for file in sorted(set(where.values()))
        }

        def tensor(name: str) -> Any:
            return handles[where[name]].get_slice(name)

        if dtype is None:
            embedding = next(
                (n for n in where if n.endswith("embed_tokens.weight") or n.endswith("embeddings.weight")), None
            )
            stored = tensor(embedding or next(iter(where))).get_dtype()
            dtype = _SAFETENSORS_DTYPES.get(stored, "float32")
        model = build_model(config, canonical_dtype(dtype))
        shapes = model.tensor_shapes()
        missing = [name for name in shapes if name not in where]
        if missing:
            raise MissingTensorError(
                f"{directory}: tensor {missing[0]!r} is missing ({len(missing)} missing in all) for {model.name}"
            )
        for name, shape in shapes.items():
            stored_shape = tuple(tensor(name).get_shape())
            if stored_shape != tuple(shape):
                raise ShapeMismatchError(
                    f"{directory}: tensor {name!r} has shape {stored_shape}, the config implies {tuple(shape)}"
                )
        shardings: Mapping[str, NamedSharding] | None = None
        if mesh is not None:
            devices = mesh_axis_size(mesh, model_axis)
            specs = model.partition_specs()
            for name, shape in shapes.items():
                _check_split(name, shape, specs[name], devices)
            shardings = weight_shardings(specs, mesh, model_axis)  # type: ignore[assignment]
        model.params = {
            name: _read(tensor(name), shape, model.dtype, None if shardings is None else shardings[name])
            for name, shape in shapes.items()
        }
    return model


def _read(source: Any, shape: tuple[int, ...], dtype: Any, sharding: NamedSharding | None) -> jax.Array:
    """One tensor as ``dtype``: whole on the default device, or shard by shard onto ``sharding``."""

    def host_slice(index: tuple[slice, ...]) -> np.ndarray:
        with jax.default_device(jax.devices("cpu")[0]):
            return np.asarray(source[index]).astype(dtype)

    full = tuple(slice(None) for _ in shape)
    if sharding is None:
        return jnp.asarray(host_slice(full))
    return jax.make_array_from_callback(
        tuple(shape), sharding, lambda index: host_slice(tuple(index) if index else full)
    )
