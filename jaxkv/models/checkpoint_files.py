"""The files of a checkpoint directory, read without trusting their names or sizes.

Every file read (``config.json``, the index, each ``*.safetensors``, the tokenizer's) is a regular file
(no FIFO, device or directory: a FIFO would block the read) inside the checkpoint
directory: a name in the index is a relative path without ``..``, and its target,
symlinks followed, stays under the directory, or under the repository folder of a
Hugging Face hub cache snapshot (``models--org--name/snapshots/<revision>``, whose
files are symlinks into ``../../blobs``). JSON files are read with a size bound;
a malformed one (too deep, not UTF-8, not an object) is a
:class:`~jaxkv.models.checkpoint_errors.CheckpointError` naming it.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from jaxkv.models.checkpoint_errors import BadWeightsError, CheckpointError, UnsafePathError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
INDEX = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20
"""``config.json`` is refused above 1 MiB (released ones are a few KiB)."""
MAX_INDEX_BYTES = 64 << 20
"""The shard index is refused above 64 MiB (one entry per tensor)."""


def checkpoint_root(directory: Path) -> Path:
    """Where the directory's files may resolve to: the directory itself, or the repository
    folder of a hub cache snapshot (see the module doc)."""
    resolved = directory.resolve()
    return resolved.parent.parent if resolved.parent.name == "snapshots" else resolved


def confined_file(directory: Path, name: object, what: str) -> Path:
    """``directory / name`` if ``name`` is a relative path whose target is a regular file
    under :func:`checkpoint_root`; :class:`UnsafePathError` naming ``what`` otherwise."""
    if not isinstance(name, str) or not name or "\x00" in name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise UnsafePathError(f"{what}: file name {name!r:.200} is not a relative path inside {directory}")
    path = directory / name
    resolved, root = path.resolve(), checkpoint_root(directory)
    if not resolved.is_relative_to(root):
        raise UnsafePathError(f"{what}: {path} resolves to {resolved}, outside the checkpoint directory {root}")
    try:
        mode = os.stat(resolved).st_mode
    except OSError as err:
        raise CheckpointError(f"{what}: cannot read {path}: {err}") from None
    if not stat.S_ISREG(mode):
        raise UnsafePathError(f"{what}: {path} is not a regular file")
    return path


def read_bytes(path: Path, limit: int) -> bytes:
    """The contents of the regular file ``path`` of at most ``limit`` bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO swapped in would not block
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(f"{path} is not a regular file")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path} is larger than {limit:,} bytes")
    return data


def read_json(path: Path, limit: int) -> Any:
    """The JSON value of the regular file ``path`` of at most ``limit`` bytes."""
    data = read_bytes(path, limit)
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path} is not valid JSON: {type(err).__name__}: {err}"[:400]) from None


def read_config(directory: Path) -> dict[str, Any]:
    """The directory's ``config.json``, a JSON object; :class:`CheckpointError` otherwise."""
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint directory {str(directory)!r} does not exist (a local path only)")
    config = read_json(confined_file(directory, CONFIG, CONFIG), MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise CheckpointError(f"{directory / CONFIG} must hold a JSON object, got {type(config).__name__}")
    return config


def eos_token_ids(path: str | os.PathLike[str]) -> tuple[int, ...]:
    """The end-of-sequence ids of the checkpoint in ``path``: ``eos_token_id`` of its
    ``generation_config.json`` (what generation reads first), else of its ``config.json``;
    one id or a list of them, each below the config's ``vocab_size``; none when neither names any."""
    directory = Path(path)
    for name in (GENERATION_CONFIG, CONFIG):
        if not (directory / name).exists():
            continue
        file = confined_file(directory, name, name)
        value = read_json(file, MAX_CONFIG_BYTES)
        value = value.get("eos_token_id") if isinstance(value, dict) else None
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        vocab_size = _vocab_size(read_config(directory))
        if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids):
            raise CheckpointError(
                f"{file}: eos_token_id must be an id or a list of ids below the vocabulary's {vocab_size:,}, "
                f"got {value!r:.200}"
            )
        return tuple(ids)
    return ()


def _vocab_size(config: dict[str, Any]) -> int:
    """``vocab_size`` of a config (or of its ``text_config``): what every token id stays below."""
    text = config.get("text_config")
    size = (text if isinstance(text, dict) else config).get("vocab_size")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise CheckpointError(f"config.json: vocab_size must be a positive int, got {size!r:.80}")
    return size


def open_safetensors(file: Path, framework: str = "numpy") -> Any:
    """``safe_open`` of one weights file; a truncated or corrupt one is a :class:`BadWeightsError` naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(file), framework=framework)
    except (SafetensorError, OSError, ValueError) as err:
        raise BadWeightsError(f"cannot read the weights file {file}: {err}") from None


def tensor_files(directory: Path) -> dict[str, Path]:
    """Which ``*.safetensors`` file holds each tensor: the index's ``weight_map`` when there
    is one, otherwise every safetensors file's own header (all files confined, see the module doc)."""
    if os.path.lexists(directory / INDEX):
        index = read_json(confined_file(directory, INDEX, INDEX), MAX_INDEX_BYTES)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{directory / INDEX} has no weight_map object")
        files: dict[str, Path] = {}
        for file in weight_map.values():
            if not isinstance(file, str) or file not in files:
                files[file] = confined_file(directory, file, INDEX)  # refuses a non-string first
        return {name: files[file] for name, file in weight_map.items()}
    paths = sorted(directory.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{directory} has no *.safetensors file")
    where: dict[str, Path] = {}
    for path in paths:
        file = confined_file(directory, path.name, path.name)
        with open_safetensors(file) as handle:
            where |= dict.fromkeys(handle.keys(), file)
    return where
