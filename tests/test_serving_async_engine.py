"""AsyncEngine: streams per request, requests joining a running loop, aborts that free blocks."""

import asyncio

import pytest

from jaxkv.serving.async_engine import AsyncEngine, EngineFullError
from jaxkv.serving.engine import Engine, EngineError
from jaxkv.serving.outputs import RequestDelta
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny Llama checkpoint with its byte-level tokenizer (text, multibyte characters)."""
    pytest.importorskip("tokenizers")
    from hf_checkpoints import save_tiny_checkpoint
    from tiny_tokenizer import save_tiny_tokenizer

    directory = tmp_path_factory.mktemp("tiny-llama-text")
    save_tiny_checkpoint("llama", directory)
    save_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def inline_engine(checkpoint) -> Engine:
    """The oracle: an engine making its text inline, on the test's thread."""
    return build_text(checkpoint)


def build_text(directory) -> Engine:
    return Engine.from_pretrained(directory, memory_bytes=4 << 20, max_model_len=256, max_num_seqs=4)


def stop_in(text: str, start: int, multibyte: bool) -> str:
    """A two-character stop string of ``text`` from ``start`` on (a non-ASCII first one if
    ``multibyte``), with no replacement character in it."""
    for i in range(start, len(text) - 1):
        s = text[i : i + 2]
        if "\ufffd" not in s and (not multibyte or ord(s[0]) > 127):
            return s
    raise AssertionError(f"no stop string in {text!r}")


async def read(stream) -> dict[int, dict]:
    """Each sequence's streamed text, tokens, logprob ids, finish reason and cached count."""
    got: dict[int, dict] = {}
    async for delta in stream:
        seq = got.setdefault(delta.index, {"text": "", "tokens": [], "logprobs": [], "reason": None, "cached": None})
        assert seq["reason"] is None, "nothing after a sequence's last delta"
        seq["text"] += delta.text
        seq["tokens"] += delta.token_ids
        seq["logprobs"] += [lp.token_id for lp in delta.logprobs or ()]
        seq["reason"], seq["cached"] = delta.finish_reason, delta.num_cached_tokens
    return got


def test_text_made_on_the_event_loop_matches_inline_text_with_stop_strings_multibyte_and_n(checkpoint, inline_engine):
    engine = inline_engine
    tok = engine.tokenizer
    prompts = [tok.encode("The cache holds blocks"), tok.encode("abc")]
    free = [
        SamplingParams(seed=5, max_tokens=24, ignore_eos=True),
        SamplingParams(n=2, seed=3, max_tokens=24, ignore_eos=True),
    ]
    texts = [o.text for o in engine.generate(prompts, free).outputs]
    params = [
        SamplingParams(seed=5, max_tokens=24, ignore_eos=True, stop=[stop_in(texts[0], 4, False)]),
        SamplingParams(
            seed=5,
            max_tokens=24,
            ignore_eos=True,
            stop=[stop_in(texts[0], 4, False)],
            logprobs=2,
            include_stop_str_in_output=True,
        ),
        SamplingParams(n=2, seed=3, max_tokens=24, ignore_eos=True, stop=[stop_in(texts[2], 2, True)]),
    ]
    prompts = [prompts[0], prompts[0], prompts[1]]
    inline = {}
    for k, o in enumerate(engine.generate(prompts, params).outputs):
        inline[(k if k < 2 else 2), o.index] = o
    assert sum(o.finish_reason == "stop" for o in inline.values()) >= 3, "the stop strings are hit"

    async def main():
        served = AsyncEngine(lambda: build_text(checkpoint))
        streams = [await served.add(p, sp) for p, sp in zip(prompts, params, strict=True)]
        got = [await read(s) for s in streams]
        state = await served.call(lambda e: (e.has_unfinished, e.audit()))
        await served.close()
        return got, state

    got, (unfinished, audit) = run(main())
    for k, seqs in enumerate(got):
        for index, seq in seqs.items():
            want = inline[k, index]
            assert seq["text"] == want.text and seq["reason"] == want.finish_reason, (k, index)
            assert seq["tokens"] == list(want.output_token_ids), "nothing drawn past a stop string is reported"
            assert seq["cached"] is not None
            if want.logprobs is not None:
                assert seq["logprobs"] == [lp.token_id for lp in want.logprobs]
    assert not unfinished and audit.device_blocks_leaked == 0


