"""The POST endpoints (chat and completions) as plain ASGI: their time before the first token is every client's
time to first token, and FastAPI's routing, dependency solving and middleware stack are a large share of it
(benchmarks/RESULTS.md, OpenAI API). The body is validated by pydantic straight from its JSON bytes, and one
disconnect watcher covers the request from its body to the answer's last byte."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, AsyncGenerator, Awaitable, Callable, Union

from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from freetoken_core.serving.openai.disconnect import ClientDisconnected, cancelled_on_disconnect
from freetoken_core.serving.openai.generation import compact_json
from freetoken_core.serving.openai.protocol import APIError

log = logging.getLogger(__name__)

# a whole JSON answer, or the SSE events of a streamed one (the first response already in: refusals are raised
# before, as APIError, while the status can still say so)
Answer = Union[dict[str, Any], AsyncGenerator[str, None]]

# far above any prompt the engine's context holds (32k tokens of text, tools and history are well under 1 MiB); a
# body past it is refused before it is read, so no client can make a worker hold gigabytes
MAX_BODY_BYTES = 32 * 2**20
_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


@dataclass(frozen=True)
class PostEndpoint:
    request_type: type[BaseModel]
    handle: Callable[[Any], Awaitable[Answer]]


async def send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = compact_json(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [*_JSON_HEADERS, (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


def validation_error(errors: list[Any]) -> APIError:
    """pydantic's first complaint as an OpenAI 400 whose message and `param` name the field."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    if err.get("type") == "extra_forbidden":
        msg = f"{param}: unknown or unsupported field"
    else:
        msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    return APIError(400, msg, param=param)


class BodyTooLarge(Exception):
    """The request declared or sent more than MAX_BODY_BYTES."""


async def _read_body(scope: Scope, receive: Receive) -> bytes | None:
    """The request body, or None when the client left before sending all of it; BodyTooLarge past the limit."""
    declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"0")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge()
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise BodyTooLarge()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def serve_post(endpoint: PostEndpoint, scope: Scope, receive: Receive, send: Send) -> None:
    try:
        body = await _read_body(scope, receive)
    except BodyTooLarge:
        await send_json(send, 413, APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes").body())
        return
    if body is None:
        return
    try:
        request = endpoint.request_type.model_validate_json(body)
    except ValidationError as e:
        await send_json(send, 400, validation_error(e.errors()).body())
        return
    started = False
    try:
        async with cancelled_on_disconnect(receive):
            answer = await endpoint.handle(request)
            if isinstance(answer, dict):
                await send_json(send, 200, answer)
                return
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            started = True
            try:
                async for events in answer:
                    await send({"type": "http.response.body", "body": events.encode(), "more_body": True})
            finally:  # a client gone during a send: the stream's gRPC call is cancelled now, not when collected
                await answer.aclose()
            await send({"type": "http.response.body", "body": b""})
    except (ClientDisconnected, OSError):  # the client left, or the connection broke under a send
        pass
    except APIError as e:
        if not started:
            await send_json(send, e.status, e.body())
    except Exception:  # noqa: BLE001 (one request's failure is its own 500, never the server's)
        log.exception("%s failed", scope.get("path"))
        if not started:
            await send_json(send, 500, APIError(500, "internal error answering the request").body())
