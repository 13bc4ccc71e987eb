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

Nothing is trusted before it is checked, in this order: the files' names and kinds
(:mod:`jaxkv.models.checkpoint_files`), the config's sizes, ``dtype`` and
``max_model_len`` (:mod:`jaxkv.models.config_checks`), every tensor's name and
shape against the safetensors headers (so the weights' total size too); then each
tensor as it is read (a NaN or Inf, a truncated file). Every refusal is a
:class:`~jaxkv.models.checkpoint_errors.CheckpointError` naming the file, field or
tensor. A multimodal checkpoint whose language model jaxkv builds
(:data:`jaxkv.models.registry.MULTIMODAL`, e.g. ``Gemma3ForConditionalGeneration``)
loads that model from its ``text_config`` and its ``language_model`` weights; the
vision tower is not read.
"""

from __future__ import annotations

import contextlib
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
from jaxkv.models.checkpoint_errors import (
    BadWeightsError,
    CheckpointError,
    ContextLengthError,
    MissingTensorError,
    ShapeMismatchError,
    UnknownArchitectureError,
    UnsafePathError,
)
from jaxkv.models.checkpoint_files import CONFIG, INDEX, eos_token_ids, open_safetensors, read_config, tensor_files
from jaxkv.models.config_checks import check_dtype, check_max_model_len, check_sizes

__all__ = [
    "CONFIG",
    "INDEX",
    "BadWeightsError",
    "CheckpointError",
    "ContextLengthError",
    "MissingTensorError",
    "ShapeMismatchError",
    "UnknownArchitectureError",
    "UnsafePathError",
    "builder_of",
    "eos_token_ids",
    "language_model_config",
    "load_pretrained",
    "read_config",
    "tensor_files",
]

_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_MODEL_PREFIX = "model."
_TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
"""Where a multimodal checkpoint keeps its language model's ``model.*`` tensors (the Hub's
files and transformers' saves; transformers 5 in memory), tried in this order."""
_TEXT_HEADS = ("language_model.lm_head.", "lm_head.")


def _architecture(config: Mapping[str, Any]) -> Any:
    architectures = config.get("architectures")
    return architectures[0] if isinstance(architectures, list) and architectures else None


def builder_of(config: Mapping[str, Any]) -> Any:
    """The class that builds ``config``'s ``architectures[0]`` (a multimodal one's language
    model); :class:`UnknownArchitectureError` if none does."""
    architecture = _architecture(config)
    try:
        return registry.builder(registry.MULTIMODAL.get(architecture, architecture))
    except (KeyError, TypeError):
        known = [*registry.ARCHITECTURES, *registry.MULTIMODAL]
        raise UnknownArchitectureError(
            f"unknown architecture {architecture!r:.200}; known: {', '.join(known)}"
        ) from None


def language_model_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config the builder reads: a multimodal config's ``text_config`` (its tied
    embeddings defaulting to the outer config's), else ``config`` itself."""
    architecture = _architecture(config)
    if architecture not in registry.MULTIMODAL:
        return dict(config)
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise CheckpointError(f"config.json of {architecture} has no text_config object")
    tied = config.get("tie_word_embeddings", True)
    return {"tie_word_embeddings": tied, **text, "architectures": [registry.MULTIMODAL[architecture]]}


def _build_model(config: Mapping[str, Any], dtype: Any) -> tuple[Any, dict[str, tuple[int, ...]]]:
    """An unloaded model of ``config`` (its sizes checked; no weights yet) and the shapes of
    the tensors it reads; a config the builder cannot read (a missing field, a wrong type,
    a size left null) is a :class:`CheckpointError` naming what failed."""
    cls = builder_of(config)
    try:
        model = cls(language_model_config(config), dtype)
        return model, model.tensor_shapes()
    except JaxkvError:
        raise
    except KeyError as err:
        raise CheckpointError(f"config.json of {cls.__name__} lacks the field {err.args[0]!r}") from None
    except (TypeError, ValueError, ArithmeticError, IndexError, AttributeError, StopIteration, RecursionError) as err:
        raise CheckpointError(
            f"config.json of {cls.__name__} is not usable: {type(err).__name__}: {err}"[:400]
        ) from None


def _stored_names(config: Mapping[str, Any], name: str) -> tuple[str, ...]:
    """The names a model tensor may have in the files (a multimodal checkpoint's prefixes)."""
    if _architecture(config) not in registry.MULTIMODAL:
        return (name,)
    for ours, theirs in ((_MODEL_PREFIX, _TEXT_PREFIXES), ("lm_head.", _TEXT_HEADS)):
        if name.startswith(ours):
            return tuple(prefix + name.removeprefix(ours) for prefix in theirs)
    return (name,)


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
    max_model_len: int | None = None,
) -> Any:
    """The model saved in the checkpoint directory ``path``, its ``params`` loaded (see the
    module doc); ``max_model_len``, when given, is checked against the config's positions."""
    directory = Path(path)
    config = read_config(directory)
    builder_of(config)  # an unknown architecture is refused before any file is opened
    if dtype is not None:
        dtype = check_dtype(dtype)
    check_sizes(config)
    if max_model_len is not None:
        check_max_model_len(config, max_model_len)
    where = tensor_files(directory)
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(open_safetensors(file, "flax")) for file in sorted(set(where.values()))}

        def header(name: str) -> Any:
            return handles[where[name]].get_slice(name)

        if dtype is None:
            embedding = next(
                (n for n in where if n.endswith("embed_tokens.weight") or n.endswith("embeddings.weight")), None
            )
            stored = header(embedding or next(iter(where))).get_dtype()
            dtype = _SAFETENSORS_DTYPES.get(stored, "float32")
        model, shapes = _build_model(config, dtype)
        found = {name: next((n for n in _stored_names(config, name) if n in where), None) for name in shapes}
        missing = [name for name, stored in found.items() if stored is None]
        if missing:
            raise MissingTensorError(
                f"{directory}: tensor {missing[0]!r} is missing ({len(missing)} missing in all) for {model.name}"
            )
        stored_name = {name: stored for name, stored in found.items() if stored is not None}
        for name, shape in shapes.items():
            stored_shape = tuple(header(stored_name[name]).get_shape())
            if stored_shape != tuple(shape):
                raise ShapeMismatchError(
                    f"{directory}: tensor {stored_name[name]!r} has shape {stored_shape}, "
                    f"the config implies {tuple(shape)}"
                )
        shardings: Mapping[str, NamedSharding] | None = None
        if mesh is not None:
            devices = mesh_axis_size(mesh, model_axis)
            specs = model.partition_specs()
            for name, shape in shapes.items():
                _check_split(name, shape, specs[name], devices)
            shardings = weight_shardings(specs, mesh, model_axis)  # type: ignore[assignment]
        model.params = {
            name: _read(
                _Source(where[stored_name[name]], stored_name[name], header(stored_name[name])),
                shape,
                model.dtype,
                None if shardings is None else shardings[name],
            )
            for name, shape in shapes.items()
        }
    return model


