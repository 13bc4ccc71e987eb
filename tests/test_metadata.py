"""jaxkv.device.metadata: step metadata from scheduled sequences and manager block ids."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv import ops
from jaxkv.device import metadata
from jaxkv.device.cache import UnknownLayerError, allocate_kv_cache
from jaxkv.device.metadata import (
    BlockIdError,
    BucketOverflowError,
    Buckets,
    GroupKindError,
    MetadataError,
    ScheduledSeq,
    StepMetadata,
    bucket,
    build_step_metadata,
    decodes_first,
    state_rows,
)
from jaxkv.planner import KVCacheConfig, KVCacheGroup
from jaxkv.specs import FullAttentionSpec

BUCKETS = Buckets(tokens=(8, 16, 32), seqs=(2, 4, 8), blocks=(2, 4, 8))


def host(md: StepMetadata) -> dict[str, np.ndarray]:
    fields = ("input_ids", "positions", "kv_lens", "cu_q_lens", "num_seqs", "logits_indices")
    out = {f: np.asarray(getattr(md, f)) for f in fields}
    for g, group in enumerate(md.groups):
        out[f"tables{g}"] = np.asarray(group.block_tables)
        out[f"slots{g}"] = np.asarray(group.slot_mapping)
    return out


def example():
    """Two decodes then two prefills (one fresh, one continuing a chunk), two groups.

    Group 0 has blocks of 4 tokens, group 1 blocks of 8; group 0 of request "c" starts
    with a null (out-of-window) block, as a sliding-window manager leaves it.
    """
    seqs = [
        ScheduledSeq("a", 5, 1),  # decode at position 5: block 1 of group 0, offset 1
        ScheduledSeq("b", 8, 1),  # decode at position 8: first slot of a fresh block
        ScheduledSeq("c", 6, 4),  # prefill chunk 6..9, crosses a group-0 block boundary
        ScheduledSeq("d", 0, 3),  # fresh prefill
    ]
    tokens = [
        list(range(100, 106)),  # all of "a"'s tokens: the builder takes the new one
        [208],  # only the new token
        list(range(300, 312)),  # more than computed + new (the prompt's tail)
        [400, 401, 402],
    ]
    block_ids = [
        ([3, 4], [5]),
        ([6, 7, 8], [9, 10]),
        ([0, 11, 12], [13, 14]),
        ([15], [16]),
    ]
    return seqs, tokens, block_ids


def test_layout_of_a_mixed_batch():
    seqs, tokens, block_ids = example()
    md = build_step_metadata(seqs, tokens, block_ids, [4, 8], BUCKETS, num_blocks=20)
    h = host(md)
    # 9 tokens -> bucket 16; 4 seqs -> 4; widest table 3 (group 0) -> 4, 2 (group 1) -> 2.
    assert md.num_tokens == 16
    np.testing.assert_array_equal(h["input_ids"], [105, 208, 306, 307, 308, 309, 400, 401, 402] + [0] * 7)
    np.testing.assert_array_equal(h["positions"], [5, 8, 6, 7, 8, 9, 0, 1, 2] + [0] * 7)
    np.testing.assert_array_equal(h["kv_lens"], [6, 9, 10, 3])
    np.testing.assert_array_equal(h["cu_q_lens"], [0, 1, 2, 6, 9])
    np.testing.assert_array_equal(h["num_seqs"], [4])
    np.testing.assert_array_equal(h["logits_indices"], [0, 1, 5, 8])
    np.testing.assert_array_equal(h["tables0"], [[3, 4, 0, 0], [6, 7, 8, 0], [0, 11, 12, 0], [15, 0, 0, 0]])
    np.testing.assert_array_equal(h["tables1"], [[5, 0], [9, 10], [13, 14], [16, 0]])
    # Per group: block_id * block_size + offset; padding tokens -> slot 0 (null block).
    np.testing.assert_array_equal(
        h["slots0"],
        [4 * 4 + 1, 8 * 4, 11 * 4 + 2, 11 * 4 + 3, 12 * 4, 12 * 4 + 1, 60, 61, 62] + [0] * 7,
    )
    np.testing.assert_array_equal(
        h["slots1"],
        [5 * 8 + 5, 10 * 8, 13 * 8 + 6, 13 * 8 + 7, 14 * 8, 14 * 8 + 1, 128, 129, 130] + [0] * 7,
    )
    assert all(v.dtype == np.int32 for v in h.values())
    assert all((v >= 0).all() for v in h.values()), "padding is 0, never -1"


def test_padded_sequences_are_empty_and_point_at_the_null_block():
    seqs, tokens, block_ids = example()
    md = build_step_metadata(seqs[:3], tokens[:3], block_ids[:3], [4, 8], BUCKETS)
    h = host(md)
    assert h["kv_lens"].shape == (4,) and h["kv_lens"][3] == 0
    np.testing.assert_array_equal(h["cu_q_lens"], [0, 1, 2, 6, 6])
    assert h["logits_indices"][3] == 0
    assert not h["tables0"][3].any() and not h["tables1"][3].any()
    assert h["num_seqs"][0] == 3 and md.num_tokens == 8
    assert not h["slots0"][6:].any() and not h["slots1"][6:].any()


def test_one_leaf_one_transfer_and_a_bounded_number_of_shapes():
    seqs, tokens, block_ids = example()
    md = build_step_metadata(seqs, tokens, block_ids, [4, 8], BUCKETS)
    (leaf,) = jax.tree_util.tree_leaves(md)
    assert isinstance(leaf, np.ndarray) and leaf.dtype == np.int32 and leaf.ndim == 1

    traces = []

    @jax.jit
    def step(md):
        traces.append(1)
        return md.kv_lens.sum() + md.groups[1].block_tables.sum() + md.input_ids[0]

    assert int(step(md)) == 28 + 67 + 105
    # Other batches that round to the same buckets reuse the compiled step.
    for n in range(1, 4):
        md2 = build_step_metadata(seqs[:n], tokens[:n], block_ids[:n], [4, 8], BUCKETS)
        if (md2.num_tokens, md2.packing.max_seqs, md2.packing.widths) == (16, 4, (4, 2)):
            step(md2)
    shapes = set()
    for total in range(1, 33):
        md3 = build_step_metadata(
            [ScheduledSeq("x", 0, total)],
            [list(range(total))],
            [([1] * 8, [2] * 4)],
            [4, 8],
            BUCKETS,
        )
        shapes.add(md3.packing)
    assert len(shapes) == 3  # tokens buckets 8, 16, 32


def test_decodes_must_come_first():
    seqs, tokens, block_ids = example()
    order = [3, 0, 2, 1]
    shuffled = [seqs[i] for i in order]
    with pytest.raises(MetadataError, match="decode 'a' comes after a prefill"):
        build_step_metadata(shuffled, [tokens[i] for i in order], [block_ids[i] for i in order], [4, 8], BUCKETS)
    fixed = decodes_first(shuffled)
    assert [shuffled[i].request_id for i in fixed] == ["a", "b", "d", "c"]


def test_buckets():
    assert bucket(5, (4, 8, 16), "tokens") == 8
    assert bucket(8, (4, 8, 16), "tokens") == 8
    b = Buckets.powers_of_two(100, 3, 16)
    assert b.tokens == (8, 16, 32, 64, 100) and b.seqs == (3,) and b.blocks == (8, 16)
    with pytest.raises(MetadataError, match="strictly increasing"):
        Buckets((8, 4), (1,), (1,))
    with pytest.raises(MetadataError, match="positive ints"):
        Buckets((0,), (1,), (1,))


def test_too_many_tokens_seqs_or_blocks_name_the_value():
    big = [ScheduledSeq("x", 0, 33)]
    with pytest.raises(BucketOverflowError, match="tokens=33 exceeds the largest bucket 32"):
        build_step_metadata(big, [list(range(33))], [([1] * 9, [2] * 5)], [4, 8], BUCKETS)
    many = [ScheduledSeq(str(i), 3, 1) for i in range(9)]
    with pytest.raises(BucketOverflowError, match="seqs=9"):
        build_step_metadata(many, [[1]] * 9, [([1], [2])] * 9, [4, 8], BUCKETS)
    long = [ScheduledSeq("x", 60, 1)]
    with pytest.raises(BucketOverflowError, match="blocks of group 0=16"):
        build_step_metadata(long, [[1]], [(list(range(1, 17)), list(range(1, 9)))], [4, 8], BUCKETS)


def test_bad_block_ids_are_typed_errors_naming_the_value():
    seqs, tokens, block_ids = example()
    bad = list(block_ids)
    bad[1] = ([6, 7, 25], [9, 10])
    with pytest.raises(BlockIdError, match=r"'b', group 0: block id 25 out of range \[0, 20\)"):
        build_step_metadata(seqs, tokens, bad, [4, 8], BUCKETS, num_blocks=20)
    bad[1] = ([6, -1, 8], [9, 10])
    with pytest.raises(BlockIdError, match=r"block id -1 out of range \[0, 2147483648\)"):
        build_step_metadata(seqs, tokens, bad, [4, 8], BUCKETS)  # no num_blocks: lower bound only
    bad[1] = ([6, 7], [9, 10])
    with pytest.raises(BlockIdError, match="'b' has 2 blocks in group 0, needs 3"):
        build_step_metadata(seqs, tokens, bad, [4, 8], BUCKETS)
    bad[1] = ([6, 7, 0], [9, 10])
    with pytest.raises(BlockIdError, match="position 8 maps to the null block"):
        build_step_metadata(seqs, tokens, bad, [4, 8], BUCKETS)


@pytest.mark.parametrize(
    "table,match",
    [
        ([-1], r"'x', group 0: block id -1 out of range \[0, 20\)"),  # slot -1: the last block's
        ([20], r"'x', group 0: block id 20 out of range \[0, 20\)"),  # == num_blocks
        ([3, 5, 7, 21], "block id 21 out of range"),  # an entry no new token writes
        ([1.0], r"block ids must be ints, got \[1.0\]"),  # would be truncated silently
        ([True], r"block ids must be ints, got \[True\]"),
    ],
)
def test_ids_the_device_would_wrap_or_drop_are_refused_before_any_transfer(table, match, monkeypatch):
    """The ops trust slots: slot -1 would write into the last block (a -1 gather wraps)
    and a slot past the cache would be dropped. The builder refuses the block ids that
    give them, naming the value, and sends nothing."""
    monkeypatch.setattr(metadata, "place_values", lambda *a, **k: pytest.fail("sent bad metadata"))
    seq = ScheduledSeq("x", 0, 1)
    with pytest.raises(BlockIdError, match=match):
        build_step_metadata([seq], [[7]], [(table,)], [1], BUCKETS, num_blocks=20, device=jax.devices()[0])


def test_positions_and_counts_that_would_give_slot_minus_one_are_refused():
    with pytest.raises(MetadataError, match="num_computed_tokens=-1 must be an int >= 0"):
        ScheduledSeq("x", -1, 1)  # position -1: slot -1
    with pytest.raises(MetadataError, match=r"num_computed_tokens=2.5"):
        ScheduledSeq("x", 2.5, 1)
    with pytest.raises(MetadataError, match="num_new_tokens=True"):
        ScheduledSeq("x", 0, True)
    seqs, tokens, block_ids = example()
    for bad in (0, -3, 2.0):
        with pytest.raises(MetadataError, match=f"num_blocks must be a positive int, got {bad!r}"):
            build_step_metadata(seqs, tokens, block_ids, [4, 8], BUCKETS, num_blocks=bad)


def test_any_object_with_the_counts_is_taken_and_its_counts_checked_at_once(monkeypatch):
    """A serving loop passes its scheduler's chunks as they are (no ScheduledSeq each): the
    same metadata; bad counts are refused naming the request, before anything is sent."""
    from typing import NamedTuple

    class Chunk(NamedTuple):
        request_id: str
        num_computed_tokens: object
        num_new_tokens: object

    seqs, tokens, block_ids = example()
    chunks = [Chunk(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in seqs]
    want = host(build_step_metadata(seqs, tokens, block_ids, [4, 8], BUCKETS))
    got = host(build_step_metadata(chunks, tokens, block_ids, [4, 8], BUCKETS))
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    monkeypatch.setattr(metadata, "place_values", lambda *a, **k: pytest.fail("sent bad metadata"))
    for computed, new, match in ((-1, 1, "'d': num_computed_tokens=-1"), (0, 2.5, "'d'.*num_new_tokens=2.5")):
        bad = [*chunks[:3], Chunk("d", computed, new)]
        with pytest.raises(MetadataError, match=match):
            build_step_metadata(bad, tokens, block_ids, [4, 8], BUCKETS, device=jax.devices()[0])


def test_errors_are_jaxkv_errors():
    from jaxkv.errors import JaxkvError

    assert issubclass(BlockIdError, JaxkvError) and issubclass(BlockIdError, ValueError)
    assert issubclass(BucketOverflowError, MetadataError) and issubclass(MetadataError, JaxkvError)


def test_bad_sequences_and_tokens():
    with pytest.raises(MetadataError, match="num_new_tokens=0"):
        ScheduledSeq("x", 3, 0)
    with pytest.raises(MetadataError, match="'x': 2 token ids"):
        build_step_metadata([ScheduledSeq("x", 3, 3)], [[1, 2]], [([1, 2], [3])], [4, 8], BUCKETS)
    with pytest.raises(MetadataError, match="block ids for 1 groups, expected 2"):
        build_step_metadata([ScheduledSeq("x", 0, 1)], [[1]], [([1],)], [4, 8], BUCKETS)
    with pytest.raises(MetadataError, match="no sequences"):
        build_step_metadata([], [], [], [4], BUCKETS)


def test_one_transfer_per_step(monkeypatch):
    """One buffer: left on the host for the jitted call to send, or placed in one transfer."""
    seqs, tokens, block_ids = example()
    calls = []
    real = metadata.place_values
    monkeypatch.setattr(metadata, "place_values", lambda *a, **k: calls.append(1) or real(*a, **k))
    md = build_step_metadata(seqs, tokens, block_ids, [4, 8], BUCKETS)
    assert not calls and isinstance(md.packed, np.ndarray) and len(jax.tree.leaves(md)) == 1
    placed = build_step_metadata(seqs, tokens, block_ids, [4, 8], BUCKETS, device=jax.devices()[0])
    assert len(calls) == 1 and isinstance(placed.packed, jax.Array) and len(jax.tree.leaves(placed)) == 1
    np.testing.assert_array_equal(np.asarray(placed.packed), md.packed)


def test_metadata_drives_write_and_attention_end_to_end():
    """Two steps (prefills of 6 and 3 tokens, then two decodes) through ops, checked
    against dense causal attention over each sequence's K/V."""
    spec = FullAttentionSpec(num_kv_heads=1, head_size=4, dtype="float32")
    config = KVCacheConfig(num_blocks=8, groups=(KVCacheGroup(("l",), spec, 4),))
    cache = allocate_kv_cache(config)
    rng = np.random.default_rng(0)
    blocks = {"p": ([3, 5],), "q": ([6],)}
    keys = {r: rng.standard_normal((8, 1, 4)).astype(np.float32) for r in blocks}

    @jax.jit
    def step(cache, md, k, q):
        cache = ops.write_kv(cache, "l", k, k, md)
        return cache, ops.paged_attention(q, cache, "l", md, sm_scale=1.0)

    def run(cache, seqs):
        md = build_step_metadata(
            seqs,
            [[0] * s.num_new_tokens for s in seqs],
            [blocks[s.request_id] for s in seqs],
            [4],
            BUCKETS,
            group_layers=[config.groups[0].layer_names],
        )
        k = np.zeros((md.num_tokens, 1, 4), np.float32)
        k[: sum(s.num_new_tokens for s in seqs)] = np.concatenate(
            [keys[s.request_id][s.num_computed_tokens : s.num_computed_tokens + s.num_new_tokens] for s in seqs]
        )
        return step(cache, md, k, np.repeat(k, 2, axis=1))

    def dense(request: str, length: int) -> np.ndarray:
        kv = keys[request][:length, 0]
        scores = kv[-1] @ kv.T
        weights = np.exp(scores - scores.max())
        return weights @ kv / weights.sum()

    cache, _ = run(cache, [ScheduledSeq("p", 0, 6), ScheduledSeq("q", 0, 3)])
    cache, out = run(cache, [ScheduledSeq("p", 6, 1), ScheduledSeq("q", 3, 1)])
    np.testing.assert_allclose(np.asarray(out[0, 0]), dense("p", 7), atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[1, 1]), dense("q", 4), atol=1e-5)


