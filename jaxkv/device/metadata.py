"""Host -> device step metadata: what the kernels need to run one scheduler step.

From the scheduled sequences (decodes first, then prefills) and the manager's block ids,
:func:`build_step_metadata` builds, in numpy:

- ``input_ids``, ``positions`` (T,): the new tokens of all sequences, concatenated;
- ``kv_lens`` (S,), ``cu_q_lens`` (S+1,), ``num_seqs`` (1,): the ragged batch;
- ``logits_indices`` (S,): the last new token of each sequence;
- per KV cache group, a block table (S, W_g) and a slot mapping (T,); per recurrent
  (state) group instead, the state row each sequence reads, the row it writes and
  whether it starts from a zero state (S,) each; with states in the KV pages
  (``shared_pages``), also the blocks of the unit it reads and of the one it writes
  (S, pages_per_state) each.

Shapes are padded up to :class:`Buckets` so a step function compiles once per bucket
combination. Padding is always the null block 0 (never -1): padded table entries are
0, padding tokens write slot 0, padded sequences have kv_len 0 and q_len 0.

**Checked here, trusted on device.** The device ops (:mod:`jaxkv.device.ops`) index the cache
with these ids unchecked: a slot of -1 gathers from or writes into the last block, an
out-of-range scatter is silently dropped. So this builder is where ids are checked:
every block id of every table must be an int in ``[0, num_blocks)`` and every new
token's block a real (non-null) one, which puts every slot in
``[block_size, num_blocks * block_size)``; anything else is a :class:`BlockIdError`
naming the value, raised before anything is sent. A serving loop passes its
:class:`~jaxkv.device.block_table.BlockTables`, kept across steps, so that only the ids a
request's lists gained or changed since its last step are converted and checked.

**One transfer.** Every array is packed into one flat int32 numpy buffer, which goes to
the device in one transfer: by default the jitted step's call copies it (as it does the
sampling inputs; on its C++ path that costs a fraction of a ``jax.device_put`` ahead of
it), or it is placed on a given device or sharding. :class:`StepMetadata` holds that one
array as its only pytree leaf, plus static offsets. Its fields (``md.kv_lens``,
``md.groups[g].block_tables``...) are slices taken where they are read: inside the
jitted step, where static slices of an argument are free.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.device.block_table import BlockTables
from jaxkv.device.cache import UnknownLayerError
from jaxkv.device.metadata_errors import BlockIdError, MetadataError
from jaxkv.ints import cdiv, check_int, is_int

_MAX_BLOCKS = 2**31
"""Upper bound of block ids when the builder is not told ``num_blocks`` (int32 range)."""
_INT32 = np.iinfo(np.int32)


class BucketOverflowError(MetadataError):
    """A batch dimension is larger than the largest bucket."""


class GroupKindError(UnknownLayerError):
    """A layer's KV cache group is of the other kind: state rows asked of an attention
    layer's group, or a block table of a recurrent layer's group."""


def _sizes(what: str, sizes: Sequence[int]) -> tuple[int, ...]:
    sizes = tuple(sizes)
    if not sizes or any(not is_int(s) or s <= 0 for s in sizes):
        raise MetadataError(f"Buckets.{what} must be positive ints, got {sizes!r}")
    if list(sizes) != sorted(set(sizes)):
        raise MetadataError(f"Buckets.{what} must be strictly increasing, got {sizes!r}")
    return sizes


@dataclass(frozen=True)
class Buckets:
    """Padded sizes: total new ``tokens``, sequences (``seqs``), table width (``blocks``).

    Each dimension is rounded up to the smallest bucket that holds it; the number of
    compiled step shapes is at most ``len(tokens) * len(seqs) * len(blocks)``.
    """

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]
    blocks: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("tokens", "seqs", "blocks"):
            object.__setattr__(self, name, _sizes(name, getattr(self, name)))

    @classmethod
    def powers_of_two(cls, max_tokens: int, max_seqs: int, max_blocks: int, *, smallest: int = 8) -> Buckets:
        """Powers of two from ``smallest`` (capped at each max), then the max itself."""

        def ladder(limit: int) -> tuple[int, ...]:
            limit = check_int("a bucket limit", limit, error=MetadataError)
            sizes, size = [], min(smallest, limit)
            while size < limit:
                sizes.append(size)
                size *= 2
            return (*tuple(sizes), limit)

        return cls(ladder(max_tokens), ladder(max_seqs), ladder(max_blocks))


def bucket(value: int, sizes: Sequence[int], what: str) -> int:
    """The smallest of ``sizes`` >= ``value``; :class:`BucketOverflowError` if none."""
    for size in sizes:
        if size >= value:
            return size
    raise BucketOverflowError(f"{what}={value} exceeds the largest bucket {sizes[-1]}")


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence of a step: ``num_new_tokens`` after ``num_computed_tokens``."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int

    def __post_init__(self) -> None:
        computed, new = self.num_computed_tokens, self.num_new_tokens
        if type(computed) is int and type(new) is int and computed >= 0 and new > 0:
            return  # the common case, without the slower checks of numpy ints below
        if not (is_int(self.num_computed_tokens) and is_int(self.num_new_tokens)) or (
            self.num_computed_tokens < 0 or self.num_new_tokens <= 0
        ):
            raise MetadataError(
                f"request {self.request_id!r}: num_computed_tokens="
                f"{self.num_computed_tokens!r} must be an int >= 0 and num_new_tokens="
                f"{self.num_new_tokens!r} an int > 0"
            )

    @property
    def is_decode(self) -> bool:
        """One new token: belongs to the decode part at the front of the batch."""
        return self.num_new_tokens == 1


class StepSeq(Protocol):
    """What the builder reads of a scheduled sequence: a :class:`ScheduledSeq`, or any object
    with these attributes (a serving loop passes its scheduler's chunks as they are, and
    :func:`build_step_metadata` checks their counts all at once)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_new_tokens(self) -> int: ...


