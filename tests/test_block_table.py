"""jaxkv.device.block_table: host block tables kept across steps, exact whatever the lists do."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.device import block_table
from jaxkv.device.block_table import BlockTables
from jaxkv.device.metadata import BlockIdError, Buckets, ScheduledSeq, build_step_metadata


def row_of(tables: BlockTables, request_id: str, lists) -> list[list[int]]:
    """The ids ``tables`` holds for ``request_id`` after being given ``lists``, per group."""
    (row,) = tables.rows([request_id], [lists])
    return [tables.table(g)[row, : tables.lengths(g, np.array([row]))[0]].tolist() for g in range(len(lists))]


def test_a_grown_list_writes_its_tail_and_an_unchanged_one_writes_nothing(monkeypatch):
    tables = BlockTables((100, 100), rows=2, width=2)
    blocks = [3, 4]
    assert row_of(tables, "a", ([1, 2], blocks)) == [[1, 2], [3, 4]]
    checked = []
    real = block_table._checked
    monkeypatch.setattr(block_table, "_checked", lambda ids, *a: checked.append(list(ids)) or real(ids, *a))
    assert row_of(tables, "a", ([1, 2], [3, 4])) == [[1, 2], [3, 4]] and checked == []
    blocks.extend([5, 6, 7])  # the caller's list changes in place: the table kept its own copy
    assert row_of(tables, "a", ([1, 2], blocks)) == [[1, 2], [3, 4, 5, 6, 7]] and checked == [[5, 6, 7]]


def test_nulled_moved_and_shrunk_lists_rewrite_the_row():
    tables = BlockTables((100,), rows=2, width=4)
    assert row_of(tables, "a", ([1, 2, 3],)) == [[1, 2, 3]]
    assert row_of(tables, "a", ([0, 2, 3, 4],)) == [[0, 2, 3, 4]]  # a window dropped block 1
    assert row_of(tables, "a", ([9],)) == [[9]]  # preempted and readmitted under its id
    (row,) = tables.rows(["a"], [([9],)])
    assert tables.table(0)[row].tolist() == [9, 0, 0, 0]  # nothing stale past the list


@pytest.mark.parametrize(
    ("lists", "match"),
    [
        (([1, 2, 100],), r"'a', group 0: block id 100 out of range \[0, 100\)"),
        (([1, 2, -1],), "block id -1 out of range"),
        (([1, 2, 3.0],), r"block ids must be ints, got \[3.0\]"),
        (([1, 2, True],), "block ids must be ints"),
    ],
)
def test_a_bad_id_is_refused_and_the_row_left_as_it_was(lists, match):
    tables = BlockTables((100,))
    before = row_of(tables, "a", ([1, 2],))
    with pytest.raises(BlockIdError, match=match):
        tables.rows(["a"], [lists])
    assert row_of(tables, "a", ([1, 2],)) == before


def test_rows_of_finished_requests_are_reclaimed_and_the_table_grows_when_all_are_live():
    tables = BlockTables((100,), rows=2, width=2)
    tables.rows(["a", "b"], [([1],), ([2],)])
    assert tables.release("a") and not tables.release("a") and tables.num_requests == 1
    tables.rows(["c"], [([3],)])  # takes a's row
    rows = tables.rows(["d", "e", "f"], [([4],), ([5],), ([6],)])  # b and c absent: evicted
    assert tables.num_requests == 3 and len(set(rows.tolist())) == 3
    rows = tables.rows(["d", "e", "f", "g"], [([4],), ([5],), ([6],), ([7, 8, 9],)])  # all live: grows
    assert [tables.table(0)[r, 0] for r in rows] == [4, 5, 6, 7] and tables.num_requests == 4
    assert row_of(tables, "b", ([2],)) == [[2]]  # an evicted request is written afresh


def test_persistent_tables_give_the_metadata_of_fresh_ones_over_a_random_run():
    """Random steps of lists that grow, get window nulls, move a state, are preempted, finish:
    the packed metadata through one kept BlockTables equals a fresh build's every step."""
    rng = np.random.default_rng(0)
    buckets = Buckets((8, 64), (8,), (16,))
    tables = BlockTables((50, 50), rows=2, width=2)
    live: dict[str, list] = {}
    for step in range(60):
        if len(live) < 6 and rng.random() < 0.5:
            live[f"r{step}"] = [0, [[], []]]
        for request_id, (computed, _) in list(live.items()):
            if rng.random() < 0.08 or computed > 100:
                del live[request_id]
                if rng.random() < 0.5:
                    tables.release(request_id)
                continue
            if rng.random() < 0.05:  # preempted: back to nothing computed, new blocks
                live[request_id] = [0, [[], []]]
        seqs, tokens, block_ids = [], [], []
        for request_id, state in sorted(live.items(), key=lambda kv: kv[1][0] == 0):
            computed, lists = state
            new = 1 if computed else int(rng.integers(2, 9))
            for g, size in enumerate((4, 8)):
                while len(lists[g]) * size < computed + new:
                    lists[g].append(int(rng.integers(1, 50)))
            if computed > 8 and rng.random() < 0.3:  # a window drops an old block
                lists[0][(computed - 8) // 4] = 0
            state[0] = computed + new
            seqs.append(ScheduledSeq(request_id, computed, new))
            tokens.append([1] * new)
            block_ids.append((list(lists[0]), list(lists[1])))
        if not seqs:
            continue
        kept = build_step_metadata(seqs, tokens, block_ids, [4, 8], buckets, num_blocks=50, tables=tables)
        fresh = build_step_metadata(seqs, tokens, block_ids, [4, 8], buckets, num_blocks=50)
        np.testing.assert_array_equal(np.asarray(kept.packed), np.asarray(fresh.packed), err_msg=f"step {step}")
        assert kept.packing == fresh.packing
