"""Serving scheduler: batch order, chunked prefill, admission, prefix hits, preemption, finishing."""

import dataclasses
import logging

import pytest
from kv_configs import FULL, make_config, make_manager, window

from jaxkv.core.manager import KVCacheManager, KVCacheManagerError, Request
from jaxkv.planner import StatePool
from jaxkv.serving.scheduler import (
    DuplicateRequestIdError,
    PoolTooSmallError,
    RequestTooLongError,
    ScheduledManager,
    Scheduler,
    SchedulerError,
    SchedulerOutput,
)
from jaxkv.specs import MambaSpec


def step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    """Schedule one step and feed ``token`` as every sampled token."""
    out = sched.schedule()
    sched.update(out, [token] * len(out.chunks))
    return out


def shape(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.seq.request_id, c.num_computed_tokens, c.num_new_tokens) for c in out.chunks]


def test_chunks_carry_token_ids_and_block_ids_per_group():
    mgr = make_manager(40, FULL, window(32), max_model_len=256)
    sched = Scheduler(mgr, max_num_batched_tokens=64)
    sched.add_request(Request("a", range(100, 140)), 2)
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.token_ids == list(range(100, 140))
    assert chunk.block_ids == mgr.get_block_ids("a")
    assert len(chunk.block_ids) == 2 and all(len(b) == 3 for b in chunk.block_ids)
    assert chunk.samples and out.num_tokens == 40


def test_decodes_come_first_then_prefill_chunks():
    mgr = make_manager(40, FULL)
    sched = Scheduler(mgr, max_num_batched_tokens=64)
    sched.add_request(Request("a", range(10)), 5)
    step(sched)
    sched.add_request(Request("b", range(100, 130)), 5)
    sched.add_request(Request("c", range(200, 203)), 5)
    out = step(sched)
    assert shape(out) == [("a", 10, 1), ("b", 0, 30), ("c", 0, 3)]
    out = sched.schedule()
    assert shape(out) == [("a", 11, 1), ("b", 30, 1), ("c", 3, 1)]
    assert out.chunks[0].token_ids == [7]


def test_chunked_prefill_stays_within_the_token_budget():
    mgr = make_manager(40, FULL)
    sched = Scheduler(mgr, max_num_batched_tokens=16)
    sched.add_request(Request("a", range(40)), 2)
    sched.add_request(Request("b", range(100, 110)), 2)
    chunks = [shape(step(sched)) for _ in range(4)]
    assert chunks == [
        [("a", 0, 16)],
        [("a", 16, 16)],
        [("a", 32, 8), ("b", 0, 8)],
        [("a", 40, 1), ("b", 8, 2)],
    ]
    assert sched.num_scheduled_tokens == 51


def test_only_a_chunk_that_completes_the_context_samples_a_token():
    mgr = make_manager(40, FULL)
    sched = Scheduler(mgr, max_num_batched_tokens=16)
    seq = sched.add_request(Request("a", range(20)), 3)
    out = sched.schedule()
    assert not out.chunks[0].samples
    sched.update(out, [99])
    assert seq.request.output_token_ids == [] and seq.request.num_computed_tokens == 16
    step(sched, token=5)
    assert seq.request.output_token_ids == [5]


def test_admission_stops_at_max_num_seqs_and_at_the_free_pool():
    mgr = make_manager(40, FULL)
    sched = Scheduler(mgr, max_num_seqs=2, max_num_batched_tokens=512)
    for i in range(3):
        sched.add_request(Request(f"r{i}", range(i * 100, i * 100 + 20)), 4)
    assert [c.seq.request_id for c in sched.schedule().chunks] == ["r0", "r1"]
    assert len(sched.waiting) == 1

    small = make_manager(6, FULL)  # 5 usable blocks of 16 tokens
    sched = Scheduler(small, max_num_batched_tokens=512)
    sched.add_request(Request("a", range(50)), 4)  # 4 blocks
    sched.add_request(Request("b", range(100, 120)), 4)  # 2 blocks: does not fit
    assert [c.seq.request_id for c in sched.schedule().chunks] == ["a"]
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_a_prefix_hit_skips_the_cached_tokens():
    mgr = make_manager(40, FULL)
    sched = Scheduler(mgr, max_num_batched_tokens=512)
    shared = list(range(1000, 1040))
    first = sched.add_request(Request("a", [*shared, 1, 2]), 1)
    step(sched)
    assert first.num_cached_tokens == 0 and not sched.has_unfinished
    second = sched.add_request(Request("b", [*shared, 3, 4, 5]), 1)
    out = sched.schedule()
    assert shape(out) == [("b", 32, 11)]
    assert out.chunks[0].token_ids == [*shared[32:], 3, 4, 5]
    assert second.num_cached_tokens == 32
    assert out.chunks[0].block_ids[0][:2] == mgr.get_block_ids("b")[0][:2]


