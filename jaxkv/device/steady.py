"""A steady decode step's metadata advanced on the device from the last step's, not rebuilt.

From one decode step to the next, most of a batch's metadata only moves on: the same
requests, in the same rows, each one token further. vLLM's persistent ``InputBatch`` and
block table, and tpu-inference's, keep such a batch on the device and send what changed;
this module does the same for jaxkv's packed :class:`~jaxkv.device.metadata.StepMetadata`.

:class:`SteadyDecode` (host) keeps a record of the last step it saw (request ids, counts, fed
tokens, the packed buffer the step read, on the device). For the next step it decides:

- **steady**: every sequence of the last step, in the same order, each decoding its next
  token; no recurrent state moves to a new block or row; table entries changed only below
  each group's padded width. Its :class:`Delta` is one small int32 array: a flag (advance) and
  ``(offset, value)`` pairs for the packed entries that changed otherwise (new block-table
  entries of a sequence crossing a block boundary, a window's nulled block, an input id the
  last step did not have). :func:`advance` applies it inside the jitted step: positions and
  ``kv_lens`` + 1, the pairs written, slot mappings recomputed from the kept tables, each
  recurrent sequence reading the state row (and unit) it wrote last step.
- **anything else**: ``None``, and the caller builds the metadata in full
  (:meth:`~jaxkv.device.metadata.MetadataBuilder.build`, exact and checked) with the idle delta
  (:attr:`SteadyDecode.idle`: :func:`advance` is then the identity).

The two deltas that carry no pairs (idle, and a steady step that changes nothing else: most
steps) are placed on the device once, given ``place``, so such a step's call sends nothing
from the host; a delta with pairs is made and placed per step (every delta placed alike: one
placed otherwise would compile the step again).

The checks of a full build hold on the steady path too: an id is checked once when the
block tables write it, and a step whose new token would need a block it lacks (or the null
block) is sent down the full path, which raises the error naming it. A step's outputs give
back the packed buffer it read (advanced), which :meth:`SteadyDecode.keep` records once the
step is dispatched; a step that fails leaves no record, so the next one is built in full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.device.block_table import BlockTables, Change
from jaxkv.device.metadata import MetadataBuilder, StepMetadata, StepSeq, bucket

_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


class _Record(NamedTuple):
    """What a step was built from: the next step is steady when it continues exactly this."""

    request_ids: list[str]
    next_computed: list[int]
    token_ids: list[Sequence[int]]
    meta: StepMetadata


class SteadyDecode:
    """Host side of the steady path of one runner's steps (see the module docstring).

    ``capacity`` bounds the pairs one delta carries (a step with more takes the full path). A
    delta is an int32 array ``(1 + 2 * capacity,)``: the flag (1: advance, 0: as built), then
    the pairs' offsets in the packed buffer (padding: the int32 maximum, past any buffer), then their values.
    ``place`` puts the two constant deltas (:attr:`idle`, and a steady step's without pairs) where
    the step reads them, once (None: they stay numpy arrays, sent by each call)."""

    def __init__(
        self, builder: MetadataBuilder, capacity: int, place: Callable[[np.ndarray], jax.Array] | None = None
    ) -> None:
        self._builder = builder
        self._capacity = capacity
        self._record: _Record | None = None
        self._place = place
        idle, plain = self._delta(0, []), self._delta(1, [])
        self.idle: np.ndarray | jax.Array = idle if place is None else place(idle)
        """The delta of a step built in full: :func:`advance` leaves its metadata as it is."""
        self._plain: np.ndarray | jax.Array = plain if place is None else place(plain)
        """The delta of a steady step that changes nothing else (never written, never donated)."""
        self._enabled = all(
            g in builder.state_groups or limit * size <= _INT32_MAX + 1
            for g, (limit, size) in enumerate(zip(builder.limits, builder.block_sizes, strict=True))
        )

    def _delta(self, flag: int, pairs: list[tuple[int, int]]) -> np.ndarray:
        out = np.full(1 + 2 * self._capacity, _INT32_MAX, np.int32)  # padding pairs: past any buffer
        out[0] = flag
        if pairs:
            offsets, values = zip(*pairs, strict=True)
            out[1 : 1 + len(pairs)] = offsets
            out[1 + self._capacity : 1 + self._capacity + len(pairs)] = values
        return out

    def forget(self) -> None:
        """Build the next step in full (a row was released, a step failed)."""
        self._record = None

    def plan(
        self,
        seqs: Sequence[StepSeq],
        token_ids: Sequence[Sequence[int]],
        block_ids: Sequence[Sequence[Sequence[int]]],
        tables: BlockTables,
    ) -> tuple[StepMetadata, np.ndarray | jax.Array, _Record] | None:
        """The kept metadata, the delta that advances it to this step's and this step's record;
        None: build this step in full (``tables`` may hold this step's lists already; a build
        reads them as they are). The record is taken out: a step that fails leaves none."""
        last, self._record = self._record, None
        if last is None or not self._enabled or len(seqs) != len(last.request_ids):
            return None
        computed = [s.num_computed_tokens for s in seqs]
        if (
            computed != last.next_computed
            or any(s.num_new_tokens != 1 for s in seqs)
            or [s.request_id for s in seqs] != last.request_ids
            or max(computed) >= _INT32_MAX
        ):
            return None
        meta = last.meta
        offsets = meta.packing.offsets
        pairs: list[tuple[int, int]] = []
        if token_ids != last.token_ids:
            start = offsets["input_ids"][0]
            for i, (ids, before) in enumerate(zip(token_ids, last.token_ids, strict=True)):
                if ids != before:
                    if len(ids) != 1 or type(ids[0]) is not int or not _INT32_MIN <= ids[0] <= _INT32_MAX:
                        return None
                    pairs.append((start + i, ids[0]))
        changes: list[Change] = []
        rows = tables.rows(last.request_ids, block_ids, changes)
        widths = meta.packing.widths
        changed = {(i, g) for i, g, _, _ in changes}
        for i, g, j, value in changes:
            width = widths[g]
            if width is not None:
                if j >= width:
                    return None  # a table outgrew its bucket: built in full
                pairs.append((offsets[f"tables{g}"][0] + i * width + j, value))
        for g in {g for _, g in changed if widths[g] is not None}:  # the padded width follows the longest list
            if bucket(int(tables.lengths(g, rows).max()), self._builder.buckets.blocks, "blocks") != widths[g]:
                return None
        for g, size in enumerate(self._builder.block_sizes):
            moved = [i for i, c in enumerate(computed) if c % size == 0 or (changed and (i, g) in changed)]
            if moved and not self._moved(g, size, moved, computed, rows, tables, offsets, pairs):
                return None
        if len(pairs) > self._capacity:
            return None
        delta = self._plain
        if pairs:  # placed as the constant ones are: a delta placed differently would compile the step again
            delta = self._delta(1, pairs) if self._place is None else self._place(self._delta(1, pairs))
        return meta, delta, _Record(last.request_ids, [c + 1 for c in computed], list(token_ids), meta)

    def _moved(
        self,
        g: int,
        size: int,
        moved: list[int],
        computed: list[int],
        rows: np.ndarray,
        tables: BlockTables,
        offsets: dict[str, tuple[int, tuple[int, ...]]],
        pairs: list[tuple[int, int]],
    ) -> bool:
        """For the sequences ``moved`` in group ``g`` (crossing into a new block, or a changed
        list): whether each new token finds a real block, and for a recurrent group the pairs of
        their new state rows (and units); False: build the step in full (which names the error)."""
        table, lengths = tables.table(g), tables.lengths(g, rows).tolist()
        state, k = g in self._builder.state_groups, self._builder.pages_per_state
        for i in moved:  # a few a step: scalar reads beat numpy's per-call cost
            position, row = computed[i], int(rows[i])
            index = position // size  # the new token's block; a state's write block (kv = position + 1)
            if lengths[i] <= index:
                return False
            write = int(table[row, index])
            if not write:
                return False
            if not state:
                continue
            read = int(table[row, (position - 1) // size]) or write  # the state after the computed tokens
            pairs += [(offsets[f"read{g}"][0] + i, read), (offsets[f"write{g}"][0] + i, write)]
            if k:
                for name, head in ((f"read_blocks{g}", read), (f"write_blocks{g}", write)):
                    units = self._unit(head)
                    if units is None:
                        return False
                    start = offsets[name][0] + i * k
                    pairs += [(start + p, b) for p, b in enumerate(units)]
        return True

    def _unit(self, head: int) -> list[int] | None:
        """The blocks of the state unit headed by ``head``; None unless what a full build accepts."""
        assert self._builder.unit_blocks is not None  # pages_per_state > 0
        blocks = [int(b) for b in self._builder.unit_blocks(head)]
        limit = self._builder.num_blocks if self._builder.num_blocks is not None else _INT32_MAX
        if len(blocks) != self._builder.pages_per_state or any(b <= 0 or b >= limit for b in blocks):
            return None
        return blocks

    def start(self, seqs: Sequence[StepSeq], token_ids: Sequence[Sequence[int]], meta: StepMetadata) -> _Record | None:
        """The record of a step built in full: one that later steps may advance (all decodes)."""
        if any(s.num_new_tokens != 1 for s in seqs) or any(len(ids) != 1 for ids in token_ids):
            return None
        return _Record([s.request_id for s in seqs], [s.num_computed_tokens + 1 for s in seqs], list(token_ids), meta)

    def keep(self, record: _Record | None, packed: jax.Array) -> None:
        """Record a dispatched step, ``packed`` the metadata its call gave back (on the device)."""
        if record is None:
            self._record = None
            return
        meta = record.meta  # a StepMetadata made directly: dataclasses.replace costs more than the rest of keep
        self._record = record._replace(meta=StepMetadata(packed, meta.packing, meta.group_layers))


def advance(meta: StepMetadata, delta: jax.Array, block_sizes: Sequence[int]) -> StepMetadata:
    """Traced: ``meta`` advanced by ``delta`` (:meth:`SteadyDecode.plan`; ``block_sizes`` per
    group, static); with the idle delta, ``meta`` as it is. A steady step's tokens are its
    sequences (token t of sequence t)."""
    packing, packed = meta.packing, meta.packed
    offsets = packing.offsets
    flag = delta[0]
    capacity = (delta.shape[0] - 1) // 2
    n = packed[offsets["num_seqs"][0]]
    seqs_real = jnp.arange(packing.max_seqs) < n
    tokens_real = jnp.arange(packing.num_tokens) < n
    step = jnp.where(flag > 0, 1, 0)

    def field(name: str) -> jax.Array:
        start, shape = offsets[name]
        return jax.lax.dynamic_slice(packed, (start,), (int(np.prod(shape)),))

    def put(values: jax.Array, name: str) -> jax.Array:
        return jax.lax.dynamic_update_slice(out, values.reshape(-1).astype(jnp.int32), (offsets[name][0],))

    out = packed
    positions = field("positions") + step * tokens_real
    out = put(positions, "positions")
    out = put(field("kv_lens") + step * seqs_real, "kv_lens")
    for g, width in enumerate(packing.widths):
        if width is None:
            moving = (flag > 0) & seqs_real
            out = put(jnp.where(moving, field(f"write{g}"), field(f"read{g}")), f"read{g}")
            out = put(jnp.where(moving, 0, field(f"fresh{g}")), f"fresh{g}")
            k = packing.pages_per_state
            if k:
                write = field(f"write_blocks{g}").reshape(-1, k)
                read = field(f"read_blocks{g}").reshape(-1, k)
                out = put(jnp.where(moving[:, None], write, read), f"read_blocks{g}")
    out = out.at[delta[1 : 1 + capacity]].set(delta[1 + capacity :], mode="drop")
    for g, width in enumerate(packing.widths):
        if width is None:
            continue
        start, _ = offsets[f"tables{g}"]
        table = jax.lax.dynamic_slice(out, (start,), (packing.max_seqs * width,)).reshape(packing.max_seqs, width)
        size = block_sizes[g]
        seq = jnp.minimum(jnp.arange(packing.num_tokens), packing.max_seqs - 1)
        blocks = table[seq, jnp.clip(positions // size, 0, width - 1)]
        slots = jnp.where(tokens_real, blocks * size + positions % size, 0)
        start, _ = offsets[f"slots{g}"]
        out = jnp.where(flag > 0, jax.lax.dynamic_update_slice(out, slots.astype(jnp.int32), (start,)), out)
    return dataclasses.replace(meta, packed=out)
