"""StopChecker: stop ids, stop strings (held back while they may begin), min_tokens."""

import pytest

from jaxkv.models.text import TextTokenizer
from jaxkv.serving.sampling_params import SamplingParams
from jaxkv.serving.stopping import StopChecker

tokenizers = pytest.importorskip("tokenizers")

EOS = 99


def letters() -> TextTokenizer:
    """One token per lowercase letter and the space (ids 0-26), decoded side by side."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {ch: i for i, ch in enumerate("abcdefghijklmnopqrstuvwxyz ")}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tokenizer.decoder = decoders.Fuse()
    return TextTokenizer(tokenizer)


def run(checker: StopChecker, text: str) -> tuple[list[str], str | None]:
    """Feed ``text`` letter by letter; the pieces emitted and the finish reason, if any."""
    pieces = []
    for n, ch in enumerate(text, start=1):
        piece, reason = checker.update("abcdefghijklmnopqrstuvwxyz ".index(ch), n)
        pieces.append(piece)
        if reason is not None:
            return pieces, reason
    return pieces, None


def test_a_stop_string_ends_the_text_before_it_and_nothing_of_it_was_streamed():
    tok = letters()
    checker = StopChecker(SamplingParams(stop=["the end", "xyz"]), (EOS,), tok.detokenizer())
    pieces, reason = run(checker, "so the story ends at the end and more")
    assert reason == "stop" and checker.text == "so the story ends at " == "".join(pieces)


def test_include_stop_str_in_output_ends_the_text_after_the_earliest_longest_stop_string():
    tok = letters()
    params = SamplingParams(stop=["end", "the end", "xyz"], include_stop_str_in_output=True)
    checker = StopChecker(params, (EOS,), tok.detokenizer())
    pieces, reason = run(checker, "so the story ends at the end and more")
    assert reason == "stop" and checker.text == "so the story end" == "".join(pieces)
    early = StopChecker(SamplingParams(stop=["end", "e e"], include_stop_str_in_output=True), (), tok.detokenizer())
    assert run(early, "the end")[1] == "stop" and early.text == "the e", "the first completed, whole"


def test_text_streams_at_once_without_stop_strings_and_the_held_back_rest_comes_at_the_end():
    tok = letters()
    free = StopChecker(SamplingParams(), (), tok.detokenizer())
    assert run(free, "abc") == (["a", "b", "c"], None)
    held = StopChecker(SamplingParams(stop=["zzz"]), (), tok.detokenizer())
    pieces, reason = run(held, "abcd")
    assert reason is None and "".join(pieces) == "ab" and held.finish() == "cd" and held.text == "abcd"


def test_eos_stops_unless_ignored_and_stop_ids_stop_always():
    assert StopChecker(SamplingParams(), (EOS,), None).update(EOS, 1) == ("", "stop")
    ignoring = StopChecker(SamplingParams(ignore_eos=True, stop_token_ids=[7]), (EOS,), None)
    assert ignoring.update(EOS, 1) == ("", None) and ignoring.update(7, 2) == ("", "stop")


def test_min_tokens_bans_the_stop_ids_and_defers_stop_strings():
    checker = StopChecker(SamplingParams(min_tokens=3, stop=["b"], stop_token_ids=[5]), (EOS,), letters().detokenizer())
    assert checker.banned(0) == checker.banned(2) == (5, EOS) and checker.banned(3) == ()
    _, reason = run(checker, "abab")
    assert reason == "stop" and checker.text == "aba"
