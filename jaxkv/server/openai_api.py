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

import numpy as np

from jaxkv.errors import JaxkvError
from jaxkv.ints import is_int
from jaxkv.models.text import TextError, TextTokenizer
from jaxkv.serving.outputs import RequestDelta, TokenLogprobs
from jaxkv.serving.sampling_params import SamplingParams, SamplingParamsError

_SAMPLING_FIELDS = (
    *("n", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "ignore_eos"),
    *("include_stop_str_in_output", "skip_special_tokens"),
    *("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"),
)

_RENDERED = (
    *("n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"),
    *("presence_penalty", "frequency_penalty", "repetition_penalty"),
)
"""The parameters a render endpoint gives under vLLM's names, as they are (stops and logit bias apart)."""

_HONOURED = {
    "common": frozenset(
        {*_SAMPLING_FIELDS, "model", "stream", "stream_options", "max_tokens", "stop", "stop_token_ids"}
        | {"logprobs", "prompt_logprobs", "cache_salt", "user"}
    ),
    "completion": frozenset({"prompt", "echo"}),
    "chat": frozenset(
        {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt", "continue_final_message"}
    ),
}
"""The body fields each route honours (``user`` is OpenAI's caller label: nothing to do)."""

_INERT: dict[str, tuple[object, ...]] = {
    "length_penalty": (1,),
    "allowed_token_ids": (),
    "bad_words": ([],),
    "response_format": ({"type": "text"},),
    "structured_outputs": (),
    "guided_json": (),
    "guided_regex": (),
    "guided_choice": (),
    "guided_grammar": (),
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "functions": ([],),
    "function_call": ("none",),
    "best_of": (1,),
    "use_beam_search": (False,),
    "spaces_between_special_tokens": (True,),
    "suffix": ("",),
    "truncate_prompt_tokens": (),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": (),
    "store": (False,),
    "metadata": (),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "reasoning_effort": (),
    "service_tier": ("auto", "default"),
    "web_search_options": (),
    # SGLang's, sent by vllm-router 0.1.17 on every chat request at these values (ask for nothing here)
    "no_stop_trim": (False,),
    "separate_reasoning": (True,),
    "stream_reasoning": (True,),
    "include_reasoning": (True,),
    "return_hidden_states": (False,),
}
"""Fields vLLM or OpenAI know that jaxkv does not implement: refused by name unless absent,
null or at a value that asks for nothing (``best_of`` 1, no tools)."""


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
    cache_salt: str | None = None
    echo: bool = False
    """A completion's text (and its logprobs) start with its prompt's."""
    echo_only: bool = False
    """``echo`` with ``max_tokens`` 0: the answer is the prompt alone (one token is drawn, unshown)."""
    continuous_usage: bool = False
    """Every stream chunk carries the usage so far."""
    branch_points: tuple[int, ...] = ()
    """A chat's message boundaries where later chats likely leave this prompt (:func:`branch_points`)."""
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))