def decodes_first(seqs: Sequence[ScheduledSeq]) -> list[int]:
    """A stable order of ``seqs`` (indices) with decodes before prefills."""
    return sorted(range(len(seqs)), key=lambda i: not seqs[i].is_decode)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AttentionMetadata:
    """Metadata of one KV cache group: its block table and where new tokens go."""

    block_tables: jax.Array  # (S, W) int32, padded with the null block 0
    slot_mapping: jax.Array  # (T,) int32, block_id * block_size + offset; padding -> 0


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StateMetadata:
    """Metadata of one recurrent group: where each sequence's state comes from and goes.

    A step reads the state after the sequence's computed tokens from ``read_rows`` and
    writes the state after its new tokens to ``write_rows`` (the same row when the
    running state is updated in place). ``fresh`` sequences start from a zero state
    (nothing computed yet); padded sequences read and write the null row 0. With states
    in the KV pages a row is a unit's head block and ``read_blocks`` / ``write_blocks``
    list all the unit's blocks (null blocks for padding and fresh reads); with state
    rows they are empty, ``(S, 0)``.
    """

    read_rows: jax.Array  # (S,) int32
    write_rows: jax.Array  # (S,) int32
    fresh: jax.Array  # (S,) int32, 1 = start from zeros
    read_blocks: jax.Array  # (S, pages_per_state) int32
    write_blocks: jax.Array  # (S, pages_per_state) int32


def state_rows(
    blocks: Sequence[int], num_computed_tokens: int, num_new_tokens: int, block_size: int
) -> tuple[int, int]:
    """(read row, write row) of a recurrent group's block list for one step.

    Block ``i`` holds the state after ``(i + 1) * block_size`` tokens once reached and
    the running state before; the step reads the block of its computed tokens and
    writes the block of its last new token. A null block where the state was read means
    the running state moved to the newest block index (updated in place): read there.
    """
    write = blocks[cdiv(num_computed_tokens + num_new_tokens, block_size) - 1]
    if num_computed_tokens == 0:
        return 0, write
    read = blocks[cdiv(num_computed_tokens, block_size) - 1]
    return (read or write), write


