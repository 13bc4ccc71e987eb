"""A host tier that outlives its process: host blocks in a file mapping, and a journal of the keys they hold.

Two files. ``PATH`` holds the host blocks' bytes, mapped shared (``np.memmap``): a store
writes them into the page cache, which a killed process (SIGKILL included) leaves
behind. ``PATH.journal`` says which key each host block holds: a header (the
fingerprint of what wrote the file: model, dtype, block shape and count, hash algorithm
and seed), then one record per change, appended with one ``write``:

- *stored* ``(key, host block)``, with the block's parent hash and token ids where known
  (so the reloaded block is announced as the KV event a router indexes), written only
  once the block's bytes are in the mapping (the store has settled), so a block is
  findable only once its KV is written;
- *removed* ``key``, written before its host block can be written again.

Each record ends with a CRC-32 of itself. At start the journal is replayed up to its
first torn or corrupt record; that record and everything after it are dropped (never
loaded), and the journal is rewritten compacted (the live keys only, atomically; the
owner does the same past four records per host block: :meth:`PersistentHostTier.compact`). A
journal whose header does not match the fingerprint (another model, dtype, block size
or count, layout, hash algorithm or seed) is never read: the tier starts cold, with a
warning naming the mismatch, and both files are recreated. The host tier is a cache,
so starting cold loses nothing a request needs; refusing to start would leave a replica
down until someone deletes a file. One process holds the files at a time (an exclusive
``flock``, released by the kernel when the holder dies); another is refused.

Not covered: a crash of the machine itself (nothing is fsynced on the hot path; the
page cache is the durable medium here). Host-only (numpy, no JAX).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import zlib
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxkv.errors import JaxkvError

_log = logging.getLogger(__name__)

MAGIC = b"JAXKVHT1"
RECORDS_PER_BLOCK = 4
"""The journal is compacted once it holds more records than this per host block (plus slack)."""
_HEADER_LEN = struct.Struct("<I")
_RECORD = struct.Struct("<BHIBBH")  # op, group, host block, hash, parent and token counts; then those, then a CRC-32
_CRC = struct.Struct("<I")
_STORED, _REMOVED = 1, 2

Key = tuple[Hashable, int]
"""(block hash as bytes, group): the offloading catalog's key."""

BlockInfo = tuple[bytes | None, tuple[int, ...]]
"""A block's parent hash (None: the first block) and token ids: what its KV event carries."""


class PersistentTierError(JaxkvError, ValueError):
    """The persistent host tier's files cannot be used (held by another process, unreadable)."""


def _record(op: int, key: Key, host_block: int, info: BlockInfo | None = None) -> bytes:
    block_hash, group = key
    parent, tokens = info or (None, ())
    parent = parent or b""
    if not isinstance(block_hash, bytes) or len(block_hash) > 255 or len(parent) > 255:
        raise PersistentTierError(f"a persistent host tier keys blocks by hashes of <= 255 bytes, got {block_hash!r}")
    head = _RECORD.pack(op, group, host_block, len(block_hash), len(parent), len(tokens))
    body = head + block_hash + parent + struct.pack(f"<{len(tokens)}I", *tokens)
    return body + _CRC.pack(zlib.crc32(body))


