"""TextStage: token-only deltas given the text inline output processing gives them (no engine)."""

import pytest
from tiny_tokenizer import EOS_TOKEN_ID, save_tiny_tokenizer

from jaxkv.models.text import IncrementalDetokenizer, load_tokenizer
from jaxkv.serving.outputs import RequestDelta
from jaxkv.serving.sampling_params import SamplingParams
from jaxkv.serving.stopping import StopChecker
from jaxkv.serving.text_stage import StopAt, TextStage

TEXT = "héllo wörld, 日本語 🙂 the end and more 本 after"
CACHED = 7


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(directory)
    return load_tokenizer(directory)


def inline(tokenizer, tokens, params):
    """The pieces and reason the engine's output processor gives (its ``_take_token``)."""
    checker = StopChecker(
        params, (EOS_TOKEN_ID,), tokenizer.detokenizer(skip_special_tokens=params.skip_special_tokens)
    )
    pieces = []
    for count, token in enumerate(tokens, 1):
        text, reason = checker.update(token, count)
        if reason is None and count == len(tokens):
            text, reason = text + checker.finish(), "length"
        pieces.append(text)
        if reason is not None:
            return pieces, reason, count
    raise AssertionError("the tokens ran out")


def staged(tokenizer, tokens, params, drawn_past=2):
    """The same tokens as token-only deltas through a TextStage; the engine stops at stop ids
    and the length only, and draws ``drawn_past`` more tokens before a stop it is sent lands."""
    stage = TextStage(tokenizer, (EOS_TOKEN_ID,))
    stage.add("r", params)
    engine = StopChecker(params, (EOS_TOKEN_ID,), None)
    out, stops, pending = [], [], None
    for count, token in enumerate(tokens, 1):
        _, reason = engine.update(token, count)
        if reason is None and count == len(tokens):
            reason = "length"
        if pending is not None and count > pending.num_output_tokens + drawn_past:
            reason, token = "stop", None  # the stop lands: the engine's "stop" delta, no tokens
        ids = () if token is None else (token,)
        texted = stage.process(RequestDelta("r", 0, ids, "", None, reason, CACHED if reason else None))
        if texted.stop is not None:
            pending = texted.stop
            stops.append(texted.stop)
        if texted.delta is not None:
            out.append(texted.delta)
        if reason is not None:
            break
    assert "r" not in stage, "the request is forgotten after its last delta"
    return out, stops


CASES = [
    SamplingParams(max_tokens=200),
    SamplingParams(max_tokens=200, stop=["the e"]),
    SamplingParams(max_tokens=200, stop=["the e"], include_stop_str_in_output=True),
    SamplingParams(max_tokens=200, stop=["本", "zzz"]),
    SamplingParams(max_tokens=200, stop=["🙂 t"], include_stop_str_in_output=True),
    SamplingParams(max_tokens=200, stop=["o"], min_tokens=12),
    SamplingParams(max_tokens=200, stop=["never there"]),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: repr(p.stop))
def test_the_stage_gives_the_pieces_inline_text_gives_and_drops_what_is_drawn_past_a_stop(tokenizer, params):
    tokens = [*tokenizer.encode(TEXT), EOS_TOKEN_ID]
    pieces, reason, count = inline(tokenizer, tokens, params)
    out, stops = staged(tokenizer, tokens, params)
    assert [d.text for d in out] == pieces, "each delta's text as inline (held-back text included)"
    assert [t for d in out for t in d.token_ids] == tokens[:count], "no token past the stop is reported"
    assert out[-1].finish_reason == reason and out[-1].num_cached_tokens == CACHED
    assert all(d.finish_reason is None for d in out[:-1])
    assert "\ufffd" not in "".join(pieces), "no broken UTF-8 character is ever streamed"
    if params.stop and "never there" not in params.stop:
        assert reason == "stop" and stops == [StopAt("r", 0, count)]
    else:
        assert stops == []


def test_a_stop_string_on_the_engines_last_token_wins_and_needs_no_stop(tokenizer):
    tokens = tokenizer.encode("ab the end")
    params = SamplingParams(max_tokens=len(tokens), stop=["end"])
    out, stops = staged(tokenizer, tokens, params)
    assert "".join(d.text for d in out) == "ab the " and out[-1].finish_reason == "stop" and stops == []


def test_an_abort_flushes_the_held_back_text_and_n_sequences_keep_their_own_text(tokenizer):
    stage = TextStage(tokenizer, (EOS_TOKEN_ID,))
    stage.add("r", SamplingParams(n=2, stop=["xyz"]))
    a, b = tokenizer.encode("日本語"), tokenizer.encode("ok")
    texts = {0: "", 1: ""}
    for index, tokens in ((0, a), (1, b)):
        for token in tokens:
            texted = stage.process(RequestDelta("r", index, (token,), "", None, None))
            texts[index] += texted.delta.text
    assert texts == {0: "日", 1: ""}, "the last two characters are held back (they may start 'xyz')"
    for index in (0, 1):
        texts[index] += stage.process(RequestDelta("r", index, (), "", None, "abort", None)).delta.text
    assert texts == {0: "日本語", 1: "ok"} and "r" not in stage


def test_a_tokenizer_error_propagates_for_its_request_alone(tokenizer, monkeypatch):
    stage = TextStage(tokenizer, (EOS_TOKEN_ID,))
    stage.add("bad", SamplingParams())
    stage.add("good", SamplingParams())
    (poison,), (token,) = tokenizer.encode("z"), tokenizer.encode("a")
    add_token = IncrementalDetokenizer.add_token

    def failing(self, token_id):
        if token_id == poison:
            raise RuntimeError("tokenizer failed")
        return add_token(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", failing)
    with pytest.raises(RuntimeError, match="tokenizer failed"):
        stage.process(RequestDelta("bad", 0, (poison,), "", None, None))
    stage.drop("bad")
    assert stage.process(RequestDelta("good", 0, (token,), "", None, "length", 0)).delta.text == "a"
    assert "bad" not in stage and "good" not in stage
