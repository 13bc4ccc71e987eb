"""Serving a tiny Hugging Face checkpoint through the host tier, checked against transformers.

A recurrent model's prefix hit needs a state checkpoint besides the attention blocks;
four ~100-token prompts served one at a time overflow a small device pool, so their
blocks and checkpoints go out to the host tier and the second round loads them back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_checkpoints import NEW_TOKENS, check_against_transformers, long_prompts, save_tiny_checkpoint

HOST_BYTES = 8 << 20


def serve_through_host(
    family: str,
    directory: Path,
    *,
    memory_bytes: int,
    state_layout: str,
    checkpoint_share: float = 0.1,
    store: str = "on_eviction",
) -> dict[str, Any]:
    """Save a tiny ``family`` checkpoint, serve four prompts one at a time, twice, from a
    device pool of ``memory_bytes`` (states placed by ``state_layout``; with a state pool
    ``checkpoint_share`` of it for state checkpoints) and an 8 MiB host tier storing by
    ``store``; check every output against transformers and return the largest logit
    difference, cached tokens per run and the connector's stats."""
    from jaxkv.models.checkpoint import load_pretrained
    from jaxkv.planner import PlanOptions, StatePoolOptions
    from jaxkv.serving.engine import Engine, plan_for_model
    from jaxkv.serving.offload_connector import OffloadConfig

    reference = save_tiny_checkpoint(family, directory)
    model = load_pretrained(directory)
    pooled = state_layout == "state_pool"
    plan = plan_for_model(
        model,
        memory_bytes,
        max_model_len=128,
        max_num_seqs=2,
        options=PlanOptions(
            state_layout=state_layout,
            state_pool=StatePoolOptions(2, int(checkpoint_share * memory_bytes)) if pooled else None,
        ),
    )
    engine = Engine(model, plan, max_num_seqs=2, offload=OffloadConfig(HOST_BYTES, store=store))
    prompts = long_prompts()
    worst, cached = 0.0, []
    for _ in range(2):
        for prompt in prompts:
            run = engine.generate([prompt], NEW_TOKENS, return_logits=True)
            worst = max(worst, check_against_transformers(reference, run.outputs))
            cached.append(run.num_cached_prompt_tokens)
    audit = engine.audit()
    assert audit.device_blocks_leaked == audit.host_blocks_leaked == 0
    return {"max_abs_diff": worst, "cached": cached, "stats": engine.connector.stats}
