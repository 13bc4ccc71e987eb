"""The OpenAI-compatible HTTP server over one engine (FastAPI + uvicorn, the ``server`` extra).

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (both streamed as server-sent events with ``stream``;
usage in the last chunk with ``stream_options.include_usage``), ``GET /metrics``
(Prometheus, vLLM's names: the engine's :mod:`jaxkv.serving.metrics` and the requests'
:mod:`jaxkv.serving.request_metrics`), ``GET /v1/models/{id}``, ``POST /tokenize`` and
``/detokenize``, vLLM's render routes and the server-info routes routers probe.

The engine steps on its own thread (:class:`~jaxkv.serving.async_engine.AsyncEngine`);
the HTTP side only queues commands and reads streams, so it never blocks a step.
Bodies are capped (``max_body_bytes``, read before parsing); unfinished requests are
capped (``max_requests``: one more gets 429); a dead engine answers 503. A client
that disconnects aborts its request, freeing its blocks before the next step. With
``api_key`` every ``/v1`` route needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import jaxkv
from jaxkv.models.text import TextTokenizer
from jaxkv.server.openai_api import (
    Answer,
    ApiError,
    ParsedRequest,
    check_model,
    detokenized,
    parse,
    rendered,
    tokenized,
)
from jaxkv.serving.async_engine import AsyncEngine, EngineDeadError, EngineFullError, RequestStream
from jaxkv.serving.engine import Engine, EngineError
from jaxkv.serving.metrics import PrometheusMetrics
from jaxkv.serving.request_metrics import RequestMetrics, RequestTimer

DISCONNECT_POLL_S = 0.1
"""How often a non-streamed request checks that its client is still there."""

BODY_TIMEOUT_S = 30.0
"""A request body that takes longer to arrive is refused (408): a slow sender holds no
reader of the server for longer."""


@dataclass(frozen=True)
class ServerConfig:
    """What the app serves and its limits."""

    model_name: str
    build_engine: Callable[[], Engine]
    """Builds the engine (on the engine's thread)."""
    tokenizer: TextTokenizer | None = None
    api_key: str | None = None
    max_requests: int = 256
    max_body_bytes: int = 1 << 20
    model_path: str | None = None
    """The checkpoint directory (what the server-info routes report)."""


def create_app(config: ServerConfig) -> FastAPI:
    """The FastAPI app serving ``config``. Its engine starts with the app, whose start-up fails
    when the engine cannot be built; or the caller starts one before binding (the CLI does):
    ``app.state.engine = AsyncEngine(app.state.build_engine, ...)``, awaited ready."""
    metrics = PrometheusMetrics(labels={"model_name": config.model_name})
    holder: dict[str, AsyncEngine] = {}
    request_metrics: list[RequestMetrics] = []  # once the engine (its max_model_len) is built

    def build() -> Engine:
        engine = config.build_engine()
        engine.add_step_observer(metrics)
        return engine

    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        if getattr(app.state, "engine", None) is None:
            app.state.engine = AsyncEngine(build, max_requests=config.max_requests)
        holder["engine"] = app.state.engine
        try:
            engine = await holder["engine"].ready()
            if not request_metrics:
                host_tier_gauges(engine, metrics)
                max_model_len = engine.manager.max_model_len
                exporter = RequestMetrics(max_model_len=max_model_len, labels=metrics.labels, registry=metrics.registry)
                request_metrics.append(exporter)
            yield
        finally:
            await holder["engine"].close()

    app = FastAPI(title="jaxkv", lifespan=lifespan)
    app.state.config = config
    app.state.build_engine = build

    def error(err: ApiError) -> Response:
        return JSONResponse(err.body(), status_code=err.status)

    def check_key(request: Request) -> None:
        if config.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {config.api_key}".encode()):
            raise ApiError(
                "a valid API key is needed (Authorization: Bearer <key>)", status=401, kind="authentication_error"
            )

    async def read_json(request: Request) -> object:
        """The body as JSON, refused once it grows past ``max_body_bytes`` (before parsing)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise ApiError(f"the body has {declared} bytes; the limit is {config.max_body_bytes}", status=413)
        body = bytearray()
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):
                async for part in request.stream():
                    body += part
                    if len(body) > config.max_body_bytes:
                        raise ApiError(f"the body exceeds {config.max_body_bytes} bytes", status=413)
        except TimeoutError:
            raise ApiError(f"the body took over {BODY_TIMEOUT_S} s to arrive", status=408) from None
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as err:  # bad JSON or UTF-8, a 5,000-digit int, deep nesting
            raise ApiError(f"the body is not JSON this server reads: {type(err).__name__}: {err}"[:300]) from None

    async def ready_engine() -> Engine:
        """The engine once built; a dead one is a 503 (never an untyped 500)."""
        try:
            return await holder["engine"].ready()
        except EngineDeadError as err:
            raise ApiError(str(err), status=503, kind="server_error") from None

    async def start(kind: str, request: Request) -> tuple[ParsedRequest, RequestStream, Engine]:
        body, engine = await checked_body(request)
        # templates and tokenizers are the checkpoint's and the client's work: off the event loop
        parsed = await asyncio.to_thread(
            parse, kind, body, config.tokenizer, config.model_name, engine.manager.max_model_len
        )
        try:
            stream = await holder["engine"].add(
                parsed.prompt_token_ids,
                parsed.params,
                cache_salt=parsed.cache_salt,
                branch_points=parsed.branch_points,
            )
        except EngineFullError as err:
            raise ApiError(str(err), status=429, kind="rate_limit_error") from None
        except EngineDeadError as err:
            raise ApiError(str(err), status=503, kind="server_error") from None
        except EngineError as err:
            raise ApiError(str(err)) from None
        return parsed, stream, engine

    async def answer(kind: str, request: Request) -> Response:
        arrival = time.monotonic()
        try:
            parsed, stream, engine = await start(kind, request)
        except ApiError as err:
            return error(err)
        result = Answer(parsed, config.tokenizer)
        max_tokens = parsed.params.max_tokens
        if max_tokens is None:  # up to the context, as vLLM's front end fills it in
            max_tokens = engine.manager.max_model_len - len(parsed.prompt_token_ids)
        timer = request_metrics[0].timer(stream, arrival, len(parsed.prompt_token_ids), max_tokens)
        if parsed.stream:
            return StreamingResponse(_events(stream, result, timer), media_type="text/event-stream")
        try:
            reader = asyncio.ensure_future(_read_all(stream, result, timer))
            while not reader.done():
                await asyncio.wait({reader}, timeout=DISCONNECT_POLL_S)
                if not reader.done() and await request.is_disconnected():
                    stream.abort()
            await reader
        except (EngineDeadError, EngineError) as err:
            return error(ApiError(str(err), status=503, kind="server_error"))
        return JSONResponse(result.whole())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer("completion", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer("chat", request)

    async def model_card(request: Request) -> dict[str, Any]:
        check_key(request)
        engine = await ready_engine()
        return {
            "id": config.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "jaxkv",
            "max_model_len": engine.manager.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            return JSONResponse({"object": "list", "data": [await model_card(request)]})
        except ApiError as err:
            return error(err)

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        try:
            card = await model_card(request)
            check_model(model_id, config.model_name)
        except ApiError as err:
            return error(err)
        return JSONResponse(card)

    async def checked_body(request: Request) -> tuple[object, Engine]:
        check_key(request)
        return await read_json(request), await ready_engine()

    async def render(kind: str, request: Request) -> Response:
        try:
            body, engine = await checked_body(request)
            args = (kind, body, config.tokenizer, config.model_name, engine.manager.max_model_len)
            generate = rendered(await asyncio.to_thread(parse, *args))
        except ApiError as err:
            return error(err)
        return JSONResponse([generate] if kind == "completion" else generate)

    @app.post("/v1/completions/render")
    async def render_completion(request: Request) -> Response:
        return await render("completion", request)

    @app.post("/v1/chat/completions/render")
    async def render_chat(request: Request) -> Response:
        return await render("chat", request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            body, engine = await checked_body(request)
            args = (body, config.tokenizer, config.model_name, engine.manager.max_model_len)
            return JSONResponse(await asyncio.to_thread(tokenized, *args))
        except ApiError as err:
            return error(err)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            body, _ = await checked_body(request)
            return JSONResponse(await asyncio.to_thread(detokenized, body, config.tokenizer, config.model_name))
        except ApiError as err:
            return error(err)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": jaxkv.__version__})

    async def server_info(request: Request) -> Response:
        """What routers probe a worker for (vLLM's ``/server_info``, SGLang's ``/get_server_info``
        and ``/get_model_info``): the model, its path, the context and the cache's block size."""
        try:
            check_key(request)
            engine = await ready_engine()
        except ApiError as err:
            return error(err)
        kv, connector = engine.manager.config, engine.connector
        persistent = None if connector is None else connector.persistent
        return JSONResponse(
            {
                "served_model_name": config.model_name,
                "model_path": config.model_path,
                "tokenizer_path": config.model_path if config.tokenizer is not None else None,
                "is_generation": True,
                "max_model_len": engine.manager.max_model_len,
                "block_size": kv.hash_block_size,
                "num_gpu_blocks": kv.num_blocks,
                "num_cpu_blocks": 0 if connector is None else connector.num_host_blocks,
                "kv_offloading_size": 0 if connector is None else connector.host_bytes,
                "kv_offloading_path": None if persistent is None else str(persistent.path),
                "kv_offloading_peers": []
                if connector is None or connector.peers is None
                else list(connector.peers.paths),
                "version": jaxkv.__version__,
            }
        )

    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.add_api_route(path, server_info, methods=["GET"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> Response:
        """Unknown routes and methods answer in OpenAI's error shape, as vLLM's do."""
        return error(ApiError(f"{request.method} {request.url.path}: {err.detail}", status=err.status_code))

    @app.get("/health")
    async def health() -> Response:
        alive = holder["engine"].is_alive
        return JSONResponse({"status": "ok" if alive else "unavailable"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    return app


def host_tier_gauges(engine: Engine, metrics: PrometheusMetrics) -> None:
    """``jaxkv:kv_offload_blocks{kind="capacity"|"held"}``: the host tier's blocks, read at each scrape."""
    connector = engine.connector
    if connector is None:
        return
    gauge = Gauge(
        "jaxkv:kv_offload_blocks",
        "Host-tier KV blocks: in all (capacity), holding a block now (held)",
        [*metrics.labels, "kind"],
        registry=metrics.registry,
    )
    gauge.labels(**metrics.labels, kind="capacity").set(connector.num_host_blocks)
    gauge.labels(**metrics.labels, kind="held").set_function(lambda: connector.num_held_host_blocks)


async def _read_all(stream: RequestStream, result: Answer, timer: RequestTimer) -> None:
    async for delta in stream:
        timer.observe(delta)
        result.add(delta)


async def _events(stream: RequestStream, result: Answer, timer: RequestTimer) -> AsyncIterator[str]:
    """Server-sent events of a streamed answer; leaving early (a disconnect) aborts the request."""
    try:
        for opening in result.opening_chunks():
            yield f"data: {json.dumps(opening)}\n\n"
        async for delta in stream:
            timer.observe(delta)
            result.add(delta)
            if delta.token_ids or delta.text or delta.finished:
                yield f"data: {json.dumps(result.chunk(delta))}\n\n"
        if result.request.include_usage:
            yield f"data: {json.dumps(result.usage_chunk())}\n\n"
        yield "data: [DONE]\n\n"
    except (EngineDeadError, EngineError) as err:
        yield f"data: {json.dumps(ApiError(str(err), status=503, kind='server_error').body())}\n\n"
    finally:
        stream.abort()