def test_an_abort_with_text_held_back_and_a_tokenizer_error_fail_their_own_request_only(
    checkpoint, inline_engine, monkeypatch
):
    from jaxkv.models.text import TextError
    from jaxkv.serving.text_stage import TextStage

    process = TextStage.process

    def failing(self, delta):
        if delta.request_id == "req-1" and len(delta.token_ids) and delta.token_ids[0] % 3 == 0:
            raise RuntimeError("tokenizer failed")
        return process(self, delta)

    monkeypatch.setattr(TextStage, "process", failing)
    engine = inline_engine
    prompt = engine.tokenizer.encode("abc")
    (want,) = engine.generate([prompt], SamplingParams(seed=2, max_tokens=40, ignore_eos=True)).outputs

    async def main():
        served = AsyncEngine(lambda: build_text(checkpoint))
        held = await served.add(prompt, SamplingParams(max_tokens=200, ignore_eos=True, stop=["\x00never"]))
        broken = await served.add(prompt, SamplingParams(max_tokens=200, ignore_eos=True, seed=1, temperature=1.0))
        fine = await served.add(prompt, SamplingParams(seed=2, max_tokens=40, ignore_eos=True))
        deltas = []
        async for delta in held:
            deltas.append(delta)
            if len(deltas) == 12:
                held.abort()
        with pytest.raises(TextError, match="detokenizing request req-1 failed: tokenizer failed"):
            await read(broken)
        good = await read(fine)
        state = await served.call(lambda e: (e.has_unfinished, e.audit()))
        await served.close()
        return deltas, good, state

    deltas, good, (unfinished, audit) = run(main())
    tokens = [t for d in deltas for t in d.token_ids]
    assert deltas[-1].finish_reason == "abort" and "".join(d.text for d in deltas[:12]) != ""
    assert "".join(d.text for d in deltas) == engine.tokenizer.decode(tokens), "the held-back text comes with the abort"
    assert good[0]["text"] == want.text and good[0]["tokens"] == list(want.output_token_ids)
    assert not unfinished and audit.device_blocks_leaked == 0


def test_stop_sequence_ends_one_sibling_where_the_caller_says_and_frees_its_blocks(inline_engine):
    engine = inline_engine
    engine.set_inline_text(False)
    try:
        stop_one_sibling(engine)
    finally:
        engine.set_inline_text(True)


def stop_one_sibling(engine: Engine) -> None:
    rid = engine.add_request(list(range(1, 30)), SamplingParams(n=2, seed=7, max_tokens=20, ignore_eos=True))
    with pytest.raises(EngineError, match="inline text can change only with no request unfinished"):
        engine.set_inline_text(True)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    last: dict[int, RequestDelta] = {}
    while len(tokens[1]) < 6:
        for d in engine.step().deltas:
            tokens[d.index] += d.token_ids
    reported = len(tokens[1])
    output = engine.stop_sequence(rid, 1, 4)  # as if a stop string ended at its 4th token
    assert output.finish_reason == "stop" and list(output.output_token_ids) == tokens[1][:4] and output.text is None
    assert engine.stop_sequence(rid, 1, 4) is None, "a sequence ends once"
    while engine.has_unfinished:
        for d in engine.step().deltas:
            tokens[d.index] += d.token_ids
            last[d.index] = d
    assert last[1].finish_reason == "stop" and last[1].token_ids == () and last[1].num_cached_tokens is not None
    assert len(tokens[1]) == reported, "no token of it is reported after the stop"
    assert last[0].finish_reason == "length" and len(tokens[0]) == 20, "its sibling runs on"
    assert engine.audit().device_blocks_leaked == 0