class JournalState:
    """The live keys of a journal's records, applied as they come (a tier's replay at
    start, or a reader tailing another process's journal: :mod:`jaxkv.offload.peers`)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.live: dict[Key, int] = {}
        self.infos: dict[Key, BlockInfo] = {}
        self.version: dict[Key, int] = {}
        """Live key -> the number of the record that stored it (a key removed and stored again gets a new one)."""
        self._holder: dict[int, Key] = {}
        self._num_records = 0

    def apply(self, data: bytes | memoryview) -> int:
        """Apply the whole, valid records at the start of ``data``; how many bytes they took
        (the rest is a torn or corrupt tail, or a record still being written)."""
        pos = 0
        while pos + _RECORD.size <= len(data):
            op, group, host_block, hash_len, parent_len, num_tokens = _RECORD.unpack_from(data, pos)
            start = pos + _RECORD.size
            end = start + hash_len + parent_len + 4 * num_tokens
            if end + _CRC.size > len(data) or _CRC.unpack_from(data, end)[0] != zlib.crc32(data[pos:end]):
                break
            if op not in (_STORED, _REMOVED) or (op == _STORED and not 1 <= host_block <= self.num_blocks):
                break
            key: Key = (bytes(data[start : start + hash_len]), group)
            self._drop(key)
            if op == _STORED:
                prior = self._holder.get(host_block)  # a host block holds one key
                if prior is not None:
                    self._drop(prior)
                self.live[key], self._holder[host_block] = host_block, key
                self.version[key] = self._num_records
                if num_tokens:
                    parent = bytes(data[start + hash_len : start + hash_len + parent_len]) or None
                    tokens = struct.unpack_from(f"<{num_tokens}I", data, start + hash_len + parent_len)
                    self.infos[key] = (parent, tokens)
            self._num_records += 1
            pos = end + _CRC.size
        return pos

    def _drop(self, key: Key) -> None:
        old = self.live.pop(key, None)
        self.infos.pop(key, None)
        self.version.pop(key, None)
        if old is not None:
            self._holder.pop(old, None)


def header(fingerprint: dict[str, Any]) -> bytes:
    """A journal's header for a tier of ``fingerprint``."""
    text = json.dumps(fingerprint, sort_keys=True).encode()
    return MAGIC + _HEADER_LEN.pack(len(text)) + text + _CRC.pack(zlib.crc32(text))