@dataclass(frozen=True)
class _Packing:
    """Static shape of a packed :class:`StepMetadata`: tokens, seqs, table widths
    (None for a recurrent group), blocks per state (0: state rows)."""

    num_tokens: int
    max_seqs: int
    widths: tuple[int | None, ...]
    pages_per_state: int = 0

    @functools.cached_property
    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Field -> (start, shape) in the packed buffer; groups as ``tables{g}``/``slots{g}``."""
        t, s = self.num_tokens, self.max_seqs
        fields: list[tuple[str, tuple[int, ...]]] = [
            ("input_ids", (t,)),
            ("positions", (t,)),
            ("kv_lens", (s,)),
            ("cu_q_lens", (s + 1,)),
            ("num_seqs", (1,)),
            ("logits_indices", (s,)),
        ]
        for g, width in enumerate(self.widths):
            if width is None:
                k = self.pages_per_state
                fields += [(f"read{g}", (s,)), (f"write{g}", (s,)), (f"fresh{g}", (s,))]
                fields += [(f"read_blocks{g}", (s, k)), (f"write_blocks{g}", (s, k))]
            else:
                fields += [(f"tables{g}", (s, width)), (f"slots{g}", (t,))]
        out: dict[str, tuple[int, tuple[int, ...]]] = {}
        start = 0
        for name, shape in fields:
            out[name] = (start, shape)
            start += int(np.prod(shape))
        out["_end"] = (start, ())
        return out


@functools.lru_cache(maxsize=256)
def _packing(num_tokens: int, max_seqs: int, widths: tuple[int | None, ...], pages_per_state: int) -> _Packing:
    """One :class:`_Packing` per shape, its offsets computed once (a serving loop has a few shapes)."""
    return _Packing(num_tokens, max_seqs, widths, pages_per_state)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepMetadata:
    """All metadata of one step, packed in one int32 array (one host->device transfer).

    ``packed`` is the only pytree leaf; the fields are static slices of it.
    ``group_layers[g]`` names the layers of KV cache group g (static, from the plan's
    groups), so a layer finds its own group's metadata (:meth:`group_of`).
    """

    packed: jax.Array | np.ndarray
    packing: _Packing = dataclasses.field(metadata={"static": True})
    group_layers: tuple[tuple[str, ...], ...] = dataclasses.field(default=(), metadata={"static": True})

    def _field(self, name: str) -> jax.Array:
        """A field as a JAX array: a static slice inside the jitted step (free there); read
        outside it from a host buffer, the slice is sent on its own."""
        start, shape = self.packing.offsets[name]
        return jnp.asarray(self.packed[start : start + int(np.prod(shape))].reshape(shape))

    @property
    def input_ids(self) -> jax.Array:
        """(T,) new token ids, padding 0."""
        return self._field("input_ids")

    @property
    def positions(self) -> jax.Array:
        """(T,) position of each new token in its sequence, padding 0."""
        return self._field("positions")

    @property
    def kv_lens(self) -> jax.Array:
        """(S,) tokens of each sequence after this step, padding 0."""
        return self._field("kv_lens")

    @property
    def cu_q_lens(self) -> jax.Array:
        """(S+1,) start of each sequence's new tokens; padded sequences are empty."""
        return self._field("cu_q_lens")

    @property
    def num_seqs(self) -> jax.Array:
        """(1,) real sequences."""
        return self._field("num_seqs")

    @property
    def logits_indices(self) -> jax.Array:
        """(S,) index of each sequence's last new token, padding 0."""
        return self._field("logits_indices")

    @property
    def groups(self) -> tuple[AttentionMetadata | StateMetadata, ...]:
        """Per KV cache group: block table and slot mapping, or state rows for a recurrent group."""
        return tuple(self._group(g) for g in range(len(self.packing.widths)))

    def _group(self, g: int) -> AttentionMetadata | StateMetadata:
        if self.packing.widths[g] is None:
            return StateMetadata(
                self._field(f"read{g}"),
                self._field(f"write{g}"),
                self._field(f"fresh{g}"),
                self._field(f"read_blocks{g}"),
                self._field(f"write_blocks{g}"),
            )
        return AttentionMetadata(self._field(f"tables{g}"), self._field(f"slots{g}"))

    def group_of(self, layer: str) -> AttentionMetadata | StateMetadata:
        """The metadata of ``layer``'s KV cache group: its block table and slot mapping,
        or its state rows; :class:`~jaxkv.device.cache.UnknownLayerError` for a layer in no group."""
        for g, names in enumerate(self.group_layers):
            if layer in names:
                return self._group(g)
        raise UnknownLayerError(
            f"layer {layer!r} is in no KV cache group of this step's metadata; "
            f"groups: {[list(n) for n in self.group_layers]}"
        )

    def attention_of(self, layer: str) -> AttentionMetadata:
        """``layer``'s block table and slot mapping; :class:`GroupKindError` when its group
        holds state rows (a recurrent layer has no pages)."""
        group = self.group_of(layer)
        if not isinstance(group, AttentionMetadata):
            raise GroupKindError(f"layer {layer!r} is a recurrent layer in this step's metadata: it has no KV pages")
        return group

    def states_of(self, layer: str) -> StateMetadata:
        """``layer``'s state rows; :class:`GroupKindError` when its group holds a block
        table (an attention layer has no state rows)."""
        group = self.group_of(layer)
        if not isinstance(group, StateMetadata):
            raise GroupKindError(
                f"layer {layer!r} has a KV cache group of pages in this step's metadata: no state rows"
            )
        return group

    @property
    def num_tokens(self) -> int:
        """T, the bucketed token count (static)."""
        return self.packing.num_tokens


