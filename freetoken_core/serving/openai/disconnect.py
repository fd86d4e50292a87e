"""Noticing at once that an HTTP client left, so its engine request is cancelled instead of run for nobody.

Starlette's StreamingResponse watches for a disconnect only under ASGI spec versions before 2.4; under 2.4 it
learns of it at the next failed send, which never comes while the engine is busy with a long prompt. The helpers
here listen for `http.disconnect` themselves and cancel the work: the ensemble client's generator then cancels its
gRPC call (ensemble_client.py).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before the answer was complete."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


@asynccontextmanager
async def cancelled_on_disconnect(receive: Receive) -> AsyncIterator[None]:
    """Runs the block in this task while a watcher task cancels it if the client disconnects; the block then ends
    with ClientDisconnected. The work stays in the caller's task: no task hop before the first response or the
    first streamed byte."""
    task = asyncio.current_task()
    assert task is not None
    left = False

    async def watch() -> None:
        nonlocal left
        await _wait_disconnect(receive)
        left = True
        task.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not left:  # cancelled from outside (the server shutting down): not ours to swallow
            raise
        uncancel = getattr(task, "uncancel", None)  # Python >= 3.11 counts cancellations
        if uncancel is not None:
            uncancel()
        raise ClientDisconnected() from None
    finally:
        watcher.cancel()


class DisconnectAwareStreamingResponse(StreamingResponse):
    """A StreamingResponse that stops its body iterator as soon as the client disconnects, whatever the spec."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with cancelled_on_disconnect(receive):
                await self.stream_response(send)
        except (ClientDisconnected, OSError):  # the client left, or the connection broke under a send
            pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, or ClientDisconnected (and `work` cancelled) if the client leaves first."""
    async with cancelled_on_disconnect(request.receive):
        return await work
