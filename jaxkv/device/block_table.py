"""Host block tables kept across steps: one row per request, rewritten only where its ids changed.

A serving step needs, per KV cache group, the block ids of every scheduled request as
a padded int array. Building it from the manager's Python lists each step costs a numpy
conversion and range check per request and group; but from one step to the next a
request's list is almost always the same, or the same plus a new block at the end. So
:class:`BlockTables` keeps one numpy row per request (as vLLM's and tpu-inference's
block tables do) and compares each list it is given with the copy it last wrote (a
Python list comparison, no numpy): an unchanged list costs nothing more, an extended one
writes its new tail, anything else (a sliding window nulling old blocks, a recurrent
state moving, a request preempted and readmitted under its id) rewrites the row. Every
id written is checked: an int in ``[0, limit)`` of its group, else :class:`BlockIdError`
naming it (that group's row is then left as it was). Ids already written are not checked
again: an entry equal to the one written (``1.0`` or ``True`` where ``1`` was) is that id.

The table is a cache of the lists, exact whatever it is told: rows of requests that
finished are reclaimed by :meth:`BlockTables.release`, or, when the rows run out and at
least half of them belong to requests absent from the current step, by evicting those
(a list seen again is written afresh); else the table doubles.
Host only: no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxkv.device.metadata_errors import BlockIdError

Change = tuple[int, int, int, int]
"""One entry of a block table that a step changed: ``(request index in the step, group, index, id)``."""


class BlockTables:
    """Per group, a host ``(rows, width)`` int64 table of requests' block ids, padded with the null block 0.

    ``limits[g]`` bounds group g's ids (exclusive). :meth:`rows` updates the rows of one
    step's requests from their lists and returns where they are; :meth:`lengths` gives
    their list lengths; :meth:`table` the ids themselves.
    """

    def __init__(self, limits: Sequence[int], *, rows: int = 8, width: int = 8) -> None:
        self.limits = tuple(int(x) for x in limits)
        self._tables = [np.zeros((rows, width), np.int64) for _ in self.limits]
        self._lengths = np.zeros((len(self.limits), rows), np.int64)
        self._written: dict[str, tuple[int, tuple[list[int], ...]]] = {}
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_requests(self) -> int:
        """Requests holding a row."""
        return len(self._written)

    def rows(
        self,
        request_ids: Sequence[str],
        block_ids: Sequence[Sequence[Sequence[int]]],
        changes: list[Change] | None = None,
    ) -> np.ndarray:
        """The row of each request (``(len(request_ids),)``), after writing whatever changed of
        ``block_ids[i][g]`` (request i's ids in group g) since its row was last written.

        ``changes``, when given, gets one :data:`Change` ``(i, g, j, id)`` per entry j of request
        i's row in group g that this call wrote with a different id (0 past a list that shrank):
        what a copy of the rows as they were (a device copy of the step's tables) must be given."""
        out: list[int] = []
        kept = self._written
        for i, (request_id, lists) in enumerate(zip(request_ids, block_ids, strict=True)):
            entry = kept.get(request_id)
            if entry is None:
                entry = self._admit(request_id, request_ids)
            row, written = entry
            if lists != written:  # one comparison of every group's list, the common case: no change
                given = tuple(ids if type(ids) is list else np.asarray(ids).reshape(-1).tolist() for ids in lists)
                now = self._update(request_id, row, written, given)
                kept[request_id] = (row, now)
                if changes is not None:
                    changes.extend(_diff(i, written, now))
            out.append(row)
        return np.array(out, np.int64)

    def lengths(self, group: int, rows: np.ndarray) -> np.ndarray:
        """The list length of each row of ``rows`` in ``group``."""
        return self._lengths[group, rows]

    def table(self, group: int) -> np.ndarray:
        """Group ``group``'s whole table (rows past a list's length are 0); read it, never write it."""
        return self._tables[group]

    def release(self, request_id: str) -> bool:
        """Free ``request_id``'s row (its request finished or was preempted); False if it held none."""
        entry = self._written.pop(request_id, None)
        if entry is None:
            return False
        row = entry[0]
        self._lengths[:, row] = 0
        for table in self._tables:
            table[row] = 0
        self._free.append(row)
        return True

    def _admit(self, request_id: str, step: Sequence[str]) -> tuple[int, tuple[list[int], ...]]:
        """A row for a request without one: a free row, else the rows of requests absent from
        ``step`` when they are at least half, else one of a doubled table."""
        if not self._free:
            current = set(step)
            stale = [r for r in self._written if r not in current]
            if 2 * len(stale) >= len(self._written):
                for r in stale:
                    self.release(r)
            else:
                self._grow_rows()
        entry: tuple[int, tuple[list[int], ...]] = (self._free.pop(), tuple([] for _ in self.limits))
        self._written[request_id] = entry
        return entry

    def _grow_rows(self) -> None:
        old = self._lengths.shape[1]
        self._tables = [np.pad(t, ((0, old), (0, 0))) for t in self._tables]
        self._lengths = np.pad(self._lengths, ((0, 0), (0, old)))
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _update(
        self, request_id: str, row: int, written: tuple[list[int], ...], lists: tuple[list[int], ...]
    ) -> tuple[list[int], ...]:
        """Write each group's list that differs from what ``row`` holds; what the row holds after."""
        now = list(written)
        for g, ids in enumerate(lists):
            if ids != now[g]:
                now[g] = self._write(request_id, g, row, now[g], ids)
        return tuple(now)

    def _write(self, request_id: str, group: int, row: int, written: list[int], ids: list[int]) -> list[int]:
        """Write what changed from ``written`` to ``ids`` into the row (its new tail, or all of
        it), checked; the copy now written."""
        ids = list(ids)  # a copy: the caller's list may change in place
        start = len(written) if len(ids) >= len(written) and ids[: len(written)] == written else 0
        values = _checked(ids[start:], self.limits[group], request_id, group)
        table = self._tables[group]
        if len(ids) > table.shape[1]:
            width = max(len(ids), 2 * table.shape[1])
            table = self._tables[group] = np.pad(table, ((0, 0), (0, width - table.shape[1])))
        table[row, start : len(ids)] = values
        table[row, len(ids) :] = 0
        self._lengths[group, row] = len(ids)
        return ids


def _diff(i: int, before: tuple[list[int], ...], after: tuple[list[int], ...]) -> list[Change]:
    """The entries of request ``i``'s rows that differ between ``before`` and ``after`` (0 past a list's end)."""
    out: list[Change] = []
    for g, (old, new) in enumerate(zip(before, after, strict=True)):
        if old == new:
            continue
        start = len(old) if new[: len(old)] == old else 0
        for j in range(start, max(len(old), len(new))):
            value = int(new[j]) if j < len(new) else 0
            if j >= len(old) or old[j] != value:
                out.append((i, g, j, value))
    return out


def _checked(ids: list[int], limit: int, request_id: str, group: int) -> list[int] | np.ndarray:
    """``ids`` (as given when all are Python ints, else as int64), refused unless ints in ``[0, limit)``."""
    if not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < limit):
        return ids  # the manager's lists: checked without numpy
    values = np.asarray(ids)
    where = f"request {request_id!r}, group {group}"
    if values.dtype == np.bool_ or not np.issubdtype(values.dtype, np.integer):
        raise BlockIdError(f"{where}: block ids must be ints, got {ids!r}")
    values = values.astype(np.int64).reshape(-1)
    bad = (values < 0) | (values >= limit)
    if bad.any():
        raise BlockIdError(f"{where}: block id {int(values[bad][0])} out of range [0, {limit})")
    return values