def test_preemption_frees_the_newest_request_and_requeues_it_first(caplog):
    # 6 usable blocks of 16 tokens: "a" and "b" grow until one must go.
    caplog.set_level(logging.DEBUG, logger="jaxkv")
    mgr = make_manager(7, FULL, max_model_len=256)
    sched = Scheduler(mgr, max_num_batched_tokens=512)
    a = sched.add_request(Request("a", range(40)), 30)
    b = sched.add_request(Request("b", range(100, 130)), 30)
    step(sched)
    sched.add_request(Request("c", range(200, 220)), 1)  # 2 blocks: waits, 1 is free
    while not b.num_preemptions:
        out = step(sched)
    assert out.preempted == (b,)
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert b.request.num_computed_tokens == 0 and b.num_output_tokens > 0
    assert sched.num_preemptions == 1 and a in sched.running
    assert [r.getMessage() for r in caplog.records if r.name == "jaxkv.serving.scheduler"] == [
        "preempted request 'b' (recompute; 1 preemption(s) of it, 1 in all)"
    ]
    assert shape(out) == [("a", a.request.num_computed_tokens - 1, 1)]
    while sched.has_unfinished:
        step(sched)
    assert a.num_output_tokens == b.num_output_tokens == 30
    assert mgr.num_free_blocks == 6


def test_requests_finish_at_max_new_tokens_or_max_model_len_and_free_their_blocks():
    mgr = make_manager(20, FULL, max_model_len=24)
    sched = Scheduler(mgr, max_num_batched_tokens=64)
    short = sched.add_request(Request("short", range(10)), 2)
    capped = sched.add_request(Request("capped", range(100, 120)), 50)
    finished = []
    while sched.has_unfinished:
        out = sched.schedule()
        finished += [s.request_id for s in sched.update(out, [1] * len(out.chunks))]
    assert finished == ["short", "capped"]
    assert short.num_output_tokens == 2 and capped.request.num_tokens == 24
    assert mgr.num_free_blocks == 19


def test_finish_takes_running_and_waiting_requests_out_and_frees_their_blocks():
    mgr = make_manager(20, FULL)
    sched = Scheduler(mgr, max_num_seqs=1, max_num_batched_tokens=64)
    running = sched.add_request(Request("running", range(10)), 5)
    waiting = sched.add_request(Request("waiting", range(100, 110)), 5)
    step(sched)
    assert sched.running == [running] and list(sched.waiting) == [waiting]
    sched.finish([running, waiting])
    assert not sched.has_unfinished and not mgr.has_request("running") and mgr.num_free_blocks == 19
    sched.add_request(Request("running", range(10)), 5)  # its id is free again


def test_block_ids_can_be_left_out_for_host_only_replays():
    sched = Scheduler(make_manager(20, FULL), record_block_ids=False)
    sched.add_request(Request("a", range(10)), 1)
    assert sched.schedule().chunks[0].block_ids == ()


def test_bad_requests_and_arguments_are_refused_with_the_value():
    mgr = make_manager(4, FULL, max_model_len=64)  # 3 usable blocks
    with pytest.raises(SchedulerError, match="max_num_seqs must be a positive int, got 0"):
        Scheduler(mgr, max_num_seqs=0)
    with pytest.raises(SchedulerError, match="manager must be a KVCacheManager"):
        Scheduler(object())
    sched = Scheduler(mgr)
    with pytest.raises(RequestTooLongError, match=r"'big' has a 64-token prompt; max_model_len=64"):
        sched.add_request(Request("big", range(64)), 1)
    with pytest.raises(SchedulerError, match="max_new_tokens must be a positive int, got 0"):
        sched.add_request(Request("a", range(4)), 0)
    started = Request("s", range(4))
    started.num_computed_tokens = 2
    with pytest.raises(SchedulerError, match="num_computed_tokens=2"):
        sched.add_request(started, 1)
    assert not sched.has_unfinished
    sched.add_request(Request("huge", range(60)), 1)  # needs 4 blocks
    with pytest.raises(PoolTooSmallError, match=r"'huge' .60 tokens. cannot be admitted"):
        sched.schedule()
    ok = Scheduler(make_manager(20, FULL))
    ok.add_request(Request("a", range(4)), 1)
    out = ok.schedule()
    with pytest.raises(SchedulerError, match="got 0 sampled tokens for 1 scheduled chunks"):
        ok.update(out, [])