def parse(
    kind: str, body: object, tokenizer: TextTokenizer | None, model: str, max_model_len: int | None = None
) -> ParsedRequest:
    """``body`` of a ``/v1/completions`` ("completion") or ``/v1/chat/completions`` ("chat")
    request to the model served as ``model``; a prompt and ``max_tokens`` past ``max_model_len``
    tokens are refused, as vLLM refuses them."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_fields(kind, body)
    check_model(body.get("model", model), model)
    points: tuple[int, ...] = ()
    if kind == "chat":
        prompt, messages = _chat_prompt(body, tokenizer)
        points = branch_points(messages, prompt, tokenizer) if tokenizer is not None else ()
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        logprobs = _chat_logprobs(body)
    else:
        prompt = _completion_prompt(body.get("prompt"), tokenizer)
        max_tokens = body.get("max_tokens", 16)
        logprobs = body.get("logprobs")
    if max_model_len is not None and is_int(max_tokens) and len(prompt) + max_tokens > max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} in the completion).",
            param="max_tokens",
        )
    echo = body.get("echo", False)
    if not isinstance(echo, bool) or (echo and tokenizer is None):
        raise ApiError(
            f"echo must be a bool, supported for a checkpoint with a tokenizer; got {echo!r:.80}", param="echo"
        )
    stream = body.get("stream", False)
    prompt_logprobs = body.get("prompt_logprobs")
    if stream is True and is_int(prompt_logprobs) and prompt_logprobs != 0:
        raise ApiError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    if prompt_logprobs is None and echo:  # legacy echo scores the prompt with the output's logprobs, as vLLM
        prompt_logprobs = logprobs
    echo_only = echo and max_tokens == 0
    stop = body.get("stop")
    fields = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    try:
        params = SamplingParams(
            max_tokens=1 if echo_only else max_tokens,
            stop=() if stop is None else stop,
            stop_token_ids=body.get("stop_token_ids") or (),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            **fields,
        )
    except SamplingParamsError as err:
        raise ApiError(str(err), param=str(err).split(" ", 1)[0].split("=", 1)[0]) from None
    options = body.get("stream_options") or {}
    if not isinstance(stream, bool) or not isinstance(options, dict):
        raise ApiError(f"stream must be a bool and stream_options an object, got {stream!r:.80}, {options!r:.80}")
    unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ApiError(f"stream_options field {unknown[0]!r:.80} is not supported", param="stream_options")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ApiError(f"cache_salt must be a non-empty string, got {salt!r:.80}", param="cache_salt")
    return ParsedRequest(
        kind,
        prompt,
        params,
        stream,
        bool(options.get("include_usage")),
        model,
        cache_salt=salt,
        echo=echo,
        echo_only=echo_only,
        continuous_usage=bool(options.get("continuous_usage_stats")),
        branch_points=points,
    )


def rendered(request: ParsedRequest) -> dict[str, Any]:
    """``request`` as vLLM's render endpoints give it (a ``GenerateRequest``): the prompt's
    token ids and the sampling parameters under vLLM's names, what a router asks a worker for."""
    params = request.params
    sampling = {name: getattr(params, name) for name in _RENDERED}
    sampling["logit_bias"] = None if params.logit_bias is None else dict(params.logit_bias)
    sampling |= {"stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids)}
    return {
        "request_id": request.id,
        "token_ids": request.prompt_token_ids,
        "sampling_params": {**sampling, "ignore_eos": params.ignore_eos},
        "model": request.model,
        "stream": request.stream,
        "cache_salt": request.cache_salt,
    }


def tokenized(body: object, tokenizer: TextTokenizer | None, model: str, max_model_len: int) -> dict[str, Any]:
    """vLLM's ``/tokenize``: a ``prompt`` (text) or chat ``messages`` as token ids."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    check_model(body.get("model", model), model)
    unknown = sorted(set(body) - {"model", "prompt", "messages", "add_generation_prompt", "continue_final_message"})
    if unknown:
        raise ApiError(f"unknown field {unknown[0]!r:.80} for /tokenize", param=unknown[0])
    ids = _chat_prompt(body, tokenizer)[0] if "messages" in body else _completion_prompt(body.get("prompt"), tokenizer)
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}


def detokenized(body: object, tokenizer: TextTokenizer | None, model: str) -> dict[str, Any]:
    """vLLM's ``/detokenize``: ``tokens`` as text."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    check_model(body.get("model", model), model)
    tokens = body.get("tokens")
    if tokenizer is None:
        raise ApiError("detokenizing needs a tokenizer; this checkpoint has none", param="tokens")
    if not isinstance(tokens, list) or not all(is_int(t) and 0 <= t < tokenizer.vocab_size for t in tokens):
        raise ApiError(f"tokens must be a list of ids below {tokenizer.vocab_size}, got {tokens!r:.80}", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}


def check_model(asked: object, model: str) -> None:
    """A model ``asked`` for other than the one served as ``model`` is vLLM's 404."""
    if asked != model:
        raise ApiError(f"The model `{asked!s:.200}` does not exist.", status=404, kind="NotFoundError", param="model")


def _check_fields(kind: str, body: Mapping[str, Any]) -> None:
    """Refuse, by name, a field the route does not honour (see :data:`_INERT`)."""
    honoured = _HONOURED["common"] | _HONOURED[kind]
    for name, value in body.items():
        if name in honoured or value is None:
            continue
        if name not in _INERT:
            raise ApiError(f"unknown field {name!r:.80}: jaxkv honours {', '.join(sorted(honoured))}", param=name)
        if not any(isinstance(value, bool) == isinstance(inert, bool) and value == inert for inert in _INERT[name]):
            raise ApiError(f"{name}={value!r:.80} is not supported by jaxkv (leave it out)", param=name)


def _completion_prompt(prompt: object, tokenizer: TextTokenizer | None) -> list[int]:
    """A completion prompt: text, token ids, or a list of one of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError("a text prompt needs a tokenizer; this checkpoint has none: send token ids", param="prompt")
        try:
            return tokenizer.encode(prompt)
        except TextError as err:
            raise ApiError(str(err), param="prompt") from None
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise ApiError(f"prompt must be a string or a non-empty list of token ids, got {prompt!r:.80}", param="prompt")


def _chat_prompt(body: Mapping[str, Any], tokenizer: TextTokenizer | None) -> tuple[list[int], list[Any]]:
    """The chat's prompt ids (text parts of a message's ``content`` joined by newlines, as
    vLLM joins them; ``continue_final_message`` leaves the last message open) and its
    messages so joined."""
    messages = body.get("messages")
    if tokenizer is None:
        raise ApiError("chat needs a tokenizer and chat template; this checkpoint has none", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(f"messages must be a non-empty list, got {messages!r:.80}", param="messages")
    messages = [_text_message(m) for m in messages]
    generation = body.get("add_generation_prompt", True)
    final = body.get("continue_final_message", False)
    if not isinstance(generation, bool) or not isinstance(final, bool) or (generation and final):
        raise ApiError(
            "add_generation_prompt and continue_final_message must be bools, not both true; "
            f"got {generation!r:.20}, {final!r:.20}",
            param="continue_final_message",
        )
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation)
        if final:
            content = str(messages[-1].get("content") or "")
            end = text.rfind(content) if content else -1
            if end < 0:
                raise ApiError("continue_final_message: the template does not render the last message's content")
            text = text[: end + len(content)]
        ids = tokenizer.encode(text)
    except TextError as err:
        raise ApiError(str(err), param="messages") from None
    return ids, messages


BRANCH_ROLES = ("system", "developer")
"""Roles of the leading messages that many chats share (the instructions)."""


def branch_points(messages: Sequence[Any], ids: Sequence[int], tokenizer: TextTokenizer) -> tuple[int, ...]:
    """Where later chats are likely to leave this prompt: after its leading instructions
    (:data:`BRANCH_ROLES`: other conversations under the same system prompt) and before
    its last message unless an assistant message comes right before it (the same
    messages with another last one, as a document and then a question; after the model's
    own turn the engine has a state where that turn ended already). Each is the prompt's
    tokens in common with the chat cut there, rendered alone, so a template that renders a
    prefix differently gives a shorter, still exact position; one the template refuses
    gives none. A recurrent model checkpoints its state at these, so such a chat resumes
    there instead of from the start."""
    lead = next((i for i, m in enumerate(messages) if m.get("role") not in BRANCH_ROLES), len(messages))
    cuts = {lead}
    if len(messages) > 1 and messages[-2].get("role") != "assistant":
        cuts.add(len(messages) - 1)
    points = set()
    for cut in cuts:
        if not 0 < cut < len(messages):
            continue
        try:
            prefix = tokenizer.encode(tokenizer.apply_chat_template(messages[:cut], add_generation_prompt=False))
        except TextError:
            continue
        n = min(len(prefix), len(ids))
        differ = np.flatnonzero(np.asarray(prefix[:n]) != np.asarray(ids[:n]))
        common = int(differ[0]) if differ.size else n
        if 0 < common < len(ids):
            points.add(common)
    return tuple(sorted(points))


def _text_message(message: object) -> object:
    """``message`` with a list ``content`` of text parts as one string; other parts refused."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for part in message["content"]:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ApiError(f"content part {part!r:.80} is not supported: only text parts are", param="messages")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


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
        self.prompt_logprobs: list[tuple[TokenLogprobs | None, ...] | None] = [None] * n
        self.finish: list[str | None] = [None] * n
        self._offsets = [0] * n  # text_offset of each sequence's next reported token
        self.cached_tokens = 0
        self._started = [False] * n
        self._echo = tokenizer.decode(request.prompt_token_ids) if request.echo and tokenizer is not None else ""

    def add(self, delta: RequestDelta) -> None:
        i = delta.index
        self.texts[i] += delta.text
        self.token_ids[i] += delta.token_ids
        self.logprobs[i] += delta.logprobs or ()
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[i] = delta.prompt_logprobs
        self.finish[i] = delta.finish_reason
        if i == 0 and delta.num_cached_tokens is not None:
            self.cached_tokens = delta.num_cached_tokens

    @property
    def usage(self) -> dict[str, Any]:
        """Token counts; ``prompt_tokens_details.cached_tokens``: the prompt tokens the first
        sequence found in the prefix cache (known once it finished)."""
        prompt = len(self.request.prompt_token_ids)
        completion = sum(len(ids) for ids in self.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def whole(self) -> dict[str, Any]:
        """The non-streamed response."""
        chat = self.request.kind == "chat"
        choices = []
        for i in range(self.request.params.n):
            choice: dict[str, Any] = {"index": i, "finish_reason": self.finish[i]}
            if chat:
                choice["message"] = {"role": "assistant", "content": self.texts[i]}
                choice["logprobs"] = self._logprobs(self.logprobs[i])
            else:
                choice["text"] = self._echo + ("" if self.request.echo_only else self.texts[i])
                output = [] if self.request.echo_only else self.logprobs[i]
                choice["logprobs"] = self._completion_logprobs(i, output, self.prompt_logprobs[i])
                if self.request.params.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(self.prompt_logprobs[i])
            choices.append(choice)
        whole = {**self._head(), "choices": choices, "usage": self.usage}
        if chat and self.request.params.prompt_logprobs is not None:
            whole["prompt_logprobs"] = self._prompt_logprobs(self.prompt_logprobs[0])
        return whole

    def chunk(self, delta: RequestDelta) -> dict[str, Any]:
        """One stream chunk for ``delta`` (recorded first with :meth:`add`)."""
        i = delta.index
        choice: dict[str, Any] = {"index": i, "finish_reason": delta.finish_reason}
        if self.request.kind == "chat":  # the role went in the opening chunks
            choice["delta"] = {"content": delta.text}
            choice["logprobs"] = self._logprobs(list(delta.logprobs or ()))
        else:
            echoing = not self._started[i] and self.request.echo
            text = "" if self.request.echo_only else delta.text
            choice["text"] = self._echo + text if echoing else text
            self._started[i] = True
            prompt = delta.prompt_logprobs if echoing else None
            output = () if self.request.echo_only else delta.logprobs or ()
            choice["logprobs"] = self._completion_logprobs(i, output, prompt)
        if self.request.continuous_usage:
            return {**self._head(), "choices": [choice], "usage": self.usage}
        return {**self._head(), "choices": [choice]}

    def opening_chunks(self) -> list[dict[str, Any]]:
        """A chat stream's first chunks, one per choice: its role and empty content, as vLLM opens
        one (clients count a later chunk with empty content, e.g. an EOS, as a token)."""
        if self.request.kind != "chat":
            return []
        opening = {"role": "assistant", "content": ""}
        choices = [
            {"index": i, "delta": opening, "logprobs": None, "finish_reason": None} for i in range(len(self.texts))
        ]
        return [{**self._head(), "choices": [choice]} for choice in choices]

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._head(), "choices": [], "usage": self.usage}

    def _head(self) -> dict[str, Any]:
        chat = self.request.kind == "chat"
        kind = ("chat.completion.chunk" if self.request.stream else "chat.completion") if chat else "text_completion"
        return {"id": self.request.id, "object": kind, "created": self.request.created, "model": self.request.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _bytes(self, token_id: int) -> list[int]:
        raw = self.tokenizer.token_bytes(token_id) if self.tokenizer is not None else str(token_id).encode()
        return list(raw)

    def _logprob_entry(self, item: TokenLogprobs) -> dict[int, dict[str, Any]]:
        """vLLM's log-probabilities of one prompt position: the token's, then the most likely
        (a token among them listed once, where it came first)."""
        entry = {item.token_id: {"logprob": max(item.logprob, -9999.0), "rank": item.rank}}
        for rank, (token, logprob) in enumerate(item.top, start=1):
            entry[token] = {"logprob": max(logprob, -9999.0), "rank": rank}
        return {t: {**v, "decoded_token": self._token(t)} for t, v in entry.items()}

    def _prompt_logprobs(self, items: Sequence[TokenLogprobs | None] | None) -> list[Any] | None:
        """vLLM's ``prompt_logprobs``: None for the first token, then ``{id: {logprob, rank, decoded_token}}``."""
        return None if items is None else [None if item is None else self._logprob_entry(item) for item in items]

    def _completion_logprobs(
        self, i: int, output: Sequence[TokenLogprobs], prompt: Sequence[TokenLogprobs | None] | None
    ) -> dict[str, Any] | None:
        """Legacy completions logprobs of sequence ``i``'s tokens (with ``echo``, its prompt's
        first, the first one's None; each prompt position's top ``logprobs + 1`` as vLLM gives
        them) and their ``text_offset`` s, counted on from the last reported."""
        k = self.request.params.logprobs
        if k is None:
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for item in prompt or ():
            if item is None:
                values.append(None)
                tops.append(None)
                tokens.append(self._token(self.request.prompt_token_ids[0]))
                continue
            entry = list(self._logprob_entry(item).values())[: k + 1]
            tokens.append(self._token(item.token_id))
            values.append(max(item.logprob, -9999.0))
            tops.append({e["decoded_token"]: e["logprob"] for e in entry})
        out = self._logprobs(output)
        assert out is not None  # k is not None
        offsets = []
        for token in tokens + out["tokens"]:
            offsets.append(self._offsets[i])
            self._offsets[i] += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": values + out["token_logprobs"],
            "tokens": tokens + out["tokens"],
            "top_logprobs": tops + out["top_logprobs"],
        }

    def _logprobs(self, items: Sequence[TokenLogprobs]) -> dict[str, Any] | None:
        if self.request.params.logprobs is None:
            return None
        if self.request.kind == "chat":
            return {
                "content": [
                    {
                        "token": self._token(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": self._bytes(lp.token_id),
                        "top_logprobs": [
                            {"token": self._token(t), "logprob": v, "bytes": self._bytes(t)} for t, v in lp.top
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
