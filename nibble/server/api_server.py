"""The FastAPI application of `nibble serve`: routes, authentication, error handlers, lifespan.

`build_app(engine)` wires an already-built `AsyncEngine` into an app; `nibble.server.launch` builds the
engine from the command line and runs the app under uvicorn. Every error leaves as an OpenAI-style body
(`{"error": {"message", "type", "param", "code"}}`) with a 4xx/5xx status, never as a traceback; those of
Anthropic's /v1/messages routes in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nibble import __version__
from nibble.engine.async_engine import AsyncEngine, EngineDead
from nibble.server.errors import APIError
from nibble.server.messages_protocol import AnthropicError
from nibble.server.metrics import ServerMetrics
from nibble.server.protocol import ModelCard, ModelList, no_reserved_template_kwargs
from nibble.server.request_body import read_json_body
from nibble.server.request_ids import RequestIdHeader
from nibble.server.response_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore
from nibble.server.serving_base import engine_core, json_response
from nibble.server.serving_chat import ChatServing
from nibble.server.serving_completions import CompletionServing
from nibble.server.serving_messages import MessagesServing
from nibble.server.serving_responses import ResponsesServing
from nibble.server.serving_tokenize import TokenizeServing
from nibble.server.stat_logger import StatLogger
from nibble.server.unhandled import UnhandledErrors

logger = logging.getLogger("nibble.server")


def _accepted_model_names(engine: AsyncEngine, served: str, aliases: tuple[str, ...] = ()) -> set[str]:
    core = engine_core(engine)
    names = {served, *aliases, core.config.model, str(core.model_dir)}
    if core.config.served_model_name:
        names.add(core.config.served_model_name)
    return names


def _auth_dependency(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    return check


def _messages_auth_dependency(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """The API key check of /v1/messages*: Anthropic clients send `x-api-key: <key>` (Claude Code with
    ANTHROPIC_AUTH_TOKEN sends `Authorization: Bearer <key>`); either one will do. Errors in Anthropic's shape."""
    expected = api_key.encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = [request.headers.get("x-api-key", "").strip()]
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer":
            given.append(token.strip())
        if not any(key and secrets.compare_digest(key.encode(), expected) for key in given):
            raise AnthropicError(401, "missing or invalid API key: send 'x-api-key: <key>' or "
                                      "'Authorization: Bearer <key>'", code="invalid_api_key")

    return check