def test_a_request_id_already_queued_running_or_holding_blocks_is_refused():
    mgr = make_manager(20, FULL)
    sched = Scheduler(mgr)
    sched.add_request(Request("a", range(10)), 2)
    with pytest.raises(DuplicateRequestIdError, match="'a'"):
        sched.add_request(Request("a", range(50, 60)), 2)  # waiting
    sched.schedule()
    with pytest.raises(DuplicateRequestIdError, match="'a'"):
        sched.add_request(Request("a", range(50, 60)), 2)  # running
    held = Request("b", range(20))
    mgr.allocate_slots(held, 20)
    with pytest.raises(DuplicateRequestIdError, match="'b'"):
        Scheduler(mgr).add_request(Request("b", range(5)), 1)  # holds blocks in the manager
    assert mgr.get_block_ids("a") == ([1],)


def test_prefill_chunks_end_at_recurrent_state_checkpoints(tokens):
    config = dataclasses.replace(
        make_config(64, FULL, MambaSpec(shapes=((2, 2),), dtypes=("float32",))), states=StatePool(num_states=8)
    )
    sched = Scheduler(KVCacheManager(config, max_model_len=256), max_num_batched_tokens=512)
    sched.add_request(Request("a", tokens(0, 100)), 2)
    assert shape(step(sched)) == [("a", 0, 96)], "cut at the prompt's last block boundary"
    assert shape(step(sched)) == [("a", 96, 4)]
    sched.add_request(Request("b", tokens(0, 96) + tokens(900, 20)), 2)
    assert shape(step(sched)) == [("a", 100, 1), ("b", 96, 16)], "b starts from a's checkpoint"


def test_a_bad_sampled_token_is_refused_and_changes_nothing():
    mgr = make_manager(20, FULL)
    sched = Scheduler(mgr, max_num_batched_tokens=512)
    a = sched.add_request(Request("a", range(40)), 5)
    b = sched.add_request(Request("b", range(100, 120)), 5)
    out = sched.schedule()
    with pytest.raises(KVCacheManagerError, match="token id -3"):
        sched.update(out, [7, -3])
    assert [s.request.num_tokens for s in (a, b)] == [40, 20]
    assert [s.request.num_computed_tokens for s in (a, b)] == [0, 0]
    sched.update(out, [7, 8])
    assert a.request.all_token_ids[-1] == 7 and b.request.all_token_ids[-1] == 8
    assert [s.request.num_computed_tokens for s in (a, b)] == [40, 20]


class HoldingBack:
    """jaxkv's manager behind the scheduler's calls, but with no chunk for the requests in
    ``held`` (``chunk_limit`` 0, as vLLM's align mode answers when no chunk within the
    budget ends on a block boundary): another project's manager, seen by the scheduler."""

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self.held: set[str] = set()

    def __getattr__(self, name: str) -> object:
        return getattr(self._manager, name)

    def chunk_limit(self, request: Request, start: int, num_new_tokens: int, max_chunk_tokens=None) -> int:
        return 0 if request.request_id in self.held else num_new_tokens


def test_a_chunk_limit_of_0_skips_a_running_request_and_stops_admission():
    mgr = HoldingBack(make_manager(40, FULL))
    assert not isinstance(mgr, KVCacheManager) and isinstance(mgr, ScheduledManager)
    sched = Scheduler(mgr, max_num_batched_tokens=64)
    for rid, start in (("a", 100), ("b", 200)):
        sched.add_request(Request(rid, range(start, start + 40)), 3)
    assert shape(step(sched)) == [("a", 0, 40), ("b", 0, 24)]
    mgr.held = {"b"}
    sched.add_request(Request("c", range(300, 303)), 3)
    assert shape(step(sched)) == [("a", 40, 1), ("c", 0, 3)]  # b waits; c, behind it, still runs
    mgr.held = {"d"}
    sched.add_request(Request("d", range(400, 410)), 3)
    sched.add_request(Request("e", range(500, 503)), 3)
    assert shape(step(sched)) == [("a", 41, 1), ("c", 3, 1), ("b", 24, 16)]  # d holds the queue: e waits
    assert [s.request_id for s in sched.waiting] == ["d", "e"] and not mgr.has_request("d")
    mgr.held = set()
    assert shape(step(sched)) == [("b", 40, 1), ("c", 4, 1), ("d", 0, 10), ("e", 0, 3)]


@pytest.mark.parametrize(
    ("budget", "chunks"),
    [(20, [16, 16, 8]), (8, [8, 8, 8, 8, 8])],
    ids=["chunks end on blocks", "blocks wider than the budget run sub-block"],
)
def test_a_recurrent_model_in_vllms_layout_is_chunked_as_vllm_chunks_it(budget, chunks):
    state = MambaSpec(shapes=((2, 2),), dtypes=("float32",))
    sched = Scheduler(make_manager(40, FULL, state), max_num_batched_tokens=budget)  # blocks of 16
    sched.add_request(Request("a", range(40)), 1)
    assert [n for _, _, n in (shape(step(sched))[0] for _ in chunks)] == chunks
    assert not sched.has_unfinished
