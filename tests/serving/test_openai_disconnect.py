"""The frontend's disconnect watch (serving/openai/disconnect.py) on a plain event loop: the work runs in the caller's
task, a disconnect cancels it and reads as ClientDisconnected, and a cancellation from outside stays one."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("starlette")

from freetoken_core.serving.openai.disconnect import ClientDisconnected, cancelled_on_disconnect  # noqa: E402


class _Receive:
    """An ASGI receive whose http.disconnect comes when `leave` is set."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()

    async def __call__(self) -> dict:
        await self.leave.wait()
        return {"type": "http.disconnect"}


def test_the_work_s_result_and_the_caller_s_task():
    async def run():
        receive = _Receive()
        caller = asyncio.current_task()
        async with cancelled_on_disconnect(receive):
            await asyncio.sleep(0.01)
            assert asyncio.current_task() is caller
            result = 42
        await asyncio.sleep(0.01)  # the watcher is gone: a late disconnect cancels nothing
        receive.leave.set()
        await asyncio.sleep(0.01)
        return result

    assert asyncio.run(run()) == 42


def test_a_disconnect_cancels_the_work():
    async def run():
        receive, cleaned = _Receive(), []

        async def work():
            try:
                await asyncio.sleep(30)
            finally:
                cleaned.append(True)  # the engine request's gRPC call is cancelled here

        asyncio.get_running_loop().call_later(0.02, receive.leave.set)
        with pytest.raises(ClientDisconnected):
            async with cancelled_on_disconnect(receive):
                await work()
        assert cleaned == [True]
        task = asyncio.current_task()
        assert getattr(task, "cancelling", lambda: 0)() == 0  # nothing left pending on the caller's task
        await asyncio.sleep(0)  # and it runs on

    asyncio.run(asyncio.wait_for(run(), 5))


def test_a_cancellation_from_outside_stays_a_cancellation():
    async def run():
        receive = _Receive()

        async def guarded():
            async with cancelled_on_disconnect(receive):
                await asyncio.sleep(30)

        task = asyncio.ensure_future(guarded())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