def header_mismatch(data: bytes, fingerprint: dict[str, Any]) -> str | None:
    """Why the journal ``data`` starts with no header of ``fingerprint`` (None: it does)."""
    start = len(MAGIC) + _HEADER_LEN.size
    if len(data) < start or data[: len(MAGIC)] != MAGIC:
        return "no jaxkv host-tier header"
    (n,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
    text = data[start : start + n]
    if len(text) != n or len(data) < start + n + _CRC.size or _CRC.unpack_from(data, start + n)[0] != zlib.crc32(text):
        return "a torn header"
    try:
        written = json.loads(text)
    except ValueError:
        return "an unreadable header"
    diff = [k for k in sorted(set(written) | set(fingerprint)) if written.get(k) != fingerprint.get(k)]
    if diff:
        return "; ".join(f"{k}: file {written.get(k)!r}, this server {fingerprint.get(k)!r}" for k in diff)
    return None


class PersistentHostTier:
    """The files of one persistent host tier of ``num_blocks`` host blocks (+ scratch block 0)
    of ``row_shape`` / ``dtype``, written by what ``fingerprint`` describes (a JSON-able dict)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        fingerprint: dict[str, Any],
        num_blocks: int,
        row_shape: Sequence[int],
        dtype: Any,
    ) -> None:
        self.path = Path(path)
        self.journal_path = self.path.with_name(self.path.name + ".journal")
        self.num_blocks = num_blocks
        self.dtype = np.dtype(dtype)
        self.shape = (num_blocks + 1, *(int(d) for d in row_shape))
        self.fingerprint = {
            **fingerprint,
            "row_shape": list(self.shape[1:]),
            "dtype": self.dtype.str,
            "num_blocks": num_blocks,
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.journal_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as err:
            raise PersistentTierError(f"cannot open the host tier file {self.journal_path}: {err.strerror}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise PersistentTierError(f"{self.journal_path} is held by another process") from None
        self._num_records = 0
        try:
            self.entries, self.infos, self.num_dropped_bytes = self._load()
            self._rows = self._map()
        except BaseException:
            os.close(self._fd)
            raise

    # ---------------------------------------------------------------- start
    def _load(self) -> tuple[dict[Key, int], dict[Key, BlockInfo], int]:
        """Replay the journal (cold when it is not this tier's), then rewrite it compacted."""
        data = self.journal_path.read_bytes()
        entries: dict[Key, int] = {}
        infos: dict[Key, BlockInfo] = {}
        dropped = 0
        if data:
            why = header_mismatch(data, self.fingerprint)
            if why is not None:
                _log.warning("host tier file %s starts cold: it was written by something else (%s)", self.path, why)
                self.path.unlink(missing_ok=True)
            else:
                body = data[len(header(self.fingerprint)) :]
                state = JournalState(self.num_blocks)
                dropped = len(body) - state.apply(body)
                entries, infos = state.live, state.infos
                if dropped:
                    _log.warning("host tier journal %s: dropped a torn tail of %d bytes", self.journal_path, dropped)
        if entries and (not self.path.exists() or self.path.stat().st_size != self._nbytes()):
            _log.warning("host tier file %s is missing or of another size: starts cold", self.path)
            entries, infos = {}, {}
        self._rewrite(entries, infos)
        if entries:
            _log.info("host tier %s reloaded %d block(s)", self.path, len(entries))
        return entries, infos, dropped

    def _rewrite(self, entries: dict[Key, int], infos: dict[Key, BlockInfo]) -> None:
        """Replace the journal, atomically, by the header and one record per live key."""
        compacted = header(self.fingerprint) + b"".join(
            _record(_STORED, k, b, infos.get(k)) for k, b in entries.items()
        )
        tmp = self.journal_path.with_name(self.journal_path.name + ".tmp")
        tmp.write_bytes(compacted)
        os.replace(tmp, self.journal_path)  # the lock stays on the old inode: take it on the new one
        fd = os.open(self.journal_path, os.O_RDWR | os.O_APPEND)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(self._fd)
        self._fd = fd
        self._num_records = len(entries)

    def _nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def _map(self) -> np.ndarray:
        fresh = not self.path.exists() or self.path.stat().st_size != self._nbytes()
        if fresh:  # a new inode: a peer that maps the old file (:mod:`jaxkv.offload.peers`) never sees it truncated
            self.path.unlink(missing_ok=True)
        return np.memmap(self.path, dtype=self.dtype, mode="w+" if fresh else "r+", shape=self.shape)

    # ---------------------------------------------------------------- use
    def rows(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """The mapped host blocks, for a host buffer of ``shape`` / ``dtype`` (they must be the tier's)."""
        if tuple(shape) != self.shape or np.dtype(dtype) != self.dtype:
            raise PersistentTierError(f"{self.path} holds {self.shape} {self.dtype}, asked for {shape} {dtype}")
        return self._rows

    def stored(self, keys: Sequence[Key], host_blocks: Sequence[int], infos: Sequence[BlockInfo | None]) -> None:
        """Record that ``keys`` are in ``host_blocks``, with their parents and token ids where
        known (call once their bytes are written)."""
        if keys:
            records = (_record(_STORED, *r) for r in zip(keys, host_blocks, infos, strict=True))
            os.write(self._fd, b"".join(records))
            self._num_records += len(keys)

    def removed(self, keys: Sequence[Key]) -> None:
        """Record that ``keys`` left the tier (call before their host blocks are written again)."""
        if keys:
            os.write(self._fd, b"".join(_record(_REMOVED, k, 0) for k in keys))
            self._num_records += len(keys)

    @property
    def wants_compaction(self) -> bool:
        """Whether the journal holds over :data:`RECORDS_PER_BLOCK` records per host block (then :meth:`compact`)."""
        return self._num_records > RECORDS_PER_BLOCK * (self.num_blocks + 16)

    def compact(self, entries: dict[Key, int], infos: dict[Key, BlockInfo]) -> None:
        """Rewrite the journal as the live ``entries`` (stored and settled keys) and their ``infos``."""
        self._rewrite(entries, infos)

    def close(self) -> None:
        """Release the files (the mapping's writes stay in the page cache)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
