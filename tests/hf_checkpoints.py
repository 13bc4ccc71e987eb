"""Tiny Hugging Face checkpoints and transformers' outputs on them: the oracle of the model tests.

The checkpoints and transformers' logits are stored in ``tests/oracle/`` (written by
``scripts/save_oracle_references.py``, which has the prompts and the one home of their
configs in ``scripts/save_tiny_checkpoint.py``), so these tests need neither torch nor
transformers; ``test_oracle_references.py`` checks, where transformers is installed,
that the stored files are what it computes now.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "save_oracle_references.py"
_spec = importlib.util.spec_from_file_location("save_oracle_references", _SCRIPT)
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)

FAMILIES: tuple[str, ...] = oracle.FAMILIES
WINDOW: int = oracle.WINDOW
NEW_TOKENS: int = oracle.NEW_TOKENS
shared_prefix_prompts = oracle.shared_prefix_prompts
long_prompts = oracle.long_prompts
tiny = sys.modules["save_tiny_checkpoint"]
"""``scripts/save_tiny_checkpoint.py``: the tiny configs, for tests that build transformers models."""
save_tiny_tokenizer = tiny.save_tiny_tokenizer
hf_logits = oracle.transformers_logits


@dataclass(frozen=True)
class Reference:
    """transformers' outputs on one stored checkpoint: dense logits over one sequence, and
    the greedy continuation of every stored prompt with the logits each token came from."""

    dense_tokens: list[int]
    dense_logits: np.ndarray
    continuations: dict[tuple[int, ...], tuple[list[int], np.ndarray]]

    @classmethod
    def load(cls, path: Path) -> Reference:
        with np.load(path) as npz:
            count = sum(name.startswith("prompt_") for name in npz.files)
            continuations = {
                tuple(npz[f"prompt_{k}"].tolist()): (npz[f"greedy_{k}"].tolist(), npz[f"logits_{k}"])
                for k in range(count)
            }
            return cls(npz["dense_tokens"].tolist(), npz["dense_logits"], continuations)


def save_tiny_checkpoint(family: str, directory: Path) -> Reference:
    """Copy the stored tiny ``family`` checkpoint into ``directory``; returns transformers' outputs on it."""
    tiny.copy_stored_checkpoint(family, directory)
    return Reference.load(oracle.ORACLE_DIR / family / "reference.npz")


DENSE_ATOL = 1e-4
"""Float32 logits of jaxkv's dense forward against transformers' (max seen: ~4e-6)."""


def dense_difference(family: str, directory: Path) -> float:
    """Load the tiny ``family`` checkpoint with jaxkv and return the largest difference
    between jaxkv's dense logits and transformers' over the stored random sequence."""
    import jax.numpy as jnp

    from jaxkv.models.checkpoint import load_pretrained

    reference = save_tiny_checkpoint(family, directory)
    model = load_pretrained(directory)
    ours = np.asarray(model.dense(model.params, jnp.asarray([reference.dense_tokens]))[0])
    return float(np.abs(ours - reference.dense_logits).max())


ENGINE_ATOL = 1e-4
"""Float32 logits of every token the engine generated against transformers' over the same
sequence (max seen: ~5e-6, on one device and on a 2-device mesh)."""
NEAR_TIE = 1e-3
"""A transformers top-2 margin below this is a near tie: either token is a correct greedy pick."""


def check_against_transformers(reference: Reference, outputs: Any) -> float:
    """Assert every output token of ``outputs`` (engine ``RequestOutput`` s with logits) is
    transformers' greedy pick, and return the largest logit difference. Where the engine
    takes the other side of a near tie (top-2 margin below :data:`NEAR_TIE`) the stored
    continuation no longer applies, so the check of that request ends there."""
    worst = 0.0
    for out in outputs:
        greedy, logits = reference.continuations[tuple(out.prompt_token_ids)]
        generated = list(out.output_token_ids)
        assert len(generated) <= len(greedy) and out.logits.shape == (len(generated), logits.shape[1])
        for position, token in enumerate(generated):
            worst = max(worst, float(np.abs(out.logits[position] - logits[position]).max()))
            if token != greedy[position]:
                top2 = np.sort(logits[position])[-2:]
                assert top2[1] - top2[0] <= NEAR_TIE, (out.request_id, position, token, greedy[position])
                break
    return worst


MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 4
STEP_TOKENS = 64
"""The engine settings of :func:`serve_against_transformers`."""


def smallest_budget(family: str, directory: Path, state_layout: str | None) -> int:
    """The smallest ``memory_bytes`` an engine of :func:`serve_against_transformers` accepts
    for the tiny ``family`` checkpoint with ``state_layout``."""
    from kv_configs import smallest_accepted

    from jaxkv.models.checkpoint import load_pretrained
    from jaxkv.planner import PlanOptions

    save_tiny_checkpoint(family, directory)
    memory, _ = smallest_accepted(
        load_pretrained(directory),
        max_model_len=MAX_MODEL_LEN,
        options=PlanOptions(state_layout=state_layout),
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=STEP_TOKENS,
    )
    return memory


def host_tier(store: str = "write_through") -> Any:
    """A 1 MiB host tier storing by ``store`` (write-through: every full block as it is written)."""
    from jaxkv.serving.offload_connector import OffloadConfig

    return OffloadConfig(1 << 20, store=store)


def serve_against_transformers(
    family: str,
    directory: Path,
    *,
    memory_bytes: int,
    prompts: list[list[int]] | None = None,
    **engine_kwargs: Any,
) -> dict:
    """Load the tiny ``family`` checkpoint, serve ``prompts`` (default
    :func:`shared_prefix_prompts`; their continuations must be stored) twice with one
    engine (the second pass hits the prefix cache), check both passes against transformers
    (:func:`check_against_transformers`) and return what happened: the largest logit
    difference, cached tokens of each pass (in all and per prompt), the block size hits
    are multiples of, the plan, preemptions and host-tier loads (tokens and states)."""
    from jaxkv.device.metadata import Buckets
    from jaxkv.serving.engine import Engine

    reference = save_tiny_checkpoint(family, directory)
    engine = Engine.from_pretrained(
        directory,
        memory_bytes=memory_bytes,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=STEP_TOKENS,
        buckets=Buckets((STEP_TOKENS,), (MAX_NUM_SEQS,), (MAX_MODEL_LEN // 16,)),
        **engine_kwargs,
    )
    prompts = shared_prefix_prompts() if prompts is None else prompts
    passes = [engine.generate(prompts, NEW_TOKENS, return_logits=True) for _ in range(2)]
    audit = engine.audit()
    assert audit.device_blocks_leaked == audit.host_blocks_leaked == 0
    return {
        "max_abs_diff": max(check_against_transformers(reference, p.outputs) for p in passes),
        "cached": [sum(o.num_cached_tokens for o in p.outputs) for p in passes],
        "cached_per_prompt": [[o.num_cached_tokens for o in p.outputs] for p in passes],
        "hit_block_size": math.lcm(*(g.block_size for g in engine.manager.config.groups)),
        "kv_config": engine.manager.config,
        "preemptions": sum(p.num_preemptions for p in passes),
        "host_loaded_tokens": engine.connector.stats.num_loaded_tokens if engine.connector else 0,
        "host_loaded_states": engine.connector.stats.num_loaded_states if engine.connector else 0,
    }
