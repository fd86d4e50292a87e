"""POST /v1/chat/completions: one ensemble stream -> a chat.completion, or chat.completion.chunk events."""

from __future__ import annotations

from typing import Any, AsyncIterator

from freetoken_core.serving.openai.ensemble_client import EngineError, EnsembleStep
from freetoken_core.serving.openai.generation import (SSE_DONE, Tally, all_steps, sse, token_logprobs,
                                                     top_token_logprobs)
from freetoken_core.serving.openai.output_pipe import OutputDelta, OutputPipe
from freetoken_core.serving.openai.protocol import (ChatCompletionRequest, new_id, now, tool_call_delta_dicts,
                                                   tool_call_dicts)
from freetoken_core.serving.openai.served_model import ServedModel
from freetoken_core.serving.openai.tool_parsers import assemble_calls, param_types_of


def _pipe(req: ChatCompletionRequest, model: ServedModel) -> OutputPipe:
    return OutputPipe.for_model(model.tool_format, model.starts_in_reasoning, tools_on=req.tool_choice != "none",
                                param_types=param_types_of(req.tools))


def _logprob_entries(model: ServedModel, step: EnsembleStep) -> list[dict[str, Any]]:
    def entry(text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return [{**entry(text, lp), "top_logprobs": [entry(t, v) for t, v in top]}
            for (text, lp), top in zip(token_logprobs(model.tokenizer, step), top_token_logprobs(model.tokenizer, step))]


async def chat_completion(req: ChatCompletionRequest, model: ServedModel, first: EnsembleStep,
                          rest: AsyncIterator[EnsembleStep]) -> dict[str, Any]:
    """The non-streaming answer: the whole stream aggregated."""
    pipe, tally = _pipe(req, model), Tally()
    deltas, logprobs = [], []
    async for step in all_steps(first, rest):
        tally.add(step)
        deltas.append(pipe.feed(step.text))
        if req.logprobs:
            logprobs.extend(_logprob_entries(model, step))
    deltas.append(pipe.finish())
    content = [d.content for d in deltas]
    reasoning = [d.reasoning for d in deltas]
    calls = assemble_calls([c for d in deltas for c in d.calls])
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content) or (None if calls else ""),
                               "refusal": None}
    if pipe.has_reasoning:
        message["reasoning_content"] = "".join(reasoning) or None
    if calls:
        message["tool_calls"] = tool_call_dicts(calls)
    return {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": now(), "model": model.name,
        "choices": [{"index": 0, "message": message,
                     "logprobs": {"content": logprobs} if req.logprobs else None,
                     "finish_reason": tally.openai_finish_reason(bool(calls))}],
        "usage": tally.usage(),
    }


async def chat_completion_stream(req: ChatCompletionRequest, model: ServedModel, first: EnsembleStep,
                                 rest: AsyncIterator[EnsembleStep]) -> AsyncIterator[str]:
    """The streaming answer as SSE events: a role chunk, content/reasoning/tool-call deltas, a chunk with the finish
    reason, the usage chunk when asked for, `[DONE]`."""
    pipe, tally = _pipe(req, model), Tally()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    base = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk", "created": now(), "model": model.name}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> str:
        body = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                                     "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    def delta_of(d: OutputDelta) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.calls:
            delta["tool_calls"] = tool_call_delta_dicts(list(d.calls))
        return delta

    # the role chunk goes out in one write with the first delta, and the last response's delta with the closing
    # events: one send each, which is what a streamed chunk costs the frontend most
    pending = chunk({"role": "assistant", "content": ""})
    try:
        async for step in all_steps(first, rest):
            tally.add(step)
            d = pipe.feed(step.text)
            logprobs = {"content": _logprob_entries(model, step)} if req.logprobs and step.token_ids else None
            pending += chunk(delta_of(d), logprobs=logprobs) if d or logprobs else ""
            if pending and not step.finish_reason:
                yield pending
                pending = ""
    except EngineError as e:  # after the first response the status is sent: the error goes in the stream
        yield pending + sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}) \
            + SSE_DONE
        return
    d = pipe.finish()
    if d:
        pending += chunk(delta_of(d))
    pending += chunk({}, finish_reason=tally.openai_finish_reason(pipe.num_calls > 0))
    if include_usage:
        pending += sse({**base, "choices": [], "usage": tally.usage()})
    yield pending + SSE_DONE
