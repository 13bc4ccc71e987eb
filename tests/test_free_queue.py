"""FreeBlockQueue: FIFO order, O(1) removal, bulk insertion at both ends, compaction."""

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxkv.core.free_queue import FreeBlockQueue


def test_blocks_leave_in_the_order_they_came():
    q = FreeBlockQueue(range(1, 6), 10)
    q.append([9, 8])
    q.prepend([7, 6])
    assert list(q) == [7, 6, 1, 2, 3, 4, 5, 9, 8]
    assert q.popleft_n(3) == [7, 6, 1]
    assert len(q) == 6 and 1 not in q and 2 in q


def test_a_removed_block_is_skipped_and_can_come_back_at_the_tail():
    q = FreeBlockQueue(range(1, 5), 8)
    q.remove(2)
    assert list(q) == [1, 3, 4] and 2 not in q
    q.append([2])
    assert q.popleft_n(4) == [1, 3, 4, 2]
    assert len(q) == 0 and list(q) == []


def test_a_take_over_units_pops_only_the_heads_that_cover_it():
    q = FreeBlockQueue([1, 2, 5, 6, 9], 12)
    q.remove(2)
    units = {5: [3, 4], 9: [7, 8, 10]}  # 5 covers 3 blocks, 9 covers 4
    assert q.popleft_covering(2, units) == ([1, 5], 4), "1 covers one block; 5 brings the rest and more"
    assert list(q) == [6, 9] and len(q) == 2
    assert q.popleft_covering(10, units) == ([6, 9], 5), "the whole queue when it covers fewer"
    assert len(q) == 0 and list(q) == []


def test_many_removals_compact_without_changing_the_order():
    q = FreeBlockQueue(range(1, 1001), 1001)
    for b in range(1, 1001, 2):
        q.remove(b)
    for b in range(2, 900, 4):
        q.remove(b)
    expected = [b for b in range(1, 1001) if b % 2 == 0 and not (b < 900 and b % 4 == 2)]
    assert list(q) == expected and len(q) == len(expected)
    assert q._entries <= 2 * len(q) + 64


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pop", "remove", "append", "prepend"]), st.integers(0, 30)), max_size=80))
def test_matches_a_plain_list(ops):
    n = 31
    q = FreeBlockQueue(range(1, n), n)
    model = list(range(1, n))
    for op, k in ops:
        outside = [b for b in range(1, n) if b not in model]
        if op == "pop":
            k = min(k % 4, len(model))
            assert q.popleft_n(k) == model[:k]
            del model[:k]
        elif op == "remove" and model:
            b = model.pop(k % len(model))
            q.remove(b)
        elif op in ("append", "prepend") and outside:
            chunk = outside[k % len(outside) :][:3]
            if op == "append":
                q.append(list(chunk))
                model += chunk
            else:
                q.prepend(list(chunk))
                model[:0] = chunk
        assert list(q) == model and len(q) == len(model)
        assert all((b in q) == (b in model) for b in range(1, n))
