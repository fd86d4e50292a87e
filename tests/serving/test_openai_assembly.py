"""Chat answers assembled from recorded ensemble responses of a Qwen3-format model (reasoning + a tool call): the
streamed chunks add up to the non-streamed message, and both validate as the official client's types."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

openai_types = pytest.importorskip("openai.types.chat")
pytest.importorskip("fastapi")

from freetoken_core.serving.openai.chat_completions import chat_completion, chat_completion_stream  # noqa: E402
from freetoken_core.serving.openai.ensemble_client import EnsembleStep  # noqa: E402
from freetoken_core.serving.openai.protocol import ChatCompletionRequest  # noqa: E402
from freetoken_core.serving.openai.served_model import ServedModel  # noqa: E402

RECORDED = ('<think>\nThe user wants the weather.\n</think>\n\nLet me look.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def qwen_like(smollm2_path) -> ServedModel:
    """SmolLM2's tokenizer (only logprob token texts use it) with a Qwen3 template's parsers."""
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    return ServedModel(name="qwen-like", tokenizer=load_tokenizer(smollm2_path), context_limit=1024,
                       max_tokens_limit=None, tool_format="hermes", starts_in_reasoning=False)


def _steps(text: str, size: int, reason: str = "stop", cached: int | None = 16) -> list[EnsembleStep]:
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    return [EnsembleStep(text=p, token_ids=(1,), logprobs=(), num_input_tokens=20, num_output_tokens=i + 1,
                         num_cached_tokens=cached, finish_reason=reason if i == len(pieces) - 1 else "")
            for i, p in enumerate(pieces)]


async def _aiter(steps):
    for s in steps:
        yield s


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="qwen-like", messages=[{"role": "user", "content": "weather?"}], **kw)


def _whole(model, req, steps) -> dict:
    return asyncio.run(chat_completion(req, model, steps[0], _aiter(steps[1:])))


def _streamed(model, req, steps) -> list[str]:
    """The SSE events of a streamed answer (one write may carry several: the role chunk rides with the first delta)."""
    async def run():
        return "".join([e async for e in chat_completion_stream(req, model, steps[0], _aiter(steps[1:]))])

    return [event + "\n\n" for event in asyncio.run(run()).split("\n\n") if event]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_reasoning_and_tool_call_streamed_equals_whole(qwen_like, size):
    steps = _steps(RECORDED, size)
    req = _request(stream=True, stream_options={"include_usage": True})
    body = _whole(qwen_like, _request(), steps)
    openai_types.ChatCompletion.model_validate(body)
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == "\nThe user wants the weather.\n"
    assert msg["content"] == "Let me look.\n"
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": len(steps), "total_tokens": 20 + len(steps),
                             "prompt_tokens_details": {"cached_tokens": 16}}

    events = _streamed(qwen_like, req, steps)
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    for c in chunks:
        openai_types.ChatCompletionChunk.model_validate(c)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    # the call streams: its first entry has the id and the name, the rest add to its arguments
    assert {c["index"] for c in calls} == {0} and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather" and all("id" not in c for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == msg["tool_calls"][0]["function"]["arguments"]
    if size == 1:  # one token a response: the arguments come in many pieces
        assert len(calls) > 5
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


def test_completion_usage_carries_cached_tokens_streamed_and_whole(qwen_like):
    """usage.prompt_tokens_details.cached_tokens as OpenAI shapes it, in the whole answer and in the streamed usage
    chunk; a server that sent no num_cached_tokens reads as 0 cached."""
    completions = pytest.importorskip("openai.types")
    from freetoken_core.serving.openai.completions import completion, completion_stream
    from freetoken_core.serving.openai.protocol import CompletionRequest

    for cached in (48, None):
        steps = _steps("Paris is the capital.", 4, reason="length", cached=cached)
        fields = {"model": "qwen-like", "prompt": "The capital of France is", "max_tokens": len(steps)}
        req = CompletionRequest(**fields)
        body = asyncio.run(completion(req, qwen_like, steps[0], _aiter(steps[1:])))
        usage = completions.Completion.model_validate(body).usage
        assert usage.prompt_tokens_details.cached_tokens == (cached or 0) and usage.prompt_tokens == 20

        async def stream():
            streamed = CompletionRequest(**fields, stream=True, stream_options={"include_usage": True})
            return [e async for e in completion_stream(streamed, qwen_like, steps[0], _aiter(steps[1:]))]

        events = [e for e in "".join(asyncio.run(stream())).split("\n\n") if e]  # a send may carry several
        last = json.loads(events[-2][len("data: "):])
        assert last["choices"] == [] and last["usage"] == body["usage"]


def test_tool_choice_none_keeps_the_block_as_text(qwen_like):
    body = _whole(qwen_like, _request(tool_choice="none"), _steps(RECORDED, 5))
    msg = body["choices"][0]["message"]
    assert "tool_calls" not in msg and msg["content"].endswith("</tool_call>")
    assert body["choices"][0]["finish_reason"] == "stop"


def test_prefilled_think_and_length(qwen_like):
    model = dataclasses.replace(qwen_like, starts_in_reasoning=True)
    body = _whole(model, _request(), _steps("still thinking about it", 4, reason="length"))
    msg = body["choices"][0]
    assert msg["message"]["reasoning_content"] == "still thinking about it" and msg["message"]["content"] == ""
    assert msg["finish_reason"] == "length"


def test_a_full_engine_queue_is_429():
    """The engine's refusal at max_queued_requests becomes OpenAI's rate-limit error (no readiness probe needed)."""
    from freetoken_core.serving.engine_proc.engine_loop import queue_full_message
    from freetoken_core.serving.openai.ensemble_client import EngineError
    from freetoken_core.serving.openai.generation import engine_error

    err = asyncio.run(engine_error(None, EngineError(f"in ensemble 'ensemble', {queue_full_message(8)}")))
    assert err.status == 429 and err.body()["error"]["type"] == "rate_limit_error"
    assert err.message.startswith("the server is busy") and "max_queued_requests=8" in err.message
