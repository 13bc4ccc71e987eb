"""AsyncEngine: streams per request, requests joining a running loop, aborts that free blocks."""

import asyncio

import pytest

from jaxkv.serving.async_engine import AsyncEngine, EngineFullError
from jaxkv.serving.engine import Engine, EngineError
from jaxkv.serving.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # each test builds and compiles an engine on its own thread

PROMPTS = [list(range(1, 40)), list(range(50, 70))]


def build() -> Engine:
    return Engine.build("tiny-llama", memory_bytes=4 << 20, max_model_len=256, max_num_seqs=4)


@pytest.fixture(scope="module")
def greedy() -> list[list[int]]:
    result = build().generate(PROMPTS, 12)
    return [list(o.output_token_ids) for o in result.outputs]


def run(coro):
    return asyncio.run(coro)


def test_streams_give_each_requests_tokens_as_they_come_and_a_late_request_joins_the_running_loop(greedy):
    async def main():
        engine = AsyncEngine(build)
        first = await engine.add(PROMPTS[0], SamplingParams.greedy(12))
        got = {0: [], 1: []}
        late = None
        order = []
        async for delta in first:
            got[0] += delta.token_ids
            if late is None:
                late = await engine.add(PROMPTS[1], SamplingParams.greedy(12))

                async def read_late(stream):
                    async for d in stream:
                        got[1].extend(d.token_ids)
                        order.append(("late", len(got[0])))

                reader = asyncio.create_task(read_late(late))
        await reader
        audit = await engine.call(lambda e: e.audit())
        await engine.close()
        return got, order, audit, delta, (first, late)

    got, order, audit, last, streams = run(main())
    for stream in streams:  # what a server's queue, prefill and inference times are made of
        assert stream.queued_at is not None and stream.scheduled_at(0) is not None
        assert stream.queued_at <= stream.scheduled_at(0) and stream.num_preemptions(0) == 0
    assert streams[0].scheduled_at(0) < streams[1].queued_at, "the late request came after the first was running"
    assert got == {0: greedy[0], 1: greedy[1]}
    assert last.finish_reason == "length"
    assert order[0][1] < 12, "the late request drew tokens while the first was still running"
    assert audit.device_blocks_leaked == 0


def test_a_consumer_that_aborts_frees_every_block_and_its_stream_ends_with_abort():
    async def main():
        engine = AsyncEngine(build)
        stream = await engine.add(PROMPTS[0], SamplingParams.greedy(200))
        deltas = []
        async for delta in stream:
            deltas.append(delta)
            if len(deltas) == 3:
                stream.abort()
        state = await engine.call(lambda e: (e.has_unfinished, e.audit(), e.manager.num_free_blocks))
        usable = (await engine.ready()).manager.config.num_usable_blocks
        await engine.close()
        return deltas, state, usable

    deltas, (unfinished, audit, free), usable = run(main())
    assert deltas[-1].finish_reason == "abort" and all(d.finish_reason is None for d in deltas[:-1])
    assert not unfinished and audit.device_blocks_leaked == 0 and free == usable


def test_a_full_engine_and_a_bad_request_are_refused_at_once():
    async def main():
        engine = AsyncEngine(build, max_requests=3)
        with pytest.raises(EngineFullError, match="0 sequences are unfinished; 4 more would pass max_requests=3"):
            await engine.add(PROMPTS[0], SamplingParams(n=4, max_tokens=5))  # sequences count, not requests
        stream = await engine.add(PROMPTS[0], SamplingParams(n=3, temperature=0.0, max_tokens=50))
        with pytest.raises(EngineFullError, match="3 sequences are unfinished; 1 more would pass max_requests=3"):
            await engine.add(PROMPTS[1], SamplingParams.greedy(5))
        async for delta in stream:
            if delta.index == 0 and delta.token_ids:  # its siblings are queued once it drew: abort them
                stream.abort()
        assert stream.scheduled_at(0) is not None and stream.queued_at <= stream.scheduled_at(0)
        with pytest.raises(EngineError, match="token 9999 is not an id"):
            await engine.add([9999], SamplingParams.greedy(5))
        assert engine.num_unfinished == 0
        await engine.close()

    run(main())
