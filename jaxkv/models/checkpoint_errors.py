"""The errors of loading a checkpoint directory: one base, a subclass per kind of refusal."""

from __future__ import annotations

from jaxkv.errors import JaxkvError


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


class ContextLengthError(CheckpointError):
    """``max_model_len`` exceeds the positions the checkpoint's config serves."""


class UnsafePathError(CheckpointError):
    """A checkpoint file is outside the checkpoint directory, or not a regular file."""


class BadWeightsError(CheckpointError):
    """A tensor holds NaN or Inf, or a file cannot be read (truncated, corrupt)."""
