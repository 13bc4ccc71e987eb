"""The OpenAI-compatible server, live on loopback, through the official ``openai`` client."""

import asyncio
import json
import time
from http.client import HTTPConnection

import pytest
from hf_checkpoints import save_tiny_checkpoint
from tiny_tokenizer import EOS_TOKEN_ID, save_tiny_tokenizer

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from jaxkv.models.text import load_tokenizer  # noqa: E402
from jaxkv.server.cli import ServerThread, build_app, parser  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]  # a server thread, an engine compiled on it
PROMPT = "The cache holds blocks of keys and values; " * 2


def http(url: str, method: str, path: str, body: bytes | None = None, key: str = "k") -> tuple[int, str]:
    """One plain HTTP request (the standard library's client); its status and body."""
    host, port = url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {key}"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


class LiveServer(ServerThread):
    """The app of ``flags`` live on loopback, once its engine is built (``/health`` 200)."""

    def __init__(self, flags: list[str]) -> None:
        super().__init__(build_app(parser().parse_args(flags)))
        deadline = time.time() + 300
        while http(self.url, "GET", "/health")[0] != 200:
            assert time.time() < deadline, "the engine was not built in time"
            time.sleep(0.2)

    def engine_state(self):
        """Unfinished requests, leaked blocks, free and usable blocks, read on the engine's thread."""
        engine = self.app.state.engine

        async def read():
            return await engine.call(
                lambda e: (e.has_unfinished, e.audit().device_blocks_leaked, e.manager.num_free_blocks)
            )

        return asyncio.run_coroutine_threadsafe(read(), engine._loop).result(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_checkpoint("llama", directory)
    save_tiny_tokenizer(directory)
    flags = ["--memory", "4MiB", "--max_model_len", "512", "--api_key", "k", "--served_model_name", "m"]
    live = LiveServer(["--checkpoint", str(directory), *flags])
    live.directory = directory
    yield live
    live.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0)


