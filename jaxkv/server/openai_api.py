"""OpenAI's completions and chat completions bodies: parsed into a prompt and
:class:`~jaxkv.serving.sampling_params.SamplingParams`, answered from engine deltas.

No web framework here: :mod:`jaxkv.server.app` routes, this module checks and shapes.
A body field out of range is an :class:`ApiError` (HTTP 400, OpenAI's
``invalid_request_error``) naming the field, raised before the engine sees anything.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxkv.errors import JaxkvError
from jaxkv.ints import is_int
from jaxkv.models.text import TextError, TextTokenizer
from jaxkv.serving.outputs import RequestDelta, TokenLogprobs
from jaxkv.serving.sampling_params import SamplingParams, SamplingParamsError

_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos")


class ApiError(JaxkvError, ValueError):
    """A request the server answers with an OpenAI error body (``status``, ``kind``, ``param``)."""

    def __init__(
        self, message: str, *, status: int = 400, kind: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class ParsedRequest:
    """A checked request: its prompt ids, parameters and how to answer."""

    kind: str
    """"completion" or "chat"."""
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def parse(kind: str, body: object, tokenizer: TextTokenizer | None, model: str) -> ParsedRequest:
    """``body`` of a ``/v1/completions`` ("completion") or ``/v1/chat/completions`` ("chat") request."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    if kind == "chat":
        prompt = _chat_prompt(body.get("messages"), tokenizer)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        logprobs = _chat_logprobs(body)
    else:
        prompt = _completion_prompt(body.get("prompt"), tokenizer)
        max_tokens = body.get("max_tokens", 16)
        logprobs = body.get("logprobs")
    stop = body.get("stop")
    fields = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            stop=() if stop is None else stop,
            stop_token_ids=body.get("stop_token_ids") or (),
            logprobs=logprobs,
            **fields,
        )
    except SamplingParamsError as err:
        raise ApiError(str(err), param=str(err).split(" ", 1)[0]) from None
    stream = body.get("stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise ApiError(f"stream must be a bool and stream_options an object, got {stream!r}, {options!r}")
    return ParsedRequest(
        kind, prompt, params, stream, bool(options.get("include_usage")), str(body.get("model", model))
    )


def _completion_prompt(prompt: object, tokenizer: TextTokenizer | None) -> list[int]:
    """A completion prompt: text, token ids, or a list of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError("a text prompt needs a tokenizer; this checkpoint has none: send token ids", param="prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise ApiError(f"prompt must be a string or a non-empty list of token ids, got {prompt!r:.80}", param="prompt")


def _chat_prompt(messages: object, tokenizer: TextTokenizer | None) -> list[int]:
    if tokenizer is None:
        raise ApiError("chat needs a tokenizer and chat template; this checkpoint has none", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(f"messages must be a non-empty list, got {messages!r:.80}", param="messages")
    try:
        return tokenizer.encode(tokenizer.apply_chat_template(messages))
    except TextError as err:
        raise ApiError(str(err), param="messages") from None


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat asks ``logprobs: true`` and ``top_logprobs: k``; the engine's ``logprobs`` is k."""
    wanted = body.get("logprobs", False)
    if not isinstance(wanted, bool):
        raise ApiError(f"logprobs must be a bool in chat completions, got {wanted!r}", param="logprobs")
    top = body.get("top_logprobs")
    return (0 if top is None else top) if wanted else None


# --------------------------------------------------------------------- answers
class Answer:
    """The response to one parsed request, built from its deltas: whole, or as stream chunks."""

    def __init__(self, request: ParsedRequest, tokenizer: TextTokenizer | None) -> None:
        self.request = request
        self.tokenizer = tokenizer
        n = request.params.n
        self.texts = [""] * n
        self.token_ids: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        self.finish: list[str | None] = [None] * n
        self._started = [False] * n

    def add(self, delta: RequestDelta) -> None:
        i = delta.index
        self.texts[i] += delta.text
        self.token_ids[i] += delta.token_ids
        self.logprobs[i] += delta.logprobs or ()
        self.finish[i] = delta.finish_reason

    @property
    def usage(self) -> dict[str, int]:
        prompt = len(self.request.prompt_token_ids)
        completion = sum(len(ids) for ids in self.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def whole(self) -> dict[str, Any]:
        """The non-streamed response."""
        chat = self.request.kind == "chat"
        choices = []
        for i in range(self.request.params.n):
            choice: dict[str, Any] = {"index": i, "finish_reason": self.finish[i]}
            if chat:
                choice["message"] = {"role": "assistant", "content": self.texts[i]}
            else:
                choice["text"] = self.texts[i]
            choice["logprobs"] = self._logprobs(self.logprobs[i])
            choices.append(choice)
        return {**self._head(), "choices": choices, "usage": self.usage}

    def chunk(self, delta: RequestDelta) -> dict[str, Any]:
        """One stream chunk for ``delta`` (recorded first with :meth:`add`)."""
        i = delta.index
        choice: dict[str, Any] = {"index": i, "finish_reason": delta.finish_reason}
        if self.request.kind == "chat":
            message: dict[str, Any] = {"content": delta.text}
            if not self._started[i]:
                message["role"] = "assistant"
                self._started[i] = True
            choice["delta"] = message
        else:
            choice["text"] = delta.text
        choice["logprobs"] = (
            self._logprobs(list(delta.logprobs or ())) if self.request.params.logprobs is not None else None
        )
        return {**self._head(), "choices": [choice]}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head(), "choices": [], "usage": self.usage}

    def _head(self) -> dict[str, Any]:
        chat = self.request.kind == "chat"
        kind = ("chat.completion.chunk" if self.request.stream else "chat.completion") if chat else "text_completion"
        return {"id": self.request.id, "object": kind, "created": self.request.created, "model": self.request.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _logprobs(self, items: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
        if self.request.params.logprobs is None:
            return None
        if self.request.kind == "chat":
            return {
                "content": [
                    {
                        "token": self._token(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(self._token(lp.token_id).encode()),
                        "top_logprobs": [
                            {"token": self._token(t), "logprob": v, "bytes": list(self._token(t).encode())}
                            for t, v in lp.top
                        ],
                    }
                    for lp in items
                ]
            }
        return {
            "tokens": [self._token(lp.token_id) for lp in items],
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self._token(t): v for t, v in lp.top} for lp in items],
        }
