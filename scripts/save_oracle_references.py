"""Regenerate ``tests/oracle/``: the tiny checkpoints of the five families and transformers'
outputs on them, the references the model tests compare jaxkv with.

    python scripts/save_oracle_references.py            # rewrite tests/oracle
    python scripts/save_oracle_references.py --out DIR  # somewhere else

Needs transformers and torch (the ``oracle`` extra, torch's CPU wheel); the test suite
itself does not: it reads the files this writes. Per family, ``tests/oracle/FAMILY/``
holds the checkpoint exactly as transformers saves it (``config.json``,
``generation_config.json``, ``model.safetensors``; :mod:`save_tiny_checkpoint`'s seeded
random weights) and ``reference.npz``:

- ``dense_tokens`` ``(L,)`` and ``dense_logits`` ``(L, vocab)``: transformers' float32
  logits over one random sequence;
- ``prompt_K`` and ``greedy_K`` / ``logits_K`` ``(NEW_TOKENS, vocab)`` for every prompt of
  :data:`PROMPT_SETS`: transformers' greedy continuation and the logits each token was
  picked from.

``tests/test_oracle_references.py`` (the ``oracle`` marker, run where transformers is
installed) checks that these files are what transformers computes now.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
from absl import app, flags

from jaxkv.commands.cli import exit_error, flags_parser

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from save_tiny_checkpoint import CHECKPOINT_FILES, FAMILIES, ORACLE_DIR, TINY_SIZES, WINDOW, save_tiny_checkpoint

VOCAB_SIZE: int = TINY_SIZES["vocab_size"]
NEW_TOKENS = 10
DENSE_LENGTH = 5 * WINDOW
"""Past the tiny Gemma-3's window several times over."""


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts longer than the window and than several 16-token blocks: three share a
    37-token prefix (it ends mid-block) with tails of 5 to 19 tokens; one stands alone."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, VOCAB_SIZE, 37).tolist()
    tails = [rng.integers(0, VOCAB_SIZE, n).tolist() for n in (5, 12, 19)]
    return [prefix + tail for tail in tails] + [rng.integers(0, VOCAB_SIZE, 45).tolist()]


def long_prompts(seed: int = 0) -> list[list[int]]:
    """Four ~100-token prompts: served one at a time, they overflow a small device pool."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB_SIZE, n).tolist() for n in (100, 90, 110, 95)]


def dense_tokens(seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB_SIZE, DENSE_LENGTH).tolist()


PROMPT_SETS = {"shared_prefix": shared_prefix_prompts, "long": long_prompts}
"""The prompts whose greedy continuations are stored, by the name tests ask for."""


def all_prompts() -> list[list[int]]:
    return [prompt for make in PROMPT_SETS.values() for prompt in make()]


def transformers_logits(model: Any, tokens: list[int]) -> np.ndarray:
    """transformers' float32 logits ``(L, vocab)`` of one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def greedy_continuation(model: Any, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], np.ndarray]:
    """transformers' greedy ``new_tokens`` after ``prompt`` and the logits each came from,
    one full forward per token (no KV cache: the oracle is the plain forward)."""
    tokens = list(prompt)
    rows = []
    for _ in range(new_tokens):
        row = transformers_logits(model, tokens)[-1]
        rows.append(row)
        tokens.append(int(row.argmax()))
    return tokens[len(prompt) :], np.stack(rows)


def references(model: Any) -> dict[str, np.ndarray]:
    """The arrays of ``reference.npz`` for one transformers model."""
    tokens = dense_tokens()
    arrays = {"dense_tokens": np.asarray(tokens, np.int32), "dense_logits": transformers_logits(model, tokens)}
    for k, prompt in enumerate(all_prompts()):
        greedy, logits = greedy_continuation(model, prompt)
        arrays[f"prompt_{k}"] = np.asarray(prompt, np.int32)
        arrays[f"greedy_{k}"] = np.asarray(greedy, np.int32)
        arrays[f"logits_{k}"] = logits
    return arrays


def save_family(family: str, out: Path) -> None:
    """Write ``out/family``: the seeded checkpoint and transformers' references on it."""
    import tempfile

    directory = out / family
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = save_tiny_checkpoint(family, scratch)
        for name in CHECKPOINT_FILES:
            shutil.copyfile(Path(scratch) / name, directory / name)
    np.savez_compressed(directory / "reference.npz", **references(model))


PROG = "save_oracle_references.py"
FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags, defined only when it runs (the tests import its functions)."""
    flags.DEFINE_string("out", str(ORACLE_DIR), "directory to write (one folder per family)")
    flags.DEFINE_list("families", list(FAMILIES), "families to write")


def main(argv: list[str]) -> None:
    unknown = sorted(set(FLAGS.families) - set(FAMILIES))
    if unknown:
        exit_error(PROG, f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as err:
        exit_error(PROG, f"needs transformers and torch (pip install '.[oracle]'): {err}")
    for family in FLAGS.families:
        save_family(family, Path(FLAGS.out))
        print(f"wrote {Path(FLAGS.out) / family}", flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main, flags_parser=flags_parser(PROG))