# ------------------------------------------------------------- recurrent groups
def test_state_rows_read_the_computed_state_and_write_the_newest():
    assert state_rows([0, 0, 5], 40, 1, 16) == (5, 5), "running state updated in place"
    assert state_rows([0, 0, 0, 5], 48, 1, 16) == (5, 5), "the slot moved to the newest index"
    assert state_rows([0, 0, 3, 7], 48, 1, 16) == (3, 7), "copy-on-write from a checkpoint"
    assert state_rows([9], 0, 16, 16) == (0, 9), "nothing computed: nothing read"


def test_recurrent_group_gets_state_rows_instead_of_a_table():
    seqs = [ScheduledSeq("dec", 48, 1), ScheduledSeq("new", 0, 5)]
    block_ids = [([1, 2, 3, 4], [0, 0, 3, 7]), ([5], [6])]
    md = build_step_metadata(
        seqs, [[1], [1, 2, 3, 4, 5]], block_ids, (16, 16), BUCKETS, num_blocks=8, state_groups=(1,), num_states=8
    )
    attention, state = md.groups
    assert np.asarray(attention.block_tables).shape == (2, 4)
    assert np.asarray(state.read_rows).tolist() == [3, 0]
    assert np.asarray(state.write_rows).tolist() == [7, 6]
    assert np.asarray(state.fresh).tolist() == [0, 1]


