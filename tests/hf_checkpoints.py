"""Tiny random Hugging Face checkpoints and transformers' logits: the oracle of the model tests.

The checkpoints are those of ``scripts/save_tiny_checkpoint.py`` (one home for their
configs); tests that use this module skip without transformers and torch.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("torch")
pytest.importorskip("transformers")

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "save_tiny_checkpoint.py"
_spec = importlib.util.spec_from_file_location("save_tiny_checkpoint", _SCRIPT)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

FAMILIES: tuple[str, ...] = tiny.FAMILIES
WINDOW: int = tiny.WINDOW
save_tiny_checkpoint = tiny.save_tiny_checkpoint


def hf_logits(model: Any, tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits ``(L, vocab)`` of one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


DENSE_ATOL = 1e-4
"""Float32 logits of jaxkv's dense forward against transformers' (max seen: ~4e-6)."""


def dense_difference(family: str, directory: Path, length: int = 40, seed: int = 0) -> float:
    """Save a tiny ``family`` checkpoint to ``directory``, load it with jaxkv, and return the
    largest difference between jaxkv's dense logits and transformers' over a random sequence."""
    import jax.numpy as jnp

    from jaxkv.models.checkpoint import load_pretrained

    hf = save_tiny_checkpoint(family, directory)
    model = load_pretrained(directory)
    tokens = np.random.default_rng(seed).integers(0, model.vocab_size, length).tolist()
    ours = np.asarray(model.dense(model.params, jnp.asarray([tokens]))[0])
    return float(np.abs(ours - hf_logits(hf, tokens)).max())


ENGINE_ATOL = 1e-4
"""Float32 logits of every token the engine generated against transformers' over the same
sequence (max seen: ~5e-6, on one device and on a 2-device mesh)."""
NEAR_TIE = 1e-3
"""A transformers top-2 margin below this is a near tie: either token is a correct greedy pick."""


def shared_prefix_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts longer than the window and than several 16-token blocks: three share a
    37-token prefix (it ends mid-block) with tails of 5 to 19 tokens; one stands alone."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, 37).tolist()
    tails = [rng.integers(0, vocab_size, n).tolist() for n in (5, 12, 19)]
    return [prefix + tail for tail in tails] + [rng.integers(0, vocab_size, 45).tolist()]


def check_against_transformers(hf: Any, outputs: Any) -> float:
    """Assert every output token of ``outputs`` (engine ``RequestOutput`` s with logits) is
    transformers' greedy pick unless its top-2 margin is a near tie, and return the largest
    logit difference, transformers run once per request over prompt + outputs."""
    worst = 0.0
    for out in outputs:
        prompt, generated = list(out.prompt_token_ids), list(out.output_token_ids)
        reference = hf_logits(hf, prompt + generated[:-1])[len(prompt) - 1 :]
        assert out.logits.shape == reference.shape
        worst = max(worst, float(np.abs(out.logits - reference).max()))
        top2 = np.sort(reference, axis=-1)[:, -2:]
        decided = top2[:, 1] - top2[:, 0] > NEAR_TIE
        assert np.array_equal(np.asarray(generated)[decided], reference.argmax(-1)[decided]), out.request_id
    return worst


NEW_TOKENS = 10
MAX_MODEL_LEN = 128


def host_tier(store: str = "write_through") -> Any:
    """A 1 MiB host tier storing by ``store`` (write-through: every full block as it is written)."""
    from jaxkv.serving.offload_connector import OffloadConfig

    return OffloadConfig(1 << 20, store=store)


def serve_against_transformers(family: str, directory: Path, *, memory_bytes: int, **engine_kwargs: Any) -> dict:
    """Save a tiny ``family`` checkpoint, serve :func:`shared_prefix_prompts` twice with one
    engine (the second pass hits the prefix cache), check both passes against transformers
    (:func:`check_against_transformers`) and return what happened: the largest logit
    difference, cached tokens of each pass, preemptions and host-tier loads."""
    from jaxkv.device.metadata import Buckets
    from jaxkv.serving.engine import Engine

    hf = save_tiny_checkpoint(family, directory)
    engine = Engine.from_pretrained(
        directory,
        memory_bytes=memory_bytes,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        buckets=Buckets((64,), (4,), (MAX_MODEL_LEN // 16,)),
        **engine_kwargs,
    )
    prompts = shared_prefix_prompts(engine.model.vocab_size)
    passes = [engine.generate(prompts, NEW_TOKENS, return_logits=True) for _ in range(2)]
    audit = engine.audit()
    assert audit.device_blocks_leaked == audit.host_blocks_leaked == 0
    return {
        "max_abs_diff": max(check_against_transformers(hf, p.outputs) for p in passes),
        "cached": [sum(o.num_cached_tokens for o in p.outputs) for p in passes],
        "preemptions": sum(p.num_preemptions for p in passes),
        "host_loaded_tokens": engine.connector.stats.num_loaded_tokens if engine.connector else 0,
    }