def build_app(engine: AsyncEngine, api_key: str | None = None, served_model_name: str | None = None,
              owns_engine: bool = False, cors: dict[str, Any] | None = None,
              max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
              default_chat_template_kwargs: dict[str, Any] | None = None,
              served_model_aliases: tuple[str, ...] = (), force_include_usage: bool = False,
              log_stats_interval_s: float | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`.

    `api_key`: when set, /v1/*, /tokenize and /detokenize require `Authorization: Bearer <api_key>` (health,
    metrics and version stay open); /v1/messages* also take Anthropic's `x-api-key: <api_key>`.
    `served_model_name`: the name clients use (default: the engine's).
    `owns_engine`: shut the engine down when the app stops. `cors`: CORSMiddleware settings (allow_origins,
    allow_methods, allow_headers, allow_credentials), so that browser pages on other origins can call the API;
    None adds no CORS headers. `max_stored_responses`: finished /v1/responses responses kept in memory for
    previous_response_id and GET /v1/responses/{id} (0 keeps none). `default_chat_template_kwargs`: chat
    template kwargs of every chat request (chat completions, responses, messages, /tokenize) that does not set
    them itself (vLLM's --default-chat-template-kwargs); a key with a request field of its own is a ValueError.
    `served_model_aliases`: more names requests may use (vLLM's --served-model-name A B ...: all are listed in
    /v1/models, responses carry the first). `force_include_usage`: streamed completions and chat completions
    end with a usage chunk even when they do not ask for one (vLLM's --enable-force-include-usage).
    `log_stats_interval_s`: log the engine's throughput, queues and cache figures this often while it works
    (stat_logger.py; `nibble serve` sets it unless --disable-log-stats); None logs none.
    """
    core = engine_core(engine)
    served = served_model_name or core.model_name
    metrics = ServerMetrics(engine, served)
    accepted = _accepted_model_names(engine, served, served_model_aliases)
    listed = [served, *(a for a in dict.fromkeys(served_model_aliases) if a != served)]
    template = {"default_template_kwargs": no_reserved_template_kwargs(default_chat_template_kwargs),
                "force_include_usage": force_include_usage}
    completions = CompletionServing(engine, served, accepted, metrics, force_include_usage=force_include_usage)
    chat = ChatServing(engine, served, accepted, metrics, **template)
    tokens = TokenizeServing(engine, served, accepted, metrics, **template)
    responses = ResponsesServing(engine, served, accepted, metrics, store=ResponseStore(max_stored_responses),
                                 **template)
    messages = MessagesServing(engine, served, accepted, metrics, **template)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info("serving '%s' (max_model_len %d)%s", served, core.max_model_len,
                    " with API key" if api_key else "")
        stat_task = (asyncio.create_task(StatLogger(engine.stats).run(log_stats_interval_s))
                     if log_stats_interval_s else None)
        yield
        if stat_task is not None:
            stat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stat_task
        if owns_engine:
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="nibble", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine = engine
    app.state.metrics = metrics
    def unexpected(scope: Any, exc: Exception) -> JSONResponse:
        path = scope.get("path", "")
        logger.error("unhandled error on %s %s", scope.get("method", ""), path, exc_info=exc)
        error = AnthropicError if path.startswith("/v1/messages") else APIError
        return error_json(error(500, f"internal server error: {type(exc).__name__}: {exc}"))

    # innermost of the three, so that X-Request-Id and CORS headers reach its 500s too
    app.add_middleware(UnhandledErrors, respond=unexpected)
    app.add_middleware(RequestIdHeader)
    if cors is not None:
        # added last, so outermost: CORS headers go on every response, and X-Request-Id is exposed to pages
        app.add_middleware(CORSMiddleware, **{"expose_headers": ["X-Request-Id"], **cors})
    auth = [Depends(_auth_dependency(api_key))]
    messages_auth = [Depends(_messages_auth_dependency(api_key))]

    def error_class(request: Request) -> type[APIError]:
        # Anthropic's clients read Anthropic's error shape; every other route answers with OpenAI's.
        return AnthropicError if request.url.path.startswith("/v1/messages") else APIError

    def error_json(err: APIError) -> JSONResponse:
        metrics.observe_error(err.status)
        return err.response()

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        logger.info("%s %s: HTTP %d (%s)", request.method, request.url.path, exc.status, exc.message)
        return error_json(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}"
        return error_json(error_class(request)(exc.status_code, detail))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own parameters (query and path); request bodies are read and checked by the handlers
        messages, param = [], None
        for err in exc.errors():
            name = ".".join(str(p) for p in err.get("loc", ())[1:])
            param = param or name or None
            given = err.get("input")
            got = f" (got {given!r})" if isinstance(given, (str, int, float)) and len(repr(given)) <= 40 else ""
            messages.append(f"{name}: {err.get('msg', 'invalid value')}{got}" if name else str(err.get("msg")))
        return error_json(error_class(request)(400, "; ".join(messages) or "invalid request", param=param))


    @app.get("/health")
    async def health() -> Response:
        if completions.engine_alive():
            return Response(status_code=200)
        reason = engine.dead_reason or "the engine thread stopped"
        return error_json(APIError(503, f"the engine is not running: {reason}", code="engine_dead"))

    # SageMaker's health route, which vLLM serves too
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def model_card(name: str) -> ModelCard:
        return ModelCard(id=name, root=str(core.model_dir), max_model_len=core.max_model_len)

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> Response:
        return json_response(ModelList(data=[model_card(name) for name in listed]))

    @app.get("/v1/models/{model:path}", dependencies=auth)
    async def get_model(model: str) -> Response:
        completions.check_model(model)
        return json_response(model_card(model if model in listed else served))

    @app.post("/v1/completions", dependencies=auth)
    async def create_completion(request: Request) -> Response:
        return await completions.create(await read_json_body(request), request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(await read_json_body(request), request)

    @app.post("/v1/responses", dependencies=auth)
    async def create_response(request: Request) -> Response:
        return await responses.create(await read_json_body(request), request)

    @app.get("/v1/responses/{response_id}", dependencies=auth)
    async def get_response(response_id: str) -> Response:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", dependencies=auth)
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @app.get("/v1/responses/{response_id}/input_items", dependencies=auth)
    async def list_input_items(response_id: str, limit: int = 20, order: str = "desc",
                               after: str | None = None) -> Response:
        return responses.input_items(response_id, limit, order, after)

    @app.post("/v1/messages", dependencies=messages_auth)
    async def create_message(request: Request) -> Response:
        return await messages.create(await messages.read_body(request), request)

    @app.post("/v1/messages/count_tokens", dependencies=messages_auth)
    async def count_message_tokens(request: Request) -> Response:
        return await messages.count_tokens(await messages.read_body(request), request)

    @app.post("/reset_prefix_cache", dependencies=auth)
    async def reset_prefix_cache() -> Response:
        # vLLM's route (for benchmarks that want cold prompts): 409 while requests run, rather than a silent no-op
        try:
            reset = await engine.reset_prefix_cache()
        except EngineDead as exc:
            return error_json(APIError(503, f"the engine is not running: {exc}", code="engine_dead"))
        if not reset:
            return error_json(APIError(409, "the prefix cache is reset only when no request is running or waiting; "
                                            "retry when the server is idle", code="engine_busy"))
        return JSONResponse({"reset": True})

    @app.post("/tokenize", dependencies=auth)
    async def tokenize(request: Request) -> Response:
        return await tokens.tokenize(await read_json_body(request))

    @app.post("/detokenize", dependencies=auth)
    async def detokenize(request: Request) -> Response:
        return await tokens.detokenize(await read_json_body(request))

    return app