def _new_tokens(seqs: Sequence[StepSeq], token_ids: Sequence[Sequence[int]], q_lens: list[int]) -> np.ndarray:
    """The step's tokens, concatenated: ``token_ids[i]`` is all of request i's tokens or just the
    new ones; :class:`MetadataError` for ids past int32 (the packed buffer's type)."""
    total = sum(q_lens)
    if [len(ids) for ids in token_ids] == q_lens:  # a serving loop's chunks: just the new ones
        try:  # numpy refuses an int past int32 here: no range check after it
            return np.fromiter(itertools.chain.from_iterable(token_ids), np.int32, total)
        except OverflowError:
            flat = np.fromiter(itertools.chain.from_iterable(token_ids), np.int64, total)
    else:
        parts: list[int] = []
        for seq, ids in zip(seqs, token_ids, strict=True):
            start, count = seq.num_computed_tokens, seq.num_new_tokens
            if len(ids) >= start + count:
                parts.extend(ids[start : start + count])
            elif len(ids) == count:
                parts.extend(ids)
            else:
                raise MetadataError(
                    f"request {seq.request_id!r}: {len(ids)} token ids, expected the new "
                    f"{count} or at least num_computed + num_new = {start + count}"
                )
        flat = np.array(parts, dtype=np.int64)
    _check_int32("input_ids", flat)
    return flat


def _counts(seqs: Sequence[StepSeq]) -> tuple[np.ndarray, np.ndarray]:
    """Each sequence's computed and new token counts, int64, checked all at once (ints,
    computed >= 0, new > 0), else :class:`MetadataError` naming the first bad one."""
    computed = [seq.num_computed_tokens for seq in seqs]
    new = [seq.num_new_tokens for seq in seqs]
    try:
        in_range = min(computed) >= 0 and min(new) > 0
    except TypeError:  # not numbers: named below
        in_range = False
    if in_range:
        arrays = np.array(computed), np.array(new)
        if all(a.dtype.kind in "iu" for a in arrays):
            return arrays[0].astype(np.int64, copy=False), arrays[1].astype(np.int64, copy=False)
    for seq in seqs:  # the slow path, only to name the bad one
        ScheduledSeq(seq.request_id, seq.num_computed_tokens, seq.num_new_tokens)
    raise MetadataError(f"token counts must be ints: computed {computed!r:.100}, new {new!r:.100}")


def _check_lengths(
    seqs: Sequence[StepSeq], lengths: np.ndarray, needed: np.ndarray, group: int, block_size: int
) -> None:
    """:class:`BlockIdError` for the first sequence with fewer blocks than its tokens need."""
    short = lengths < needed
    if short.any():
        i = int(np.argmax(short))
        seq = seqs[i]
        raise BlockIdError(
            f"request {seq.request_id!r} has {lengths[i]} blocks in group {group}, needs {needed[i]} for "
            f"{seq.num_computed_tokens + seq.num_new_tokens} tokens of block size {block_size}"
        )


