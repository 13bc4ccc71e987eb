"""The tiny checkpoints' tokenizer and chat template (scripts/save_tiny_checkpoint.py), without torch."""

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "save_tiny_checkpoint.py"
_spec = importlib.util.spec_from_file_location("save_tiny_checkpoint_text", _SCRIPT)
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)

save_tiny_tokenizer = script.save_tiny_tokenizer
EOS_TOKEN_ID: int = script.EOS_TOKEN_ID
