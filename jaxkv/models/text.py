"""Text in and out of a checkpoint's model: its tokenizer, chat template and streamed text.

A Hugging Face-format checkpoint directory ships ``tokenizer.json`` (read with the
``tokenizers`` library, the ``tokenizers`` extra) and often ``tokenizer_config.json``,
whose ``chat_template`` (Jinja) turns a list of chat messages into one prompt string.
The template is the checkpoint's code: it is rendered in Jinja's immutable sandbox, so
it can neither reach Python objects nor change what it is given.

:class:`IncrementalDetokenizer` turns a stream of token ids into a stream of text
pieces. A byte-level token may hold part of a UTF-8 character, and a tokenizer may
decode a token differently at the start of a text (a leading-space marker), so each
step decodes a short window of recent tokens twice (with and without the new ones)
and emits only the difference, holding it back while it ends in a partial character
(the replacement character U+FFFD). With a ``tokenizers.Tokenizer`` that step runs in the
library's ``DecodeStream`` (the same two decodes and the same rule, in Rust: one call a
token), as vLLM's fast detokenizer does; the Python steps remain for other tokenizers and
for a stream the library refuses.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxkv.errors import JaxkvError
from jaxkv.models.checkpoint_errors import CheckpointError
from jaxkv.models.checkpoint_files import confined_file, read_bytes, read_json

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_TOKENIZER_BYTES = 256 << 20
"""``tokenizer.json`` and ``tokenizer_config.json`` are refused above 256 MiB (large
vocabularies' are tens of MiB); both are read as the weights are (regular files inside
the checkpoint, :mod:`jaxkv.models.checkpoint_files`)."""
_PARTIAL = "\ufffd"
MAX_RENDERED_CHARS = 4 << 20
MAX_RENDER_S = 5.0
"""A chat template is the checkpoint's code run on a client's messages: what it renders
is bounded in size and, between the pieces it yields, in time."""


class TextError(JaxkvError, ValueError):
    """A tokenizer or chat template that cannot be loaded or applied (the message names why)."""


class TextTokenizer:
    """A checkpoint's tokenizer (a ``tokenizers.Tokenizer``) and its chat template, if any."""

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None, special: Mapping[str, str] | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special = dict(special or {})
        """``bos_token`` / ``eos_token`` strings the template may use."""
        self._template: Any = None
        self._byte_level = type(getattr(tokenizer, "decoder", None)).__name__ == "ByteLevel"

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> TextTokenizer:
        """The tokenizer of the checkpoint directory ``path`` (``tokenizer.json``) with the
        ``chat_template`` of its ``tokenizer_config.json`` when it has one."""
        directory = Path(path)
        file = directory / TOKENIZER_FILE
        if not os.path.lexists(file):
            raise TextError(f"{file} does not exist: the checkpoint ships no tokenizer")
        try:
            from tokenizers import Tokenizer
        except ImportError as err:
            raise TextError("text needs the tokenizers library: pip install 'jaxkv[tokenizers]'") from err
        try:
            text = read_bytes(confined_file(directory, TOKENIZER_FILE, TOKENIZER_FILE), MAX_TOKENIZER_BYTES)
            config = {}
            if os.path.lexists(directory / TOKENIZER_CONFIG):
                config = read_json(confined_file(directory, TOKENIZER_CONFIG, TOKENIZER_CONFIG), MAX_TOKENIZER_BYTES)
        except CheckpointError as err:
            raise TextError(str(err)) from None
        if not isinstance(config, dict):
            raise TextError(f"{directory / TOKENIZER_CONFIG} must hold a JSON object, got {type(config).__name__}")
        try:
            tokenizer = Tokenizer.from_str(text.decode())
        except Exception as err:  # tokenizers raises its own exception types; bad UTF-8 too
            raise TextError(f"cannot read {file}: {err}"[:400]) from None
        special = {k: _token_text(config[k]) for k in ("bos_token", "eos_token") if config.get(k) is not None}
        return cls(tokenizer, chat_template=_template_text(config.get("chat_template")), special=special)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids (special-token text such as ``<|user|>`` becomes its id)."""
        if not isinstance(text, str):
            raise TextError(f"text to encode must be a str, got {text!r:.80}")
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=False).ids)
        except TypeError:  # what tokenizers raises for a str it cannot hand over as UTF-8
            raise TextError("text to encode holds a lone surrogate (not valid Unicode text)") from None

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes ``token_id`` stands for, a part of a UTF-8 character included (what
        OpenAI's logprobs ``bytes`` give): a byte-level vocabulary's entry mapped back through
        its byte alphabet, a ``<0xNN>`` byte-fallback token's byte, else the token's text."""
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level and all(ch in _BYTE_OF_CHAR for ch in token):
            return bytes(_BYTE_OF_CHAR[ch] for ch in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return token.replace("\u2581", " ").encode()

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """``token_ids`` as text, special tokens left out unless ``skip_special_tokens`` is False."""
        return str(self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt of a chat (``[{"role": ..., "content": ...}, ...]``) rendered by the
        checkpoint's template in a sandbox; :class:`TextError` without a template or when
        the template refuses the messages."""
        if self.chat_template is None:
            raise TextError("the checkpoint has no chat_template in its tokenizer_config.json")
        if not isinstance(messages, Sequence) or not all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in messages
        ):
            raise TextError(f"messages must be a list of {{'role': str, 'content': ...}} objects, got {messages!r:.80}")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            if self._template is None:
                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
                env.globals["raise_exception"] = _raise_template_error
                self._template = env.from_string(self.chat_template)
            pieces = self._template.generate(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **self.special
            )
            return _bounded(pieces)
        except jinja2.TemplateError as err:
            raise TextError(f"the chat template refused the messages: {err}") from err
        except TextError:
            raise
        except Exception as err:  # the template's own failure (a division by zero, a recursion, ...)
            raise TextError(f"the chat template failed on the messages: {type(err).__name__}: {err}"[:400]) from None

    def detokenizer(self, *, skip_special_tokens: bool = True) -> IncrementalDetokenizer:
        """A fresh :class:`IncrementalDetokenizer` over this tokenizer."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Text pieces of a growing sequence of token ids (see the module docstring).

    ``text`` is all text emitted so far; :meth:`add` (or :meth:`add_token`, for one id)
    returns the new piece (possibly empty while a character is incomplete), :meth:`flush`
    whatever was held back.
    """

    def __init__(self, tokenizer: TextTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # tokens whose text was emitted
        self._stream = _decode_stream(tokenizer.tokenizer, skip_special_tokens)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append ``token_ids``; the text they complete (with a decode stream, token by token)."""
        if self._stream is None:
            self._ids.extend(token_ids)
            return self._emit(final=False)
        return "".join([self.add_token(t) for t in token_ids])

    def add_token(self, token_id: int) -> str:
        """Append one token id; the text it completes. Through the decode stream when there
        is one; on its refusal (a window whose text does not begin with the text before it,
        an id it cannot take) this token and the rest go through the Python steps, whose
        state the stream's mirrors."""
        if self._stream is None:
            self._ids.append(token_id)
            return self._emit(final=False)
        ids = self._ids
        ids.append(token_id)
        try:
            piece = self._stream.step(self._tokenizer.tokenizer, int(token_id))
        except Exception:  # tokenizers' own errors (its InvalidPrefix), an id out of range
            self._stream = None
            return self._emit(final=False)
        if piece is None:
            return ""
        self._prefix, self._read = self._read, len(ids)
        self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """The text still held back (a partial character at the end, as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        decode, skip = self._tokenizer.decode, self._skip_special_tokens
        before = decode(self._ids[self._prefix : self._read], skip_special_tokens=skip)
        after = decode(self._ids[self._prefix :], skip_special_tokens=skip)
        if len(after) <= len(before) or (after.endswith(_PARTIAL) and not final):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._pieces.append(piece)
        return piece


def _decode_stream(tokenizer: Any, skip_special_tokens: bool) -> Any:
    """A ``tokenizers.decoders.DecodeStream`` for ``tokenizer`` when it is a ``tokenizers.Tokenizer``
    and the library has one (0.21 on), else None."""
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return DecodeStream(skip_special_tokens=skip_special_tokens) if isinstance(tokenizer, Tokenizer) else None


def load_tokenizer(path: str | os.PathLike[str]) -> TextTokenizer | None:
    """The tokenizer of checkpoint directory ``path``; None when it has no ``tokenizer.json``
    or the ``tokenizers`` library is missing (the engine then works in token ids only)."""
    if not (Path(path) / TOKENIZER_FILE).exists():
        return None
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return None
    return TextTokenizer.from_directory(path)


def _token_text(value: object) -> str:
    """A special token as text: a string, or an added-token object's ``content``."""
    return str(value["content"]) if isinstance(value, dict) else str(value)


def _template_text(value: object) -> str | None:
    """The chat template: a string, or from a list of named templates the ``default`` one."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        if isinstance(template, str):
            return template
    raise TextError(f"chat_template must be a string or a list with a 'default' template, got {value!r:.80}")


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte as the printable character that spells it
    in a vocabulary; printable Latin-1 bytes stand for themselves, the other bytes for the
    characters from U+0100 on, in byte order. Inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return {ch: b for b, ch in chars.items()}


_BYTE_OF_CHAR = _byte_alphabet()


def _bounded(pieces: Iterable[str]) -> str:
    """The rendered pieces joined, refused once they pass :data:`MAX_RENDERED_CHARS` or
    take longer than :data:`MAX_RENDER_S` (checked between pieces)."""
    size, deadline = 0, time.monotonic() + MAX_RENDER_S

    def checked() -> Iterator[str]:
        nonlocal size
        for piece in pieces:
            size += len(piece)
            if size > MAX_RENDERED_CHARS:
                raise TextError(f"the chat template rendered more than {MAX_RENDERED_CHARS:,} characters")
            if time.monotonic() > deadline:
                raise TextError(f"the chat template took more than {MAX_RENDER_S} s")
            yield piece

    return "".join(checked())


def _raise_template_error(message: str) -> None:
    """``raise_exception(...)`` inside a template: the template refuses its input."""
    import jinja2

    raise jinja2.TemplateError(message)