def _state_rows(
    seqs: Sequence[StepSeq],
    table: np.ndarray,
    rows: np.ndarray,
    kv_lens: np.ndarray,
    block_size: int,
    group: int,
    max_seqs: int,
) -> np.ndarray:
    """(3, max_seqs): read rows, write rows and fresh flags of one recurrent group
    (:func:`state_rows` of every sequence at once, from its rows of the group's ``table``)."""
    computed = kv_lens - np.array([s.num_new_tokens for s in seqs], dtype=np.int64)
    write = table[rows, -(-kv_lens // block_size) - 1]
    if not write.all():  # then the read row, which falls back to it, is null too
        i = int(np.argmin(write != 0))
        raise BlockIdError(
            f"request {seqs[i].request_id!r}, group {group}: the state after {seqs[i].num_computed_tokens} "
            f"(+{seqs[i].num_new_tokens}) tokens maps to the null row 0"
        )
    read = table[rows, np.maximum(-(-computed // block_size) - 1, 0)]
    out = np.zeros((3, max_seqs), dtype=np.int64)
    out[2, len(seqs) :] = 1
    out[0, : len(seqs)] = np.where(computed == 0, 0, np.where(read == 0, write, read))
    out[1, : len(seqs)] = write
    out[2, : len(seqs)] = computed == 0
    return out


def _unit_blocks(
    seqs: Sequence[StepSeq],
    heads: np.ndarray,
    unit_blocks: Callable[[int], Sequence[int]],
    pages_per_state: int,
    num_blocks: int | None,
    group: int,
    max_seqs: int,
) -> np.ndarray:
    """(2, max_seqs, pages_per_state): the blocks of each sequence's read and write units,
    checked like a block table (the null unit of a fresh read and padding: all null)."""
    out = np.zeros((2, max_seqs, pages_per_state), dtype=np.int64)
    limit = num_blocks if num_blocks is not None else _MAX_BLOCKS
    for which in range(2):
        for i, seq in enumerate(seqs):
            head = int(heads[which, i])
            if not head:
                continue
            if which and head == heads[0, i]:  # updated in place: the unit it read, already checked
                out[1, i] = out[0, i]
                continue
            blocks = np.asarray(unit_blocks(head), dtype=np.int64).reshape(-1)
            if len(blocks) != pages_per_state or ((blocks <= 0) | (blocks >= limit)).any():
                raise BlockIdError(
                    f"request {seq.request_id!r}, group {group}: the state unit of head {head} has blocks "
                    f"{blocks.tolist()}, expected {pages_per_state} real blocks in [1, {limit})"
                )
            out[which, i] = blocks
    return out


def table_limits(
    num_groups: int, num_blocks: int | None, state_groups: Collection[int] = (), num_states: int | None = None
) -> tuple[int, ...]:
    """The bound of each group's block ids (exclusive): ``num_blocks``, or for a recurrent group
    ``num_states`` when the states have a pool of their own; at most the int32 range."""
    blocks = min(num_blocks, _MAX_BLOCKS) if num_blocks is not None else _MAX_BLOCKS
    states = min(num_states, _MAX_BLOCKS) if num_states is not None else blocks
    return tuple(states if g in state_groups else blocks for g in range(num_groups))


class BuilderSettings(TypedDict, total=False):
    """The keywords of :class:`MetadataBuilder` (and so of :func:`build_step_metadata`), typed for its callers."""

    num_blocks: int | None
    state_groups: Sequence[int]
    num_states: int | None
    group_layers: Sequence[Sequence[str]]
    unit_blocks: Callable[[int], Sequence[int]] | None
    pages_per_state: int
    device: jax.Device | jax.sharding.Sharding | None


def build_step_metadata(
    seqs: Sequence[StepSeq],
    token_ids: Sequence[Sequence[int]],
    block_ids: Sequence[Sequence[Sequence[int]]],
    block_sizes: Sequence[int],
    buckets: Buckets,
    *,
    tables: BlockTables | None = None,
    **settings: Unpack[BuilderSettings],
) -> StepMetadata:
    """Build one step's metadata in numpy, packed in one buffer: a host array (``device``
    None; the jitted call it is passed to sends it) or placed on ``device``.

    ``seqs`` must list decodes (one new token) before prefills (see
    :func:`decodes_first`). ``token_ids[i]`` is sequence i's tokens, all of them or
    only the new ones; ``block_ids[i]`` is ``KVCacheManager.get_block_ids`` of it (one
    list per group) and ``block_sizes[g]`` group g's block size. Block ids must be
    ints in ``[0, num_blocks)``; pass ``num_blocks`` (the cache's): without it only the
    lower bound and the int32 range are checked. Raises :class:`BucketOverflowError`
    when a dimension exceeds its largest bucket and :class:`BlockIdError` for bad ids
    (negative, ``>= num_blocks``, not ints, too few, or the null block where a new
    token must be written), before anything is sent: the device ops trust what this
    returns (see the module docstring). Groups listed in ``state_groups`` are recurrent:
    they get :class:`StateMetadata` (rows checked against ``num_states``, the state
    pool's size, or ``num_blocks`` when the states live in the block pool) instead of a
    block table. ``device`` may be a sharding (replicated over a mesh, for a tensor-parallel
    step), also one spanning processes: every process then passes the same steps.
    ``group_layers`` names each group's layers (``[g.layer_names for g in config.groups]``),
    which :meth:`StepMetadata.group_of` looks layers up in; empty: no layer map.
    With states in the KV pages (``shared_pages``), ``pages_per_state`` > 0 and
    ``unit_blocks`` maps a state's head block to all its blocks
    (:meth:`jaxkv.core.manager.KVCacheManager.state_blocks`); each is checked against ``num_blocks``.

    ``tables`` are the caller's block tables kept across steps (a serving loop's; their
    limits must be :func:`table_limits` of these arguments): only the ids that changed since
    a request's last step are converted and checked. None: fresh tables for this call.
    ``settings``: the keywords of :class:`MetadataBuilder` (``num_blocks`` to ``device``).
    """
    return MetadataBuilder(block_sizes, buckets, **settings).build(seqs, token_ids, block_ids, tables)


class MetadataBuilder:
    """:func:`build_step_metadata` with the arguments that stay the same from step to step
    (a runner's block sizes, buckets, pools, groups, device) checked once, here, so that a
    serving loop's step pays only for its sequences (:meth:`build`)."""

    def __init__(
        self,
        block_sizes: Sequence[int],
        buckets: Buckets,
        *,
        num_blocks: int | None = None,
        state_groups: Sequence[int] = (),
        num_states: int | None = None,
        group_layers: Sequence[Sequence[str]] = (),
        unit_blocks: Callable[[int], Sequence[int]] | None = None,
        pages_per_state: int = 0,
        device: jax.Device | jax.sharding.Sharding | None = None,
    ) -> None:
        num_groups = len(block_sizes)
        if not num_groups or not all((type(b) is int or is_int(b)) and b > 0 for b in block_sizes):
            raise MetadataError(f"block_sizes must be positive ints, one per group: {block_sizes!r}")
        if num_blocks is not None:
            check_int("num_blocks", num_blocks, error=MetadataError)
        self.layer_map = tuple(tuple(names) for names in group_layers)
        if self.layer_map and len(self.layer_map) != num_groups:
            raise MetadataError(f"group_layers names {len(self.layer_map)} groups, expected {num_groups}")
        self.state_groups = frozenset(state_groups)
        if not self.state_groups <= set(range(num_groups)):
            raise MetadataError(f"state_groups {sorted(self.state_groups)} are not all groups of {num_groups}")
        if num_states is not None:
            check_int("num_states", num_states, error=MetadataError)
        if not is_int(pages_per_state) or pages_per_state < 0 or (pages_per_state > 0) != (unit_blocks is not None):
            raise MetadataError(
                f"pages_per_state={pages_per_state!r} must be an int >= 0, > 0 exactly when unit_blocks is given "
                f"(got {unit_blocks!r})"
            )
        self.block_sizes = tuple(int(b) for b in block_sizes)
        self.buckets = buckets
        self.num_blocks = num_blocks
        self.unit_blocks = unit_blocks
        self.pages_per_state = pages_per_state
        self.device = device
        self.limits = table_limits(num_groups, num_blocks, self.state_groups, num_states)
        """Each group's bound on its block ids (what the caller's :class:`BlockTables` must have)."""

    def build(
        self,
        seqs: Sequence[StepSeq],
        token_ids: Sequence[Sequence[int]],
        block_ids: Sequence[Sequence[Sequence[int]]],
        tables: BlockTables | None = None,
    ) -> StepMetadata:
        """One step's metadata (see :func:`build_step_metadata`)."""
        if not seqs:
            raise MetadataError("no sequences scheduled")
        if len(token_ids) != len(seqs) or len(block_ids) != len(seqs):
            raise MetadataError(f"{len(seqs)} seqs but {len(token_ids)} token lists and {len(block_ids)} block lists")
        block_sizes, buckets, limits = self.block_sizes, self.buckets, self.limits
        num_groups = len(block_sizes)
        if set(map(len, block_ids)) != {num_groups}:
            seq, ids = next((s, ids) for s, ids in zip(seqs, block_ids, strict=True) if len(ids) != num_groups)
            raise MetadataError(
                f"request {seq.request_id!r} has block ids for {len(ids)} groups, expected {num_groups}"
            )
        n = len(seqs)
        computed, q_lens = _counts(seqs)
        kv_lens = computed + q_lens
        total = int(q_lens.sum())
        if total != n:  # some prefill (every count is >= 1): decodes must come first
            decodes = q_lens == 1
            if (decodes[1:] > decodes[:-1]).any():
                late = seqs[int(np.argmax(decodes[1:] > decodes[:-1])) + 1]
                raise MetadataError(
                    f"decode {late.request_id!r} comes after a prefill; order seqs with decodes_first()"
                )
        num_tokens = bucket(total, buckets.tokens, "tokens")
        max_seqs = bucket(n, buckets.seqs, "seqs")
        if kv_lens.max() > _INT32.max:  # kv_lens >= 1: only the top can overflow
            _check_int32("kv_lens", kv_lens)
        state_group_set, unit_blocks = self.state_groups, self.unit_blocks
        if tables is None:
            tables = BlockTables(limits)
        elif tables.limits != limits:
            raise MetadataError(f"the block tables bound groups' ids by {tables.limits}, this step by {limits}")
        rows = tables.rows([seq.request_id for seq in seqs], block_ids)
        widths: list[int | None] = []
        states: dict[int, np.ndarray] = {}
        units: dict[int, np.ndarray] = {}
        for g, block_size in enumerate(block_sizes):
            lengths = tables.lengths(g, rows)
            _check_lengths(seqs, lengths, -(-kv_lens // block_size), g, block_size)
            if g in state_group_set:
                states[g] = _state_rows(seqs, tables.table(g), rows, kv_lens, block_size, g, max_seqs)
                if unit_blocks is not None:
                    units[g] = _unit_blocks(
                        seqs, states[g], unit_blocks, self.pages_per_state, self.num_blocks, g, max_seqs
                    )
                widths.append(None)
            else:
                widths.append(bucket(int(lengths.max()), buckets.blocks, f"blocks of group {g}"))

        packing = _packing(num_tokens, max_seqs, tuple(widths), self.pages_per_state)
        offsets = packing.offsets
        packed = np.zeros(offsets["_end"][0], dtype=np.int32)

        def put(name: str, values: np.ndarray) -> None:
            start = offsets[name][0]
            packed[start : start + values.size] = values.reshape(-1)

        if total == n:  # all decodes: one token each, at its computed length
            token_rows, positions = rows, computed
        else:
            seq_of_token = np.repeat(np.arange(n), q_lens)
            positions = np.arange(total) + (kv_lens - np.cumsum(q_lens))[seq_of_token]
            token_rows = rows[seq_of_token]
        put("input_ids", _new_tokens(seqs, token_ids, q_lens.tolist()))
        put("positions", positions)
        put("kv_lens", kv_lens)
        cu = offsets["cu_q_lens"][0]
        ends = np.arange(1, n + 1) if total == n else np.cumsum(q_lens)
        packed[cu + 1 : cu + n + 1] = ends
        packed[cu + n + 1 : cu + max_seqs + 1] = total  # padded sequences: empty
        packed[offsets["num_seqs"][0]] = n
        put("logits_indices", ends - 1)
        for g, (width, block_size) in enumerate(zip(widths, block_sizes, strict=True)):
            if width is None:
                read, write, fresh = states[g]
                put(f"read{g}", read)
                put(f"write{g}", write)
                put(f"fresh{g}", fresh)
                if g in units:
                    put(f"read_blocks{g}", units[g][0])
                    put(f"write_blocks{g}", units[g][1])
                continue
            start = offsets[f"tables{g}"][0]
            table = packed[start : start + max_seqs * width].reshape(max_seqs, width)
            source = tables.table(g)
            w = min(width, source.shape[1])
            table[:n, :w] = source[rows, :w]  # ids < their limit <= 2**31: they fit int32
            block = source[token_rows, positions // block_size]
            if not block.all():
                t = int(np.argmin(block != 0))
                seq = seqs[t if total == n else int(seq_of_token[t])]
                raise BlockIdError(
                    f"request {seq.request_id!r}, group {g}: new token at position {positions[t]} "
                    "maps to the null block 0"
                )
            slots = block * block_size + positions % block_size
            if limits[g] * block_size > _INT32.max + 1:  # else every slot is below 2**31
                _check_int32(f"slots{g}", slots)
            put(f"slots{g}", slots)
        device = self.device
        return StepMetadata(packed if device is None else place_values(packed, device), packing, self.layer_map)


def _check_int32(name: str, values: np.ndarray) -> None:
    """:class:`MetadataError` unless ``values`` (int64) fit int32 (the packed buffer's type)."""
    if values.size and (values.max() > _INT32.max or values.min() < _INT32.min):
        raise MetadataError(f"{name}: values [{values.min()}, {values.max()}] do not fit int32")


def attention_metadata(
    layers: Sequence[str],
    block_tables: np.ndarray | jax.Array,
    kv_lens: np.ndarray | jax.Array,
    cu_q_lens: np.ndarray | jax.Array,
    num_seqs: np.ndarray | jax.Array,
    slot_mapping: np.ndarray | jax.Array | None = None,
    *,
    num_tokens: int | None = None,
) -> StepMetadata:
    """Step metadata of one attention group (``layers``) over arrays a caller already
    holds: a kernel's test or benchmark drawing its own ragged batch. Nothing is checked
    (see the module docstring): prefer :func:`build_step_metadata`. ``block_tables``
    ``(S, W)``, ``kv_lens`` ``(S,)``, ``cu_q_lens`` ``(S+1,)``, ``num_seqs`` ``(1,)``;
    ``slot_mapping`` ``(T,)`` (None: every token writes the null slot 0) and ``num_tokens``
    T (None: ``slot_mapping``'s length, else ``cu_q_lens[-1]``). Token ids and positions
    are zeros; logits are read at each sequence's last token."""
    tables, kv, cu, count = (np.asarray(x, dtype=np.int64) for x in (block_tables, kv_lens, cu_q_lens, num_seqs))
    slots = None if slot_mapping is None else np.asarray(slot_mapping, dtype=np.int64)
    tokens = num_tokens if num_tokens is not None else len(slots) if slots is not None else int(cu[-1])
    packing = _Packing(tokens, tables.shape[0], (tables.shape[1],))
    offsets = packing.offsets
    packed = np.zeros(offsets["_end"][0], dtype=np.int32)
    fields = {
        "kv_lens": kv,
        "cu_q_lens": cu,
        "num_seqs": count,
        "logits_indices": np.maximum(cu[1:] - 1, 0),
        "tables0": tables,
        "slots0": np.zeros(tokens, np.int64) if slots is None else slots,
    }
    for name, values in fields.items():
        start = offsets[name][0]
        packed[start : start + values.size] = values.reshape(-1)
    return StepMetadata(jax.device_put(packed), packing, (tuple(layers),))


def place_values(values: np.ndarray | jax.Array, device: jax.Device | jax.sharding.Sharding | None = None) -> jax.Array:
    """``values`` on ``device`` (a device or a sharding; None: the default device). A
    sharding whose devices span processes is filled by each process from its own copy of
    the values (every process holding the same), never by sending the whole array to one
    device."""
    if isinstance(device, jax.sharding.Sharding) and not device.is_fully_addressable:
        host = np.asarray(values)
        return jax.make_array_from_callback(host.shape, device, lambda index: host[index])
    return jax.device_put(values, device)
