"""Other processes' host tiers on this machine, read (never written) through their files.

Each replica keeps its own host tier in a file (:mod:`jaxkv.offload.persistent`); with
peers (``jaxkv-server --kv_offloading_peers GLOB``), a replica also tails the journals
of the tier files ``GLOB`` names (its own excluded, found again every ``rescan_s`` so a
peer that starts or restarts later is picked up). A prefix hit on a peer's blocks is
staged: copied into staging rows of the replica's host buffers and loaded from there
(:mod:`jaxkv.serving.offload_connector`), so each block stays in the host tier of the
replica that computed it and the fleet's tiers hold it once, as instances sharing one
LMCache backend do.

A peer is read as its owner writes it: a journal record *stored* only once the block's
bytes are in the mapping, *removed* before its host block is written again. So a copy is
checked seqlock-style (:meth:`PeerTiers.read`): the key's host block is read from the
journal, the bytes are copied, and the journal's new records are read again; if the key
was removed or stored again meanwhile, or the journal was replaced (the owner compacted
or restarted: a new inode), the copy is dropped. A block whose bytes might be torn is
never returned.

A peer is skipped while it cannot be read: its journal or file missing or of another
size, a header of another fingerprint (one warning per file), or a journal tail that does
not apply (a record being written, or a bad one: read again from there at each look).
Every failure is a miss, never an exception. Host-only (numpy, no JAX).
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxkv.offload.persistent import BlockInfo, JournalState, Key, header, header_mismatch

_log = logging.getLogger(__name__)


@dataclass
class _Peer:
    """One peer's files as this reader last saw them."""

    path: Path
    inodes: tuple[int, int]
    """(journal, data file) inodes: either changing means the owner rewrote them."""
    state: JournalState
    offset: int
    """Bytes of the journal applied so far (header included)."""
    rows: np.ndarray
    stuck: bool = False
    """Whether the last read left bytes it could not apply: a record being written, or a bad
    one after which the owner's later records (removals among them) are unknown. A stuck peer
    holds nothing for its readers until a read applies the tail or its journal is replaced."""


class PeerTiers:
    """The host tiers that ``pattern`` names, other than ``own`` (a tier's file path), read
    for keys a tier of ``fingerprint`` / ``shape`` / ``dtype`` lacks (its own fingerprint:
    only peers written by the same model, layout, hash and block count are read)."""

    def __init__(
        self,
        pattern: str,
        own: str | os.PathLike[str],
        fingerprint: dict[str, Any],
        shape: Sequence[int],
        dtype: Any,
        *,
        rescan_s: float = 1.0,
    ) -> None:
        self.pattern = pattern
        self.own = Path(own).resolve()
        self.fingerprint = fingerprint
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.rescan_s = rescan_s
        self._header = header(fingerprint)
        self._peers: dict[Path, _Peer] = {}
        self._warned: dict[Path, tuple[int, int]] = {}
        self._scanned = -float("inf")
        self.paths: tuple[str, ...] = ()
        """The peers' files being read now (a snapshot another thread may read)."""

    # ------------------------------------------------------------- tailing
    def refresh(self) -> None:
        """Find the peers again (every ``rescan_s``) and read each one's new journal records."""
        now = time.monotonic()
        if now - self._scanned >= self.rescan_s:
            self._scanned = now
            for name in glob.glob(self.pattern):
                path = Path(name).resolve()
                if path != self.own and not name.endswith((".journal", ".tmp")) and path not in self._peers:
                    self._open(path)
        for path in list(self._peers):
            if not self._poll(self._peers[path]):
                self._peers.pop(path, None)
        self.paths = tuple(sorted(str(p) for p in self._peers))

    def _open(self, path: Path) -> _Peer | None:
        """Start reading the peer at ``path`` from its journal's start (None: unreadable now)."""
        peer = self._read_start(path)
        if peer is not None:
            self._peers[path] = peer
        else:
            self._peers.pop(path, None)
        return peer

    def _read_start(self, path: Path) -> _Peer | None:
        journal = path.with_name(path.name + ".journal")
        try:
            with open(journal, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                data = f.read()
            data_inode = path.stat().st_ino
        except OSError:
            return None
        why = header_mismatch(data, self.fingerprint)
        if why is not None:
            if why != "a torn header" and self._warned.get(path) != (inode, data_inode):
                self._warned[path] = (inode, data_inode)
                _log.warning("host tier peer %s is ignored: it was written by something else (%s)", path, why)
            return None
        try:
            rows = np.memmap(path, dtype=self.dtype, mode="r", shape=self.shape)
            if path.stat().st_ino != data_inode:  # replaced while opened: read it at the next look
                return None
        except (OSError, ValueError):  # another size (or gone): nothing to read there
            return None
        state = JournalState(self.shape[0] - 1)
        offset = len(self._header) + state.apply(memoryview(data)[len(self._header) :])
        return _Peer(path, (inode, data_inode), state, offset, rows, stuck=offset < len(data))

    def _poll(self, peer: _Peer) -> bool:
        """Apply the peer's new journal records (from the start when its files were
        replaced); False when it cannot be read any more."""
        journal = peer.path.with_name(peer.path.name + ".journal")
        try:
            with open(journal, "rb") as f:
                inode = os.fstat(f.fileno()).st_ino
                if (inode, peer.path.stat().st_ino) != peer.inodes:
                    return self._open(peer.path) is not None
                f.seek(peer.offset)
                data = f.read()
        except OSError:
            return False
        applied = peer.state.apply(data)
        peer.offset += applied
        peer.stuck = applied < len(data)
        return True

    # ------------------------------------------------------------- reading
    def holds(self, key: Key) -> bool:
        """Whether some peer held ``key`` at the last :meth:`refresh`."""
        return any(key in peer.state.live for peer in self._peers.values() if not peer.stuck)

    def read(self, keys: Sequence[Key]) -> list[tuple[np.ndarray, BlockInfo | None] | None]:
        """A checked copy of each key's block and its parent and token ids (None: a miss, or a
        copy the peer's owner may have overwritten while it was read)."""
        copies: list[tuple[_Peer, int, JournalState, np.ndarray, BlockInfo | None] | None] = []
        for key in keys:
            peer = next((p for p in self._peers.values() if not p.stuck and key in p.state.live), None)
            if peer is None:
                copies.append(None)
                continue
            try:
                row = np.array(peer.rows[peer.state.live[key]], copy=True)
            except (OSError, ValueError):
                copies.append(None)
                continue
            copies.append((peer, peer.state.version[key], peer.state, row, peer.state.infos.get(key)))
        for peer in {c[0].path: c[0] for c in copies if c is not None}.values():
            if not self._poll(peer):
                self._peers.pop(peer.path, None)
        result: list[tuple[np.ndarray, BlockInfo | None] | None] = []
        for key, copy in zip(keys, copies, strict=True):
            if copy is None:
                result.append(None)
                continue
            peer, version, state, row, info = copy
            current = self._peers.get(peer.path)
            kept = current is peer and not peer.stuck and peer.state is state and state.version.get(key) == version
            result.append((row, info) if kept else None)
        return result

    def __len__(self) -> int:
        return len(self._peers)
