"""Noticing at once that an HTTP client left, so its engine request is cancelled instead of run for nobody.

Starlette's StreamingResponse watches for a disconnect only under ASGI spec versions before 2.4; under 2.4 it
learns of it at the next failed send, which never comes while the engine is busy with a long prompt. Both helpers
here listen for `http.disconnect` themselves and cancel the work: the ensemble client's generator then cancels its
gRPC call (ensemble_client.py).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the answer was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A StreamingResponse that stops its body iterator as soon as the client disconnects, whatever the spec."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:  # the connection broke under a send
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await _wait_disconnect(receive)
            tg.cancel_scope.cancel()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientDisconnected (and `work` cancelled) if the client leaves first."""
    task: asyncio.Future[Any] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 (the client is gone: nobody reads the error)
        pass
    raise ClientDisconnected()
