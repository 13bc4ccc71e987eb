"""The errors of step metadata, apart so the host block tables (:mod:`jaxkv.device.block_table`)
raise the same types as the builder (:mod:`jaxkv.device.metadata`) without importing JAX."""

from __future__ import annotations

from jaxkv.errors import JaxkvError


class MetadataError(JaxkvError, ValueError):
    """The scheduled batch cannot be turned into step metadata."""


class BlockIdError(MetadataError):
    """A block id (or the slot it gives) is out of range, not an int, missing, or the
    null block where data must go."""