def test_a_layer_gets_its_own_kind_of_metadata_and_is_refused_the_other():
    md = build_step_metadata(
        [ScheduledSeq("a", 0, 3)],
        [[1, 2, 3]],
        [([1], [2])],
        (16, 16),
        BUCKETS,
        state_groups=(1,),
        group_layers=[("attn.0",), ("delta.0",)],
    )
    np.testing.assert_array_equal(md.attention_of("attn.0").block_tables, md.groups[0].block_tables)
    np.testing.assert_array_equal(md.states_of("delta.0").write_rows, md.groups[1].write_rows)
    with pytest.raises(GroupKindError, match=r"'delta\.0' is a recurrent layer"):
        md.attention_of("delta.0")
    with pytest.raises(GroupKindError, match=r"'attn\.0' has a KV cache group of pages"):
        md.states_of("attn.0")
    with pytest.raises(UnknownLayerError, match=r"'attn\.1' is in no KV cache group"):
        md.states_of("attn.1")


def test_padded_sequences_read_and_write_the_null_row_from_zeros():
    md = build_step_metadata(
        [ScheduledSeq("a", 0, 3)], [[1, 2, 3]], [([1], [2])], (16, 16), Buckets((8,), (4,), (2,)), state_groups=(1,)
    )
    state = md.groups[1]
    assert np.asarray(state.write_rows).tolist() == [2, 0, 0, 0]
    assert np.asarray(state.fresh).tolist() == [1, 1, 1, 1]


