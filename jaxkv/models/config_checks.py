"""Checks of a checkpoint's ``config.json`` and of the load's arguments, before anything is built.

A model builder trusts its config: ``num_hidden_layers: 1000000000`` would have it list
a billion layers' tensors, and zero heads divide by zero. So every size field the
builders read must be a positive int within :data:`SIZE_LIMITS` (in the config and in
a multimodal config's ``text_config``), the weights' dtype a float type, and
``max_model_len`` within the positions the config's RoPE covers. Each refusal is a
:class:`~jaxkv.models.checkpoint_errors.CheckpointError` naming the field and value.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from jaxkv.ints import is_int
from jaxkv.models.checkpoint_errors import CheckpointError, ContextLengthError
from jaxkv.specs import SpecError, canonical_dtype

WEIGHT_DTYPES = ("float32", "bfloat16", "float16", "float64")
"""The dtypes weights may be cast to (``dtype`` of a load)."""

_LAYERS = 1 << 12
_WIDTH = 1 << 20
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": 1 << 24,
    "hidden_size": 1 << 17,
    "intermediate_size": _WIDTH,
    "num_hidden_layers": _LAYERS,
    "num_attention_heads": _LAYERS,
    "num_key_value_heads": _LAYERS,
    "head_dim": _LAYERS,
    "max_position_embeddings": 1 << 27,
    "sliding_window": 1 << 27,
    "sliding_window_pattern": _LAYERS,
    "query_pre_attn_scalar": _WIDTH,
    "moe_intermediate_size": _WIDTH,
    "shared_expert_intermediate_size": _WIDTH,
    "moe_shared_expert_intermediate_size": _WIDTH,
    "moe_latent_size": _WIDTH,
    "num_experts": _LAYERS,
    "n_routed_experts": _LAYERS,
    "num_experts_per_tok": _LAYERS,
    "n_group": _LAYERS,
    "topk_group": _LAYERS,
    "linear_num_key_heads": _LAYERS,
    "linear_num_value_heads": _LAYERS,
    "linear_key_head_dim": _LAYERS,
    "linear_value_head_dim": _LAYERS,
    "linear_conv_kernel_dim": 64,
    "mamba_num_heads": _LAYERS,
    "mamba_head_dim": _LAYERS,
    "n_groups": _LAYERS,
    "ssm_state_size": _LAYERS,
    "conv_kernel": 64,
}
"""Each size field a builder reads, with its upper bound (well above released models')."""

EXTENDING_ROPE_TYPES = ("linear", "llama3", "yarn", "dynamic")
"""RoPE scalings that stretch ``original_max_position_embeddings`` by ``factor``."""


def check_dtype(dtype: Any) -> str:
    """The canonical name of ``dtype`` if weights may be cast to it (:data:`WEIGHT_DTYPES`)."""
    try:
        name = canonical_dtype(dtype)
    except (SpecError, TypeError, ValueError):
        name = None
    if name not in WEIGHT_DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not a float dtype for weights; valid: {', '.join(WEIGHT_DTYPES)}")
    return name


def _configs(config: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """The config and its ``text_config`` (a multimodal model's language model), with where they are."""
    yield "config.json", config
    text = config.get("text_config")
    if text is not None:
        if not isinstance(text, Mapping):
            raise CheckpointError(f"config.json's text_config must be an object, got {text!r:.80}")
        yield "config.json text_config", text


def check_sizes(config: Mapping[str, Any]) -> None:
    """Refuse a size field that is not a positive int within :data:`SIZE_LIMITS` (null is
    left to the builder's default or refusal)."""
    for where, fields in _configs(config):
        for name, limit in SIZE_LIMITS.items():
            value = fields.get(name)
            if value is not None and (not is_int(value) or not 0 < value <= limit):
                raise CheckpointError(f"{where}: {name}={value!r:.80} must be a positive int <= {limit:,}")


def _rope_parameter_sets(config: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Every RoPE parameter dict of the config: ``rope_scaling``, ``rope_parameters`` or its
    per-layer-type entries (Gemma-3)."""
    for name in ("rope_scaling", "rope_parameters"):
        value = config.get(name)
        if isinstance(value, Mapping):
            nested = [v for v in value.values() if isinstance(v, Mapping)]
            yield from nested or [value]


def max_positions(config: Mapping[str, Any]) -> int | None:
    """The most positions the config's RoPE serves: ``max_position_embeddings``, or
    ``factor * original_max_position_embeddings`` of an extending scaling
    (:data:`EXTENDING_ROPE_TYPES`) when larger; None when the config names no limit."""
    text = config.get("text_config")
    fields = text if isinstance(text, Mapping) else config
    limit = fields.get("max_position_embeddings")
    if limit is None:
        return None
    for rope in _rope_parameter_sets(fields):
        rope_type = rope.get("rope_type", rope.get("type"))
        original, factor = rope.get("original_max_position_embeddings"), rope.get("factor")
        if rope_type in EXTENDING_ROPE_TYPES and is_int(original) and isinstance(factor, int | float):
            limit = max(limit, int(original * factor))
    return int(limit)


def check_max_model_len(config: Mapping[str, Any], max_model_len: int) -> None:
    """Refuse a ``max_model_len`` beyond :func:`max_positions` (the model was not trained there)."""
    limit = max_positions(config)
    if limit is not None and max_model_len > limit:
        raise ContextLengthError(
            f"max_model_len={max_model_len:,} exceeds the {limit:,} positions of config.json "
            f"(max_position_embeddings, or factor * original_max_position_embeddings of a "
            f"{'/'.join(EXTENDING_ROPE_TYPES)} rope scaling)"
        )
