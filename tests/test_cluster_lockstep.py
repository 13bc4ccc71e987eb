"""The lockstep check: digests of step decisions compared across processes (threads here,
over an in-memory store with the coordinator store's blocking, time-limited reads)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from jaxkv.cluster.lockstep import (
    LockstepCheck,
    LockstepMismatchError,
    LockstepSetupError,
    LockstepTimeoutError,
    step_digest,
)
from jaxkv.core.manager import Request
from jaxkv.serving.scheduler import ScheduledChunk, SchedulerOutput, SeqState


class MemoryStore:
    """A key-value store shared by threads: reads block until the key is set or time runs out."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.changed:
            assert key not in self.values, key
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise TimeoutError(key)
            return self.values[key]

    def key_value_delete(self, key: str) -> None:
        with self.changed:
            del self.values[key]


def step(*chunks: tuple[str, int, int, list[int]], preempted: tuple[str, ...] = ()) -> SchedulerOutput:
    """A step of chunks ``(request id, computed, new tokens, block ids of the one group)``."""
    out = []
    for rid, computed, new, blocks in chunks:
        seq = SeqState(Request(rid, list(range(computed + new))), max_new_tokens=4, num_cached_tokens=0)
        out.append(ScheduledChunk(seq, computed, new, (blocks,), samples=True))
    return SchedulerOutput(tuple(out), tuple(SeqState(Request(r, [1]), 1) for r in preempted))


def run_processes(steps_per_process, timeout_s=10.0):
    """Each thread plays one process, checking its steps in order; returns what each raised."""
    store = MemoryStore()
    n = len(steps_per_process)

    def play(pid):
        check = LockstepCheck(store, process_id=pid, num_processes=n, timeout_s=timeout_s)
        try:
            for output in steps_per_process[pid]:
                check(output)
        except LockstepMismatchError as err:
            return err
        except LockstepTimeoutError as err:
            return err
        return None

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(play, range(n))), store


A = step(("req-0", 0, 16, [1]), ("req-1", 0, 8, [2]))
B = step(("req-0", 16, 1, [1, 3]), ("req-1", 8, 1, [2]))


def test_processes_deciding_the_same_pass_and_leave_only_the_last_step_in_the_store():
    errors, store = run_processes([[A, B, None], [A, B, None], [A, B, None]])
    assert errors == [None, None, None]
    assert sorted(store.values) == [f"jaxkv/lockstep/engine/2/{p}" for p in range(3)]


def test_a_different_block_table_raises_in_every_process_naming_the_step_and_process():
    other = step(("req-0", 16, 1, [1, 4]), ("req-1", 8, 1, [2]))
    errors, _ = run_processes([[A, B], [A, other], [A, B]])
    for err in errors:
        assert isinstance(err, LockstepMismatchError)
        assert (err.step, err.differing) == (1, (1,))
    assert "step 1: processes [1]" in str(errors[0])


def test_a_process_out_of_steps_mismatches_the_peer_that_still_has_one():
    errors, _ = run_processes([[A, None], [A, B]])
    assert [(e.step, e.summaries[0]) for e in errors] == [(1, "end"), (1, "end")]


def test_a_peer_that_never_checks_times_out_with_a_typed_error():
    errors, _ = run_processes([[A, B], [A]], timeout_s=0.2)
    assert isinstance(errors[0], LockstepTimeoutError)
    assert (errors[0].step, errors[0].missing) == (1, (1,))
    assert errors[1] is None


@pytest.mark.parametrize(
    "changed",
    [
        step(("req-0", 0, 16, [1]), ("req-2", 0, 8, [2])),  # another request
        step(("req-0", 0, 16, [1]), ("req-1", 0, 7, [2])),  # another token count
        step(("req-0", 0, 16, [1]), ("req-1", 0, 8, [5])),  # another block
        step(("req-1", 0, 8, [2]), ("req-0", 0, 16, [1])),  # another order
        step(("req-0", 0, 16, [1]), ("req-1", 0, 8, [2]), preempted=("req-9",)),
        None,
    ],
)
def test_every_decision_is_in_the_digest(changed):
    assert step_digest(changed)[0] != step_digest(A)[0]


def test_the_digest_sees_token_ids_and_prefix_hits():
    same = step(("req-0", 0, 16, [1]), ("req-1", 0, 8, [2]))
    assert step_digest(same) == step_digest(A)
    seq = SeqState(Request("req-1", [7] * 8), max_new_tokens=4, num_cached_tokens=0)
    tokens = SchedulerOutput((A.chunks[0], A.chunks[1]._replace(seq=seq)), ())
    assert step_digest(tokens)[0] != step_digest(A)[0]
    same.chunks[1].seq.num_cached_tokens = 16
    assert step_digest(same)[0] != step_digest(A)[0]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(process_id=2, num_processes=2), "process_id=2"),
        (dict(process_id=-1, num_processes=2), "process_id"),
        (dict(process_id=0, num_processes=0), "num_processes"),
        (dict(process_id=0, num_processes=2, timeout_s=0), "timeout_s"),
    ],
)
def test_a_bad_setup_is_refused_naming_the_value(kwargs, needle):
    with pytest.raises(LockstepSetupError, match=needle):
        LockstepCheck(MemoryStore(), **kwargs)
