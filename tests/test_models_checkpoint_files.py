"""A checkpoint's files read without trusting them: names confined to the directory,
regular files only, bounded JSON, truncated weights named (no torch needed)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from synthetic_checkpoints import write_checkpoint

from jaxkv.errors import JaxkvError
from jaxkv.models.checkpoint import BadWeightsError, CheckpointError, UnsafePathError, load_pretrained
from jaxkv.models.checkpoint_files import MAX_CONFIG_BYTES


def _index(directory, weight_map):
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _all_in(directory, file):
    """An index sending every tensor of the written checkpoint to ``file``."""
    weights = write_checkpoint(directory)
    _index(directory, dict.fromkeys(weights, file))


@pytest.mark.parametrize("file", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "", 7])
def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path, file):
    _all_in(tmp_path / "ckpt", file)
    with pytest.raises(UnsafePathError, match="relative path inside"):
        load_pretrained(tmp_path / "ckpt")


def test_a_symlink_out_of_the_directory_is_refused(tmp_path):
    write_checkpoint(tmp_path / "elsewhere")
    _all_in(tmp_path / "ckpt", "shard.safetensors")
    (tmp_path / "ckpt" / "shard.safetensors").symlink_to(tmp_path / "elsewhere" / "model.safetensors")
    with pytest.raises(UnsafePathError, match="outside the checkpoint directory"):
        load_pretrained(tmp_path / "ckpt")


def test_a_hub_cache_snapshot_loads_through_its_symlinks_into_blobs(tmp_path):
    repo = tmp_path / "models--org--tiny"
    weights = write_checkpoint(repo / "blobs")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (snapshot / name).symlink_to(os.path.join("..", "..", "blobs", name))
    model = load_pretrained(snapshot)
    assert all(np.array_equal(np.asarray(model.params[n]), w) for n, w in weights.items())


def test_a_fifo_is_refused_without_blocking(tmp_path):
    _all_in(tmp_path / "ckpt", "pipe.safetensors")
    os.mkfifo(tmp_path / "ckpt" / "pipe.safetensors")
    with pytest.raises(UnsafePathError, match="not a regular file"):
        load_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").unlink()
    os.mkfifo(tmp_path / "ckpt" / "config.json")
    with pytest.raises(UnsafePathError, match=r"config.json is not a regular file"):
        load_pretrained(tmp_path / "ckpt")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (" " * MAX_CONFIG_BYTES + "{}", "larger than"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ("{", "not valid JSON"),
    ],
)
def test_a_config_too_big_too_deep_or_not_an_object_is_refused(tmp_path, text, message):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_pretrained(tmp_path)


def test_a_truncated_weights_file_is_named(tmp_path):
    write_checkpoint(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(BadWeightsError, match=r"model.safetensors") as refused:
        load_pretrained(tmp_path)
    assert isinstance(refused.value, JaxkvError)


def test_an_index_without_a_weight_map_is_named(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["x"]}))
    with pytest.raises(CheckpointError, match="no weight_map object"):
        load_pretrained(tmp_path)