def test_state_rows_out_of_range_or_null_are_refused():
    seq = [ScheduledSeq("a", 16, 1)]
    with pytest.raises(BlockIdError, match="out of range"):
        build_step_metadata(seq, [[1]], [([1, 2], [0, 9])], (16, 16), BUCKETS, state_groups=(1,), num_states=8)
    with pytest.raises(BlockIdError, match="null row"):
        build_step_metadata(seq, [[1]], [([1, 2], [4, 0])], (16, 16), BUCKETS, state_groups=(1,), num_states=8)
    with pytest.raises(MetadataError, match="state_groups"):
        build_step_metadata(seq, [[1]], [([1, 2], [4, 5])], (16, 16), BUCKETS, state_groups=(2,))


UNITS = {3: [3, 9, 10], 6: [6, 11, 12], 7: [7, 13, 14]}
"""Heads of state units of 3 blocks -> all their blocks (what KVCacheManager.state_blocks gives)."""


def test_states_in_kv_pages_get_the_blocks_of_their_read_and_write_units():
    seqs = [ScheduledSeq("dec", 48, 1), ScheduledSeq("new", 0, 5)]
    block_ids = [([1, 2, 3, 4], [0, 0, 3, 7]), ([5], [6])]
    md = build_step_metadata(
        seqs,
        [[1], [1, 2, 3, 4, 5]],
        block_ids,
        (16, 16),
        BUCKETS,
        num_blocks=16,
        state_groups=(1,),
        unit_blocks=UNITS.__getitem__,
        pages_per_state=3,
    )
    state = md.groups[1]
    assert np.asarray(state.read_rows).tolist() == [3, 0]
    assert np.asarray(state.read_blocks).tolist() == [[3, 9, 10], [0, 0, 0]]  # a fresh read: the null unit
    assert np.asarray(state.write_blocks).tolist() == [[7, 13, 14], [6, 11, 12]]
    rows = build_step_metadata(seqs, [[1], [1, 2, 3, 4, 5]], block_ids, (16, 16), BUCKETS, state_groups=(1,))
    assert np.asarray(rows.groups[1].read_blocks).shape == (2, 0)  # state rows: no unit


