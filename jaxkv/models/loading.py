"""The model a command-line tool serves: a Hugging Face checkpoint directory
(``--checkpoint``) or a tiny seeded model by name (``--model``)."""

from __future__ import annotations

from typing import Any, NamedTuple

from jax.sharding import Mesh

from jaxkv.models.checkpoint import load_pretrained
from jaxkv.models.tiny import TinyLM, get_model_config
from jaxkv.specs import AttentionSpec


class LoadedModel(NamedTuple):
    """A model with what a tool prints about it."""

    model: Any
    name: str
    """``DIR: architecture`` for a checkpoint, the model's name otherwise."""
    attention_dtype: str
    """The dtype of its attention layers' KV (recurrent states may be float32)."""


def load_model(
    checkpoint: str | None,
    model_name: str,
    *,
    dtype: str | None,
    seed: int,
    mesh: Mesh | None = None,
    max_model_len: int | None = None,
) -> LoadedModel:
    """The checkpoint in directory ``checkpoint`` (its weights placed onto ``mesh``, its
    positions checked against ``max_model_len``) or, without one, the tiny model
    ``model_name`` seeded with ``seed``; weights in ``dtype`` (None: the model's own)."""
    if checkpoint:
        model = load_pretrained(checkpoint, dtype=dtype, mesh=mesh, max_model_len=max_model_len)
        name = f"{checkpoint}: {model.name}"
    else:
        model = TinyLM(get_model_config(model_name, dtype=dtype), seed=seed)
        name = model_name
    specs = model.layer_specs().values()
    return LoadedModel(model, name, next(s.dtype for s in specs if isinstance(s, AttentionSpec)))
