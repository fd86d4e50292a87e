"""The ASGI app: routes, API-key check, OpenAI-shaped errors, and the disconnect handling of every answer."""

from __future__ import annotations

import asyncio
import hmac
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from freetoken_core.serving.openai import chat_completions, completions
from freetoken_core.serving.openai.disconnect import (ClientDisconnected, DisconnectAwareStreamingResponse,
                                                      until_disconnect)
from freetoken_core.serving.openai.ensemble_client import EngineError, EnsembleClient, EnsembleStep
from freetoken_core.serving.openai.generation import engine_error, start
from freetoken_core.serving.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, now
from freetoken_core.serving.openai.served_model import ServedModel
from freetoken_core.serving.openai.translate import chat_request, completion_request

# The status a client that left is logged with (nginx's "client closed request"); nobody receives it.
CLIENT_CLOSED_STATUS = 499
OPEN_PATHS = ("/health",)  # reachable without the API key (load balancers' probes)


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """pydantic's first complaint as an OpenAI 400 whose message and `param` name the field."""
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        msg = f"{param}: unknown or unsupported field"
    else:
        msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    return _error(APIError(400, msg, param=param))


def _fetch_metrics(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        return 503, f"Triton's metrics at {url} did not answer: {e}\n".encode()


def create_app(grpc_url: str, model: ServedModel, api_key: str | None = None,
               metrics_url: str | None = None) -> FastAPI:
    client: EnsembleClient  # made on the server's event loop, which its gRPC channel belongs to

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal client
        client = EnsembleClient(grpc_url)
        yield
        await client.close()

    app = FastAPI(title="freetoken OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    # async handlers: Starlette runs a plain function's in its thread pool, a hop for every error answer

    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e)

    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return _validation_error(e)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def check_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
            if request.url.path not in OPEN_PATHS:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return _error(APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                           code="invalid_api_key"))
            return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        ready = await client.ready()
        return Response(status_code=200 if ready else 503)

    if metrics_url:
        @app.get("/metrics")
        async def metrics() -> Response:
            """Triton's Prometheus metrics (the engine's freetoken_* series), passed through: with an API key
            Triton's own ports listen on 127.0.0.1 only."""
            status, body = await asyncio.to_thread(_fetch_metrics, metrics_url)
            return Response(body, status_code=status, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": now(),
                                            "owned_by": "freetoken"}]}

    async def answer(request: Request, stream: bool, first_and_rest: Callable[[], Awaitable[Any]],
                     aggregate: Callable[[EnsembleStep, Any], Awaitable[dict[str, Any]]],
                     events: Callable[[EnsembleStep, Any], AsyncIterator[str]]) -> Response:
        try:
            if stream:
                first, rest = await until_disconnect(request, first_and_rest())
                return DisconnectAwareStreamingResponse(events(first, rest), media_type="text/event-stream",
                                                        headers={"Cache-Control": "no-cache"})

            async def whole() -> dict[str, Any]:
                first, rest = await first_and_rest()
                try:
                    return await aggregate(first, rest)
                except EngineError as e:  # failed after it started (an engine fault): not the request's fault
                    raise await engine_error(client, e, status=500) from None

            return JSONResponse(await until_disconnect(request, whole()))
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_STATUS)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        ens = chat_request(body, model)
        return await answer(
            request, body.stream, lambda: start(client, ens),
            lambda first, rest: chat_completions.chat_completion(body, model, first, rest),
            lambda first, rest: chat_completions.chat_completion_stream(body, model, first, rest))

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, request: Request) -> Response:
        ens = completion_request(body, model)
        return await answer(
            request, body.stream, lambda: start(client, ens),
            lambda first, rest: completions.completion(body, model, first, rest),
            lambda first, rest: completions.completion_stream(body, model, first, rest))

    return app
