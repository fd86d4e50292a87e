"""POST /v1/completions: one ensemble stream -> a text_completion, or its streamed chunks."""

from __future__ import annotations

from typing import Any, AsyncIterator

from freetoken_core.serving.openai.ensemble_client import EngineError, EnsembleStep
from freetoken_core.serving.openai.generation import (SSE_DONE, Tally, all_steps, sse, token_logprobs,
                                                     top_token_logprobs)
from freetoken_core.serving.openai.protocol import CompletionRequest, new_id, now
from freetoken_core.serving.openai.served_model import ServedModel
from freetoken_core.serving.openai.translate import echo_text


class _Logprobs:
    """The legacy completions logprobs object: tokens, their logprobs, the top ones ({text: logprob}, when the
    request's logprobs is above 0) and text offsets."""

    def __init__(self, offset: int, top: bool) -> None:
        self.tokens: list[str] = []
        self.values: list[float] = []
        self.offsets: list[int] = []
        self.top: list[dict[str, float]] | None = [] if top else None
        self._offset = offset

    def add(self, model: ServedModel, step: EnsembleStep) -> None:
        for (text, lp), top in zip(token_logprobs(model.tokenizer, step), top_token_logprobs(model.tokenizer, step)):
            self.tokens.append(text)
            self.values.append(lp)
            self.offsets.append(self._offset)
            self._offset += len(text)
            if self.top is not None:
                self.top.append(dict(top))

    def body(self, start: int = 0) -> dict[str, Any]:
        return {"tokens": self.tokens[start:], "token_logprobs": self.values[start:],
                "top_logprobs": self.top[start:] if self.top is not None else None, "text_offset": self.offsets[start:]}


async def completion(req: CompletionRequest, model: ServedModel, first: EnsembleStep,
                     rest: AsyncIterator[EnsembleStep]) -> dict[str, Any]:
    tally, texts = Tally(), []
    echo = echo_text(req, model)
    logprobs = _Logprobs(len(echo), bool(req.logprobs))
    async for step in all_steps(first, rest):
        tally.add(step)
        texts.append(step.text)
        if req.logprobs is not None:
            logprobs.add(model, step)
    return {
        "id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": model.name,
        "choices": [{"index": 0, "text": echo + "".join(texts),
                     "logprobs": logprobs.body() if req.logprobs is not None else None,
                     "finish_reason": tally.openai_finish_reason()}],
        "usage": tally.usage(),
    }


async def completion_stream(req: CompletionRequest, model: ServedModel, first: EnsembleStep,
                            rest: AsyncIterator[EnsembleStep]) -> AsyncIterator[str]:
    tally = Tally()
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    base = {"id": new_id("cmpl"), "object": "text_completion", "created": now(), "model": model.name}
    echo = echo_text(req, model)
    logprobs = _Logprobs(len(echo), bool(req.logprobs))

    def chunk(text: str, finish_reason: str | None = None, lp: Any = None) -> str:
        body = {**base, "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish_reason}]}
        if include_usage:
            body["usage"] = None
        return sse(body)

    # the echo goes out with the first text, and the last response's text with the closing events (one send each)
    pending = chunk(echo) if echo else ""
    try:
        async for step in all_steps(first, rest):
            tally.add(step)
            lp = None
            if req.logprobs is not None and step.token_ids:
                start = len(logprobs.tokens)
                logprobs.add(model, step)
                lp = logprobs.body(start)
            if step.text or lp:
                pending += chunk(step.text, lp=lp)
            if pending and not step.finish_reason:
                yield pending
                pending = ""
    except EngineError as e:
        yield pending + sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}}) \
            + SSE_DONE
        return
    pending += chunk("", finish_reason=tally.openai_finish_reason())
    if include_usage:
        pending += sse({**base, "choices": [], "usage": tally.usage()})
    yield pending + SSE_DONE
