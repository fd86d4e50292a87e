"""The frontend's gRPC streams to the ensemble (serving/openai/ensemble_client.py) against the real tritonserver: a
finished request's stream carries the next one; a request abandoned mid-answer cancels its stream's call (the engine
aborts it) and that stream is never reused; a refused request's stream is dropped too."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import pytest

from serving_helpers import metric, scrape_metrics, wait_for

pytestmark = pytest.mark.serving
pytest.importorskip("tritonclient.grpc.aio")

from freetoken_core.serving.openai.ensemble_client import EngineError, EnsembleClient, EnsembleRequest  # noqa: E402


def _with_client(triton_server, body: Callable[[EnsembleClient], Awaitable[None]]) -> None:
    """Runs body with a client of the server on a fresh event loop (the client's gRPC channel belongs to it)."""
    async def run() -> None:
        client = EnsembleClient(triton_server.grpc_url)
        try:
            await body(client)
        finally:
            await client.close()

    asyncio.run(run())


def _counts(triton_server) -> tuple[float, float]:
    m = scrape_metrics(triton_server.metrics_url)
    return (metric(m, "freetoken_request_finished_total", finish_reason="abort"),
            metric(m, "freetoken_num_requests_running"))


async def _text(client: EnsembleClient, prompt: str, max_tokens: int = 8) -> str:
    steps = [s async for s in client.generate(EnsembleRequest(text_input=prompt, max_tokens=max_tokens,
                                                              temperature=0.0))]
    assert steps[-1].finish_reason
    return "".join(s.text for s in steps)


def test_a_finished_request_s_stream_carries_the_next(triton_server):
    async def body(client: EnsembleClient) -> None:
        first = await _text(client, "The capital of France is")
        assert len(client._idle) == 1
        stream = client._idle[0]
        again = await _text(client, "The capital of France is")
        assert client._idle == [stream]  # the same stream, back in the pool
        assert again == first
        # concurrent requests each take a stream of their own, and all of them come back
        texts = await asyncio.gather(*(_text(client, f"Count to {n}:") for n in range(4)))
        assert len(client._idle) == 4 and all(texts)

    _with_client(triton_server, body)


def test_an_abandoned_request_is_aborted_and_its_stream_dropped(triton_server):
    async def body(client: EnsembleClient) -> None:
        await _text(client, "warm up")
        pooled = client._idle[0]
        assert wait_for(lambda: _counts(triton_server)[1] == 0, 30)
        aborted0, _ = _counts(triton_server)
        steps = client.generate(EnsembleRequest(text_input="Tell a long story.", max_tokens=500, ignore_eos=True))
        await steps.__anext__()  # it runs on the pooled stream
        assert client._idle == []
        await steps.aclose()  # the consumer leaves
        assert client._idle == []  # a cancelled call never carries another request
        assert await asyncio.to_thread(wait_for, lambda: _counts(triton_server) == (aborted0 + 1, 0), 20)
        assert await _text(client, "The capital of France is")  # on a new stream
        assert len(client._idle) == 1 and client._idle[0] is not pooled

    _with_client(triton_server, body)


def test_a_refused_request_s_stream_is_dropped(triton_server):
    async def body(client: EnsembleClient) -> None:
        await _text(client, "warm up")
        with pytest.raises(EngineError, match="max_tokens"):
            await _text(client, "hello", max_tokens=-1)
        assert client._idle == []
        assert await _text(client, "The capital of France is")

    _with_client(triton_server, body)