class _Source:
    """One stored tensor: its file, its name there and its safetensors slice."""

    def __init__(self, file: Path, name: str, tensor: Any) -> None:
        self.file, self.name, self.tensor = file, name, tensor

    def read(self, index: tuple[slice, ...], dtype: Any) -> np.ndarray:
        """The slice ``index`` as ``dtype``; a truncated file or a NaN or Inf is a :class:`BadWeightsError`."""
        from safetensors import SafetensorError

        try:
            with jax.default_device(jax.devices("cpu")[0]), np.errstate(over="ignore", invalid="ignore"):
                values = np.asarray(self.tensor[index]).astype(dtype)  # an overflow is refused below
        except (SafetensorError, OSError, ValueError) as err:
            raise BadWeightsError(f"{self.file}: cannot read tensor {self.name!r}: {err}") from None
        if not np.isfinite(values).all():
            raise BadWeightsError(f"{self.file}: tensor {self.name!r} holds NaN or Inf (as {np.dtype(dtype).name})")
        return values


def _read(source: _Source, shape: tuple[int, ...], dtype: Any, sharding: NamedSharding | None) -> jax.Array:
    """One tensor as ``dtype``: whole on the default device, or shard by shard onto ``sharding``."""
    full = tuple(slice(None) for _ in shape)
    if sharding is None:
        return jnp.asarray(source.read(full, dtype))
    return jax.make_array_from_callback(
        tuple(shape), sharding, lambda index: source.read(tuple(index) if index else full, dtype)
    )
