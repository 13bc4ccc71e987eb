"""jaxkv.device.steady: a steady decode step's metadata, advanced on the device, equals a fresh build's."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jaxkv.device.block_table import BlockTables
from jaxkv.device.metadata import BlockIdError, Buckets, MetadataBuilder, ScheduledSeq, build_step_metadata
from jaxkv.device.steady import SteadyDecode, advance

SIZES = (4, 8, 8)  # full attention, a sliding window, a recurrent group
BUCKETS = Buckets((8, 64), (8,), (16, 32))


def settings(shared: bool) -> dict:
    """The builder's keywords: states in rows of their own, or kept in the KV pages (units of 2)."""
    if shared:
        return {
            "num_blocks": 50,
            "state_groups": (2,),
            "unit_blocks": lambda head: [head, head + 1],
            "pages_per_state": 2,
        }
    return {"num_blocks": 50, "state_groups": (2,), "num_states": 30}


@functools.cache
def advanced():
    return jax.jit(lambda meta, delta: advance(meta, delta, SIZES).packed)


def grow(rng, lists, computed: int, new: int, state_limit: int) -> None:
    """Give each group the blocks ``computed + new`` tokens need; a window nulls an old block and a
    recurrent state sometimes moves (its old block nulled) when a block fills."""
    for g, size in enumerate(SIZES):
        limit = state_limit if g == 2 else 50
        while len(lists[g]) * size < computed + new:
            if g == 2 and lists[g] and rng.random() < 0.3:
                lists[g][-1] = 0
            lists[g].append(int(rng.integers(1, limit)))
    if computed > 12 and rng.random() < 0.3:
        lists[1][(computed - 12) // 8] = 0


@pytest.mark.parametrize("shared", [False, True], ids=["state rows", "shared pages"])
def test_advanced_metadata_equals_a_fresh_build_over_a_random_run(shared):
    """Random steps (joins, finishes, preemption, chunked prefills, block crossings, window nulls,
    states moving, fed and known tokens, table widths changing): whatever path a step takes, the
    metadata it runs on equals a fresh build's, and most decode steps take the steady path."""
    rng = np.random.default_rng(1)
    keywords = settings(shared)
    builder = MetadataBuilder(SIZES, BUCKETS, device=jax.devices()[0], **keywords)
    steady = SteadyDecode(builder, capacity=24)
    tables = BlockTables(builder.limits, rows=2, width=2)
    state_limit = 49 if shared else 30
    live: dict[str, list] = {}
    counts = {"steady": 0, "full": 0}
    for step in range(160):
        if len(live) < 6 and rng.random() < 0.06:
            live[f"r{step}"] = [0, [[], [], []], 0]
        for request_id, state in list(live.items()):
            if rng.random() < 0.015 or state[0] > 110:
                del live[request_id]
            elif rng.random() < 0.01:  # preempted: nothing computed, new blocks
                live[request_id] = [0, [[], [], []], 0]
        seqs, tokens, block_ids = [], [], []
        for request_id, state in sorted(live.items(), key=lambda kv: kv[1][0] < 10):
            computed, lists, _ = state
            new = 1 if computed >= 10 else min(10 - computed, int(rng.integers(2, 7)))  # prefill in chunks
            grow(rng, lists, computed, new, state_limit)
            state[0] = computed + new
            seqs.append(ScheduledSeq(request_id, computed, new))
            fed = new == 1 and rng.random() < 0.8
            tokens.append([-1 - len(seqs) + 1] if fed else [int(t) for t in rng.integers(0, 1000, new)])
            block_ids.append(tuple(list(ids) for ids in lists))
        if not seqs:
            continue
        plan = steady.plan(seqs, tokens, block_ids, tables)
        if plan is None:
            meta = builder.build(seqs, tokens, block_ids, tables)
            delta, record = steady.idle, steady.start(seqs, tokens, meta)
            counts["full"] += 1
        else:
            meta, delta, record = plan
            counts["steady"] += 1
        got = advanced()(meta, delta)
        fresh = build_step_metadata(seqs, tokens, block_ids, SIZES, BUCKETS, **keywords)
        assert meta.packing == fresh.packing
        np.testing.assert_array_equal(np.asarray(got), fresh.packed, err_msg=f"step {step}")
        steady.keep(record, got)
    assert counts["steady"] > 60 and counts["full"] > 20, counts


def test_a_step_needing_a_block_it_lacks_is_built_in_full_and_refused_there():
    builder = MetadataBuilder((4,), BUCKETS, num_blocks=50, device=jax.devices()[0])
    steady = SteadyDecode(builder, capacity=8)
    tables = BlockTables(builder.limits)
    seqs, tokens = [ScheduledSeq("a", 2, 1)], [[-1]]
    meta = builder.build(seqs, tokens, [([7],)], tables)
    steady.keep(steady.start(seqs, tokens, meta), meta.packed)
    later = [ScheduledSeq("a", 3, 1)]
    plan = steady.plan(later, tokens, [([7],)], tables)
    assert plan is not None
    steady.keep(plan[2], advanced_one()(plan[0], plan[1]))
    short = [ScheduledSeq("a", 4, 1)]  # position 4 needs a second block the list lacks
    assert steady.plan(short, tokens, [([7],)], tables) is None
    with pytest.raises(BlockIdError, match="has 1 blocks in group 0, needs 2"):
        builder.build(short, tokens, [([7],)], tables)
    assert steady.plan(short, tokens, [([7, 8],)], tables) is None  # the refused step left no record


@functools.cache
def advanced_one():
    return jax.jit(lambda meta, delta: advance(meta, delta, (4,)).packed)
