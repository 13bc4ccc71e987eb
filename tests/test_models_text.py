"""A checkpoint's tokenizer, chat template (sandboxed) and streamed text (never a broken character)."""

import json
import os
import random

import pytest
from tiny_tokenizer import EOS_TOKEN_ID, save_tiny_tokenizer
from tokenizers.decoders import DecodeStream

from jaxkv.models import text
from jaxkv.models.text import TextError, TextTokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> TextTokenizer:
    directory = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(directory)
    return TextTokenizer.from_directory(directory)


def test_the_tiny_tokenizer_spells_any_text_in_bytes_and_knows_its_special_tokens(tok):
    text = "héllo, 世界 🙂"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < 256 and tok.decode(ids) == text
    assert tok.encode("<|endoftext|>") == [EOS_TOKEN_ID] and tok.decode([*ids, EOS_TOKEN_ID]) == text
    assert tok.vocab_size == 264


def test_streamed_text_never_breaks_a_character_and_adds_up_to_the_whole(tok):
    text = "naïve café — 日本語 🙂!"
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == detok.text == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(p == "" for p in pieces) == len(text.encode()) - len(text), "one hold per continuation byte"
    cut = tok.detokenizer()
    cut.add(tok.encode("🙂")[:2])
    assert cut.text == "" and cut.flush() == "\ufffd"


def test_the_chat_template_renders_roles_and_refuses_what_it_does_not_know(tok):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(chat) == "<|system|>Be brief.<|endoftext|><|user|>Hi<|endoftext|><|assistant|>"
    assert tok.apply_chat_template(chat, add_generation_prompt=False).endswith("Hi<|endoftext|>")
    with pytest.raises(TextError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TextError, match="messages must be a list"):
        tok.apply_chat_template([{"content": "no role"}])


def test_a_template_cannot_reach_python_objects(tmp_path):
    save_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TextError, match="the chat template refused the messages"):
        TextTokenizer.from_directory(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_a_directory_without_a_tokenizer_has_none_and_a_template_less_one_refuses_chats(tmp_path):
    assert load_tokenizer(tmp_path) is None
    with pytest.raises(TextError, match="ships no tokenizer"):
        TextTokenizer.from_directory(tmp_path)
    save_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    with pytest.raises(TextError, match="no chat_template"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def with_template(directory, template: str) -> TextTokenizer:
    """The tiny tokenizer saved in ``directory`` with ``template`` as its chat template."""
    save_tiny_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return TextTokenizer.from_directory(directory)


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("{{ 1 // 0 }}", "the chat template failed on the messages: ZeroDivisionError"),
        ("{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}", "rendered more than 4,194,304 characters"),
    ],
)
def test_a_template_that_fails_or_renders_without_end_is_a_text_error(tmp_path, template, says):
    tok = with_template(tmp_path, template)
    with pytest.raises(TextError, match=says):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_a_lone_surrogate_is_a_text_error(tok):
    with pytest.raises(TextError, match="lone surrogate"):
        tok.encode("a\ud800b")


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_tokenizer_files_pass_the_checkpoint_guards(tmp_path, name):
    """A FIFO would hang the read, and a link out of the directory (to /dev/zero, say)
    would be read without bound: both are refused by name, as for the weights."""
    save_tiny_tokenizer(tmp_path)
    (tmp_path / name).unlink()
    os.mkfifo(tmp_path / name)
    with pytest.raises(TextError, match="is not a regular file"):
        TextTokenizer.from_directory(tmp_path)
    (tmp_path / name).unlink()
    (tmp_path / name).symlink_to("/dev/zero")
    with pytest.raises(TextError, match="outside the checkpoint directory"):
        TextTokenizer.from_directory(tmp_path)


def test_a_tokens_bytes_are_its_part_of_a_character(tok):
    """OpenAI's logprobs ``bytes``: a byte-level token that holds part of a UTF-8 character
    gives that part, where its decoded text would be U+FFFD."""
    text = "é世🙂 a"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(ids[0]) == b"\xc3" and tok.decode([ids[0]]) == "\ufffd"
    assert tok.token_bytes(EOS_TOKEN_ID) == b"<|endoftext|>"


def test_special_tokens_are_left_out_of_text_unless_asked_for(tok):
    ids = [*tok.encode("Hi"), EOS_TOKEN_ID, *tok.encode("!")]
    assert tok.decode(ids) == "Hi!" and tok.decode(ids, skip_special_tokens=False) == "Hi<|endoftext|>!"
    detok = tok.detokenizer(skip_special_tokens=False)
    assert "".join(detok.add([i]) for i in ids) == "Hi<|endoftext|>!"


class _PlainDecoder:
    """A tokenizer that is not a ``tokenizers.Tokenizer``: its detokenizer takes the Python steps."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _streamed(detok, ids):
    return [detok.add_token(i) for i in ids] + [detok.flush()]


def test_the_decode_stream_gives_the_python_steps_pieces(tok):
    """Random ids (special tokens and broken UTF-8 included) and real text: the same pieces,
    token by token, through tokenizers' DecodeStream as through the Python steps."""
    plain = TextTokenizer(_PlainDecoder(tok.tokenizer))
    rng = random.Random(0)
    for trial in range(200):
        if trial % 2:
            ids = tok.encode("naïve café — 日本語 🙂!" * 2)
        else:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 24))]
        for skip in (True, False):
            assert _streamed(tok.detokenizer(skip_special_tokens=skip), ids) == _streamed(
                plain.detokenizer(skip_special_tokens=skip), ids
            ), ids


def test_a_refused_stream_goes_on_in_python(tok, monkeypatch):
    """When the decode stream raises (tokenizers' InvalidPrefix), that token and the rest take
    the Python steps from the same state: the text is the same as without a stream."""

    class Refusing:
        def __init__(self, skip_special_tokens):
            self._stream, self._steps = DecodeStream(skip_special_tokens=skip_special_tokens), 0

        def step(self, tokenizer, token_id):
            self._steps += 1
            if self._steps == 5:
                raise Exception("Invalid prefix encountered")
            return self._stream.step(tokenizer, token_id)

    monkeypatch.setattr(text, "_decode_stream", lambda tokenizer, skip: Refusing(skip))
    ids = tok.encode("日本語 🙂 naïve")
    pieces = _streamed(tok.detokenizer(), ids)
    assert "".join(pieces) == "日本語 🙂 naïve" and "\ufffd" not in "".join(pieces)