@pytest.mark.parametrize(
    ("units", "pages", "match"),
    [
        ({6: [6, 11]}, 3, r"head 6 has blocks \[6, 11\], expected 3 real blocks in \[1, 16\)"),
        ({6: [6, 0, 12]}, 3, "expected 3 real blocks"),
        ({6: [6, 11, 16]}, 3, "expected 3 real blocks"),
    ],
)
def test_units_of_the_wrong_size_or_with_bad_blocks_are_refused(units, pages, match):
    seq = [ScheduledSeq("new", 0, 5)]
    with pytest.raises(BlockIdError, match=match):
        build_step_metadata(
            seq,
            [[1] * 5],
            [([5], [6])],
            (16, 16),
            BUCKETS,
            num_blocks=16,
            state_groups=(1,),
            unit_blocks=units.__getitem__,
            pages_per_state=pages,
        )


def test_units_and_their_size_come_together():
    seq = [ScheduledSeq("new", 0, 5)]
    with pytest.raises(MetadataError, match="pages_per_state=0 must be an int >= 0, > 0 exactly when unit_blocks"):
        build_step_metadata(seq, [[1] * 5], [([5], [6])], (16, 16), BUCKETS, state_groups=(1,), unit_blocks=print)


def test_each_layer_finds_its_own_group():
    seqs, tokens, block_ids = example()
    layers = [("local.0", "local.1"), ("global.0",)]
    md = build_step_metadata(seqs, tokens, block_ids, [4, 8], BUCKETS, group_layers=layers)
    for layer, g in (("local.1", 0), ("global.0", 1)):
        np.testing.assert_array_equal(md.group_of(layer).block_tables, md.groups[g].block_tables)
        np.testing.assert_array_equal(md.group_of(layer).slot_mapping, md.groups[g].slot_mapping)
    with pytest.raises(UnknownLayerError, match=r"layer 'global.1' is in no KV cache group.*\['global.0'\]"):
        md.group_of("global.1")
    with pytest.raises(UnknownLayerError, match=r"'local.0' is in no KV cache group"):
        build_step_metadata(seqs, tokens, block_ids, [4, 8], BUCKETS).group_of("local.0")  # no layer map
    with pytest.raises(MetadataError, match="group_layers names 1 groups, expected 2"):
        build_step_metadata(seqs, tokens, block_ids, [4, 8], BUCKETS, group_layers=layers[:1])


def test_values_past_int32_are_refused_naming_them():
    """The packed buffer is int32: a token id or a slot past it is refused, not wrapped."""
    seq = ScheduledSeq("x", 0, 1)
    with pytest.raises(MetadataError, match=r"input_ids: values \[2147483648, 2147483648\] do not fit int32"):
        build_step_metadata([seq], [[2**31]], [([1],)], [4], BUCKETS)
    with pytest.raises(MetadataError, match=r"slots0: values \[4294967296, 4294967296\] do not fit int32"):
        build_step_metadata([seq], [[7]], [([2**30],)], [4], BUCKETS)  # no num_blocks: ids up to 2**31
    md = build_step_metadata([seq], [[-3]], [([19],)], [4], BUCKETS, num_blocks=20)  # a negative id stays
    assert host(md)["input_ids"][0] == -3 and host(md)["slots0"][0] == 76
