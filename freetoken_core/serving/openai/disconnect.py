"""Noticing at once that an HTTP client left, so its engine request is cancelled instead of run for nobody.

A server learns of a gone client at the next failed send, which never comes while the engine is busy with a long
prompt. The watch here listens for `http.disconnect` itself and cancels the work: the ensemble client's generator
then cancels its gRPC call (ensemble_client.py).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import AsyncIterator

from starlette.types import Receive


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