def scrape(server) -> dict[str, float]:
    """``/metrics`` as {name{labels}: value}, the series of model ``m``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http(server.url, "GET", "/metrics")[1]
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return {
        s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items()) if k != "model_name"): s.value
        for s in samples
        if s.labels.get("model_name") == "m"
    }


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [server.url and client.models.list().data[0].id]
    assert http(server.url, "GET", "/health") == (200, '{"status":"ok"}')
    before = scrape(server)
    client.completions.create(model="m", prompt="Hi", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    client.completions.create(model="m", prompt="Hi", max_tokens=2, n=2, seed=1, extra_body={"ignore_eos": True})
    after = scrape(server)
    grew = {name: after[name] - before.get(name, 0.0) for name in after}
    assert "vllm:kv_cache_usage_perc" in after and after["vllm:num_requests_waiting_by_reason{reason=capacity}"] == 0
    assert grew["vllm:request_success_total{finished_reason=length}"] == 3, "each of n sequences is a request"
    assert grew["vllm:generation_tokens_total"] == 3 + 2 * 2
    assert grew["vllm:prompt_tokens_total"] == 3 * 2, "'Hi' is 2 byte tokens, processed by 3 sequences"
    for series in (
        "time_to_first_token",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
        "request_inference_time",
        "request_time_per_output_token",
    ):
        assert grew[f"vllm:{series}_seconds_count"] == 3, series
    assert grew["vllm:inter_token_latency_seconds_count"] == 2 + 1 * 2
    assert grew["vllm:request_params_n_count"] == 2 and grew["vllm:request_params_n_sum"] == 3
    assert grew["vllm:request_params_max_tokens_sum"] == 3 + 2 * 2
    assert grew["vllm:request_max_num_generation_tokens_sum"] == 3 + 2
    assert grew["vllm:request_num_preemptions_count"] == 3 and grew["vllm:request_num_preemptions_sum"] == 0
    assert grew["vllm:request_prompt_tokens_sum"] == 3 * 2
    cached = grew["vllm:prompt_tokens_cached_total"]
    assert grew["vllm:request_prefill_kv_computed_tokens_sum"] == 3 * 2 - cached
    assert after["vllm:request_queue_time_seconds_bucket{le=7680.0}"] == after["vllm:request_queue_time_seconds_count"]


def test_a_completion_from_text_and_from_token_ids_stops_at_eos_or_length(server, client):
    text = client.completions.create(model="m", prompt=PROMPT, max_tokens=40, temperature=0)
    prompt_ids = load_tokenizer(server.directory).encode(PROMPT)
    ids = client.completions.create(model="m", prompt=prompt_ids, max_tokens=40, temperature=0)
    assert text.choices[0].finish_reason in ("stop", "length") and text.choices[0].text == ids.choices[0].text
    assert text.usage.prompt_tokens == len(PROMPT.encode())
    long = client.completions.create(model="m", prompt=PROMPT, max_tokens=200, temperature=1.0, seed=3)
    assert long.choices[0].finish_reason == "stop", "a random tiny model draws EOS (1 of 264 tokens) within 200"
    ignoring = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=30, seed=3, extra_body={"ignore_eos": True}
    )
    assert ignoring.choices[0].finish_reason == "length" and ignoring.usage.completion_tokens == 30


def test_a_stop_string_ends_the_text_before_it(client):
    full = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].text
    stop = text[5:7]
    cut = client.completions.create(model="m", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]
    include = {"include_stop_str_in_output": True}
    kept = client.completions.create(
        model="m", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop], extra_body=include
    )
    assert kept.choices[0].text == text[: text.index(stop) + len(stop)]


def test_a_streamed_stop_string_of_n_seeded_sequences_reports_no_token_past_it(client):
    """The text is made on the event loop and the stop string found there a step late: the
    stream still ends exactly there, and the tokens drawn past it count nowhere."""
    ask = {"model": "m", "prompt": PROMPT, "max_tokens": 30, "n": 2, "seed": 4, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**ask)
    stop = full.choices[1].text[6:8]
    whole = client.completions.create(**ask, stop=[stop])
    texts, reasons, usage = ["", ""], [None, None], None
    for chunk in client.completions.create(**ask, stop=[stop], stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        usage = chunk.usage or usage
    assert whole.choices[1].finish_reason == "stop" and whole.choices[1].text == full.choices[1].text.split(stop)[0]
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert reasons == [c.finish_reason for c in sorted(whole.choices, key=lambda c: c.index)]
    assert usage.completion_tokens == whole.usage.completion_tokens < full.usage.completion_tokens


def test_a_chat_stream_opens_with_the_role_so_a_first_token_that_is_a_stop_still_counts(server, client):
    """vLLM's benchmark client counted a chunk with a role as no token: a stream whose only token
    was a stop id (empty content) read as "never received a valid chunk" (found by its prefix run)."""
    ask = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}
    first = client.chat.completions.create(**ask, max_tokens=1, logprobs=True).choices[0].logprobs.content[0]
    tokenizer = load_tokenizer(server.directory)
    stop_id = next(t for t in range(tokenizer.vocab_size) if tokenizer.token_bytes(t) == bytes(first.bytes))
    chunks = list(
        client.chat.completions.create(**ask, max_tokens=5, n=2, stream=True, extra_body={"stop_token_ids": [stop_id]})
    )
    opening = [c.choices[0] for c in chunks[:2]]
    assert [(c.index, c.delta.role, c.delta.content, c.finish_reason) for c in opening] == [
        (0, "assistant", "", None),
        (1, "assistant", "", None),
    ]
    rest = [c.choices[0] for c in chunks[2:]]
    assert sorted((c.index, c.delta.role, c.delta.content, c.finish_reason) for c in rest) == [
        (0, None, "", "stop"),
        (1, None, "", "stop"),
    ]


def test_streams_add_up_to_the_whole_answer_with_usage_last(client):
    whole = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=20,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    streamed = client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
    assert (
        "".join(c.choices[0].text for c in streamed)
        == client.completions.create(model="m", prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text
    )


def test_seeds_reproduce_and_n_sequences_share_the_prompt(server, client):
    a, b = (
        client.completions.create(model="m", prompt=PROMPT, max_tokens=12, seed=7, temperature=1.0) for _ in range(2)
    )
    assert a.choices[0].text == b.choices[0].text
    many = client.completions.create(model="m", prompt=PROMPT, max_tokens=12, seed=7, n=3, logprobs=2)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.choices[0].text == a.choices[0].text, "sequence 0 uses the seed itself"
    assert all(len(c.logprobs.top_logprobs[0]) == 2 for c in many.choices)
    assert server.engine_state()[:2] == (False, 0)


def test_a_client_that_disconnects_aborts_its_request_and_every_block_is_freed(server):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 240, "stream": True, "ignore_eos": True}
    host, port = server.url.removeprefix("http://").split(":")
    conn = HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Authorization": "Bearer k"})
    response = conn.getresponse()
    while True:
        line = response.readline().decode()
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
            break  # leave after the first text
    conn.close()
    deadline = time.time() + 30
    while server.engine_state()[0] and time.time() < deadline:
        time.sleep(0.2)
    unfinished, leaked, _ = server.engine_state()
    assert not unfinished and leaked == 0
    metrics = http(server.url, "GET", "/metrics")[1]
    assert 'vllm:num_requests_running{model_name="m"} 0.0' in metrics, "the gauges are true once the server is idle"


def test_usage_names_the_prompt_tokens_found_cached(client):
    prompt = PROMPT + "cached twice"
    first = client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model="m", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt.encode()) - 1) // 16 * 16


def test_bad_requests_get_openai_error_bodies(server, client):
    with pytest.raises(openai.BadRequestError, match="temperature must be in"):
        client.completions.create(model="m", prompt="x", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="not an id in"):
        client.completions.create(model="m", prompt=[EOS_TOKEN_ID + 100])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    status, text = http(server.url, "POST", "/v1/completions", b"x" * (2 << 20))
    assert status == 413 and json.loads(text)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"presence_penalty": 2.5}, 400, "presence_penalty must be in [-2.0, 2.0], got 2.5"),
        ({"repetition_penalty": 0}, 400, "repetition_penalty must be a finite number > 0, got 0"),
        ({"logit_bias": {"x": 1}}, 400, "logit_bias keys must be token ids >= 0, got 'x'"),
        ({"logit_bias": {"99999": 1}}, 400, "logit_bias token 99999 is not an id in [0, "),
        ({"tools": [{"type": "function"}]}, 400, "tools="),
        ({"response_format": {"type": "json_object"}}, 400, "response_format="),
        ({"best_of": 3}, 400, "best_of=3"),
        ({"frobnicate": 1}, 400, "unknown field 'frobnicate'"),
        ({"model": "other"}, 404, "The model `other` does not exist."),
        ({"max_tokens": 511}, 400, "maximum context length is 512 tokens"),
        ({"n": 200_000}, 400, "n must be at most 128"),
        ({"top_k": 2**31}, 400, "top_k must be at most"),
        ({"stop": ["x"] * 90_000}, 400, "stop may list at most 32 strings"),
        ({"prompt": "a\ud800b"}, 400, "lone surrogate"),
        ({"echo": "yes"}, 400, "echo must be a bool"),
        ({"prompt_logprobs": -1}, 400, "prompt_logprobs=-1 (the whole vocabulary) is not supported"),
        ({"prompt_logprobs": 21}, 400, "prompt_logprobs must be at most 20"),
        ({"prompt_logprobs": 2, "stream": True}, 400, "`prompt_logprobs` are not available when `stream=True`"),
        ({"cache_salt": ""}, 400, "cache_salt must be a non-empty string"),
        ({"stream_options": {"include_usage": True, "every": 1}}, 400, "stream_options field 'every'"),
    ],
)
def test_every_field_is_honoured_or_refused_by_name_and_the_engine_lives_on(server, client, body, status, says):
    sent = json.dumps({"model": "m", "prompt": "Hi", "max_tokens": 8, **body})  # escapes a lone surrogate
    code, text = http(server.url, "POST", "/v1/completions", sent.encode())
    assert code == status and says in json.loads(text)["error"]["message"], text
    assert client.completions.create(model="m", prompt="Hi", max_tokens=2).usage.completion_tokens <= 2


def test_a_field_at_the_value_that_asks_nothing_is_accepted(client):
    inert = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1, "tools": [], "user": "u"}
    answer = client.completions.create(model="m", prompt="Hi", max_tokens=4, temperature=0, extra_body=inert)
    plain = client.completions.create(model="m", prompt="Hi", max_tokens=4, temperature=0)
    assert answer.choices[0].text == plain.choices[0].text


def test_a_chat_body_as_vllm_router_sends_it_is_accepted(client):
    """vllm-router 0.1.17 adds SGLang's fields to every chat request; each was refused
    by name (400), so no request reached a jaxkv replica through it (issue 42)."""
    added = {"no_stop_trim": False, "separate_reasoning": True, "stream_reasoning": True}
    added |= {"include_reasoning": True, "return_hidden_states": False, "skip_special_tokens": True}
    messages = [{"role": "user", "content": "Hi"}]
    answer = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0, extra_body=added)
    plain = client.chat.completions.create(model="m", messages=messages, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(
    "body",
    ["[" * 50_000 + "]" * 50_000, '{"model": "m", "prompt": "Hi", "max_tokens": ' + "9" * 5000 + "}", "\xff{"],
    ids=["nested 50k deep", "a 5,000-digit int", "not UTF-8"],
)
def test_bodies_json_cannot_read_are_400s(server, body):
    code, text = http(server.url, "POST", "/v1/completions", body.encode("latin-1"))
    assert code == 400 and "not JSON this server reads" in json.loads(text)["error"]["message"]


def test_chat_content_parts_are_joined_text_and_other_parts_refused(client):
    def chat(content, **extra):
        return client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0, **extra
        )

    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    assert chat(parts).choices[0].message.content == chat("Hi\nthere").choices[0].message.content
    assert chat(parts).usage.prompt_tokens == chat("Hi\nthere").usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="only text parts are"):
        chat([{"type": "image_url", "image_url": {"url": "data:,"}}])
    open_ended = chat("Hi", extra_body={"add_generation_prompt": False})
    assert open_ended.usage.prompt_tokens < chat("Hi").usage.prompt_tokens
    continued = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        max_tokens=6,
        temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    closed = chat("Hi", extra_body={"add_generation_prompt": False})
    assert continued.usage.prompt_tokens == closed.usage.prompt_tokens + 4, "<|assistant|> and 3 bytes, left open"


def test_echo_and_continuous_usage_stats(client):
    echoed = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    plain = client.completions.create(model="m", prompt=PROMPT, max_tokens=5, temperature=0)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    chunks = list(
        client.completions.create(
            model="m",
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            echo=True,
            stream_options={"include_usage": True},
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text
    assert all(c.usage is not None for c in chunks) and chunks[-1].usage.completion_tokens <= 5


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_harness_asks(client):
    asked = {"model": "m", "prompt": PROMPT, "echo": True, "logprobs": 1, "temperature": 0}
    only = client.completions.create(**asked, max_tokens=0)
    lp, n = only.choices[0].logprobs, only.usage.prompt_tokens
    assert only.choices[0].text == PROMPT and len(lp.tokens) == len(lp.token_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)] and "".join(lp.tokens) == PROMPT
    prompt_lps = only.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_lps) == n and prompt_lps[0] is None
    first = prompt_lps[1]  # the prompt token first, then the top 1
    ((_, entry), *_) = first.items()
    assert entry["logprob"] == lp.token_logprobs[1] and entry["decoded_token"] == lp.tokens[1] and entry["rank"] >= 1
    more = client.completions.create(**asked, max_tokens=1)  # the prompt is cached now: scored all the same
    plain = client.completions.create(model="m", prompt=PROMPT, logprobs=1, temperature=0, max_tokens=1)
    mlp = more.choices[0].logprobs
    assert more.usage.prompt_tokens_details.cached_tokens == 0
    assert mlp.token_logprobs[:n] == lp.token_logprobs and mlp.tokens[:n] == lp.tokens
    assert mlp.token_logprobs[n:] == plain.choices[0].logprobs.token_logprobs
    assert more.choices[0].text == PROMPT + plain.choices[0].text
    streamed = list(client.completions.create(**asked, max_tokens=3, stream=True))
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed for o in c.choices[0].logprobs.text_offset]
    assert tokens[: n + 1] == mlp.tokens and offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    scores = chat.model_extra["prompt_logprobs"]
    assert len(scores) == chat.usage.prompt_tokens and scores[0] is None and all(len(e) == 1 for e in scores[1:])


def test_a_model_is_retrieved_by_id_and_unknown_routes_answer_openai_errors(server, client):
    assert client.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    code, text = http(server.url, "GET", "/v1/nothing-here")
    assert code == 404 and json.loads(text)["error"]["code"] == 404


def test_tokenize_detokenize_render_version_and_server_info_answer_as_vllm_and_sglang_routers_ask(server):
    def post(path, body):
        code, text = http(server.url, "POST", path, json.dumps(body).encode())
        return code, json.loads(text)

    code, tokens = post("/tokenize", {"model": "m", "prompt": PROMPT})
    ids = load_tokenizer(server.directory).encode(PROMPT)
    assert code == 200 and tokens == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    assert post("/detokenize", {"tokens": ids}) == (200, {"prompt": PROMPT})
    code, chat = post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat["tokens"][-1] != ids[-1] and chat["count"] == len(chat["tokens"])
    code, [rendered] = post("/v1/completions/render", {"model": "m", "prompt": PROMPT, "max_tokens": 7, "seed": 1})
    assert code == 200 and rendered["token_ids"] == ids
    assert rendered["sampling_params"]["max_tokens"] == 7 and rendered["sampling_params"]["seed"] == 1
    code, chat_rendered = post("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "Hi"}]})
    assert code == 200 and chat_rendered["token_ids"] == chat["tokens"]
    assert post("/detokenize", {"tokens": [10**9]})[0] == 400
    assert json.loads(http(server.url, "GET", "/version")[1])["version"]
    for path in ("/server_info", "/get_server_info", "/get_model_info"):
        info = json.loads(http(server.url, "GET", path)[1])
        assert info["served_model_name"] == "m" and info["max_model_len"] == 512 and info["block_size"] == 16


def test_penalties_and_logit_bias_are_honoured(server, client):
    def complete(**body):
        body = {"ignore_eos": True, **body}
        return client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0, extra_body=body)

    plain = complete().choices[0].text
    assert complete(frequency_penalty=2.0).choices[0].text != plain
    assert complete(repetition_penalty=0.5).choices[0].text != plain
    tokenizer = load_tokenizer(server.directory)
    (token,) = tokenizer.encode("q")
    assert complete(logit_bias={str(token): 100}).choices[0].text == tokenizer.decode([token] * 24)


def test_a_chat_names_its_system_prompt_end_and_a_last_message_after_no_answer_as_branch_points(tmp_path):
    """Where later chats leave this one: the recurrent model checkpoints its state there."""
    from jaxkv.server.openai_api import parse

    save_tiny_tokenizer(tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    system = {"role": "system", "content": "You answer in one word."}
    document = [system, {"role": "user", "content": "A long document."}]
    turns = [*document, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and now?"}]

    def cut(messages):
        return len(tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=False)))

    def points(messages):
        return parse("chat", {"messages": messages}, tokenizer, "m").branch_points

    question = [*document, {"role": "user", "content": "Its title?"}]
    assert points(question) == (cut([system]), cut(document)), "another question on the same document"
    assert parse("chat", {"messages": question}, tokenizer, "m").prompt_token_ids[: cut(document)] == (
        tokenizer.encode(tokenizer.apply_chat_template(document, add_generation_prompt=False))
    )
    assert points(turns) == (cut([system]),), "after the model's answer its own state is there already"
    assert points(document[1:]) == (), "one message: no cut inside"
    assert parse("completion", {"prompt": "hi"}, tokenizer, "m").branch_points == ()
