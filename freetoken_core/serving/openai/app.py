"""The ASGI app: the API-key check, the POST endpoints as plain ASGI (post_endpoint.py), and FastAPI for the rest
(health, metrics, models, lifespan)."""

from __future__ import annotations

import asyncio
import hmac
import urllib.error
import urllib.request
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from freetoken_core.serving.openai import chat_completions, completions
from freetoken_core.serving.openai.ensemble_client import EngineError, EnsembleClient
from freetoken_core.serving.openai.generation import engine_error, start
from freetoken_core.serving.openai.post_endpoint import Answer, PostEndpoint, send_json, serve_post
from freetoken_core.serving.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, now
from freetoken_core.serving.openai.served_model import ServedModel
from freetoken_core.serving.openai.translate import chat_request, completion_request

OPEN_PATHS = ("/health",)  # reachable without the API key (load balancers' probes)


def _fetch_metrics(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except (urllib.error.URLError, ConnectionError, OSError) as e:
        return 503, f"Triton's metrics at {url} did not answer: {e}\n".encode()


class OpenAIApp:
    """Routes each HTTP request: the key check first (when a key is set), then a POST endpoint, else FastAPI (which
    also runs the lifespan)."""

    def __init__(self, rest: ASGIApp, posts: dict[str, PostEndpoint], api_key: str | None) -> None:
        self._rest, self._posts = rest, posts
        self._expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._rest(scope, receive, send)
            return
        path = scope["path"]
        if self._expected is not None and path not in OPEN_PATHS and not self._key_given(scope):
            await send_json(send, 401, APIError(401, "missing or wrong API key (Authorization: Bearer <key>)",
                                                code="invalid_api_key").body())
            return
        endpoint = self._posts.get(path)
        if endpoint is None:
            await self._rest(scope, receive, send)
        elif scope["method"] != "POST":
            await send_json(send, 405, APIError(405, f"{path} takes POST, not {scope['method']}").body())
        else:
            await serve_post(endpoint, scope, receive, send)

    def _key_given(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        return hmac.compare_digest(given, self._expected)


def create_app(grpc_url: str, model: ServedModel, api_key: str | None = None,
               metrics_url: str | None = None) -> OpenAIApp:
    client: EnsembleClient  # made on the server's event loop, which its gRPC channel belongs to

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        nonlocal client
        client = EnsembleClient(grpc_url)
        yield
        await client.close()

    rest = FastAPI(title="freetoken OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

    @rest.get("/health")
    async def health() -> Response:
        ready = await client.ready()
        return Response(status_code=200 if ready else 503)

    if metrics_url:
        @rest.get("/metrics")
        async def metrics() -> Response:
            """Triton's Prometheus metrics (the engine's freetoken_* series), passed through: with an API key
            Triton's own ports listen on 127.0.0.1 only."""
            status, body = await asyncio.to_thread(_fetch_metrics, metrics_url)
            return Response(body, status_code=status, media_type="text/plain; version=0.0.4")

    @rest.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": now(),
                                            "owned_by": "freetoken"}]}

    async def aggregated(whole: Any) -> dict[str, Any]:
        try:
            return await whole
        except EngineError as e:  # failed after it started (an engine fault): not the request's fault
            raise await engine_error(client, e, status=500) from None

    async def chat(body: ChatCompletionRequest) -> Answer:
        first, rest_steps = await start(client, chat_request(body, model))
        if body.stream:
            return chat_completions.chat_completion_stream(body, model, first, rest_steps)
        return await aggregated(chat_completions.chat_completion(body, model, first, rest_steps))

    async def complete(body: CompletionRequest) -> Answer:
        first, rest_steps = await start(client, completion_request(body, model))
        if body.stream:
            return completions.completion_stream(body, model, first, rest_steps)
        return await aggregated(completions.completion(body, model, first, rest_steps))

    return OpenAIApp(rest, {"/v1/chat/completions": PostEndpoint(ChatCompletionRequest, chat),
                            "/v1/completions": PostEndpoint(CompletionRequest, complete)}, api_key)
