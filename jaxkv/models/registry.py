"""Which class builds each Hugging Face architecture (``architectures[0]`` of ``config.json``).

Classes are imported on first use, so importing the registry loads no model code. A
builder is a class called as ``cls(config: dict, dtype)`` whose instance declares
``tensor_shapes()`` (every checkpoint tensor it reads, by name) and ``partition_specs()``
and receives its weights in ``params`` (:func:`jaxkv.models.checkpoint.load_pretrained`).
"""

from __future__ import annotations

import importlib
from typing import Any

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "jaxkv.models.llama:Llama",
    "Qwen3ForCausalLM": "jaxkv.models.llama:Qwen3",
    "Gemma3ForCausalLM": "jaxkv.models.gemma3:Gemma3",
    "Qwen3NextForCausalLM": "jaxkv.models.qwen3_next:Qwen3Next",
    "NemotronHForCausalLM": "jaxkv.models.nemotron_h:NemotronH",
}
"""Architecture name to ``module:Class`` of its builder."""

MULTIMODAL: dict[str, str] = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
"""A multimodal architecture whose language model jaxkv serves, to the architecture of that
model: its config is the ``text_config``, its tensors the ``language_model`` ones
(:mod:`jaxkv.models.checkpoint`); the vision tower is not loaded."""


def builder(architecture: str) -> Any:
    """The class that builds ``architecture``; ``KeyError`` when it is not in :data:`ARCHITECTURES`."""
    module, name = ARCHITECTURES[architecture].split(":")
    return getattr(importlib.import_module(module), name)
