"""What chat and completions answers share: running one ensemble request (errors mapped to OpenAI's), the finish
reason, usage, SSE framing and logprob entries."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator

from freetoken_core.serving.openai.ensemble_client import EngineError, EnsembleClient, EnsembleRequest, EnsembleStep
from freetoken_core.serving.openai.protocol import APIError, usage
from freetoken_core.tokenizer.tokenize import Tokenizer

SSE_DONE = "data: [DONE]\n\n"


# one encoder for every answer: json.dumps with options builds a new one per call, a few us of each streamed chunk
compact_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(obj: dict[str, Any]) -> str:
    return f"data: {compact_json(obj)}\n\n"


@dataclass
class Tally:
    """Counts and the finish reason, from the latest response that carried them."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str = ""

    def add(self, step: EnsembleStep) -> None:
        if step.num_input_tokens is not None:
            self.prompt_tokens = step.num_input_tokens
        if step.num_output_tokens is not None:
            self.completion_tokens = step.num_output_tokens
        if step.num_cached_tokens is not None:
            self.cached_tokens = step.num_cached_tokens
        if step.finish_reason:
            self.finish_reason = step.finish_reason

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def openai_finish_reason(self, tool_calls: bool = False) -> str:
        if self.finish_reason == "length":
            return "length"
        return "tool_calls" if tool_calls else "stop"


QUEUE_FULL_MARK = "(max_queued_requests="  # in the engine's refusal when its queue is full (engine_loop.py)
_ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")
# the ensemble's refusals start with the input they name; the OpenAI field that set it
_PARAM_OF_MESSAGE = (("chat message", "messages"), ("messages", "messages"), ("max_tokens", "max_tokens"),
                     ("tools", "tools"), ("chat_template_kwargs", "chat_template_kwargs"), ("input_ids", "prompt"),
                     ("the prompt", "prompt"), ("stop", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("top_k", "top_k"), ("min_p", "min_p"), ("seed", "seed"), ("min_tokens", "min_tokens"),
                     ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
                     ("repetition_penalty", "repetition_penalty"))


def param_of_message(message: str) -> str | None:
    """The OpenAI field an ensemble (or tokenizer) refusal is about, from the input its message starts with."""
    return next((p for start, p in _PARAM_OF_MESSAGE if message.startswith(start)), None)


async def engine_error(client: EnsembleClient, e: EngineError, status: int = 400) -> APIError:
    """A request the ensemble refused: 503 when the server is not ready (the engine is down or restarting), else
    the ensemble's own message as a 400 (its refusals name the bad input), or `status` for a failure mid-answer."""
    message = _ENSEMBLE_PREFIX.sub("", str(e))
    if QUEUE_FULL_MARK in message:
        return APIError(429, message, type_="rate_limit_error", code="rate_limit_exceeded")
    if not await client.ready():
        return APIError(503, f"the engine is not ready: {message}", type_="service_unavailable")
    if status != 400:
        return APIError(status, message)
    param = param_of_message(message)
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(400, message, param=param)


async def start(client: EnsembleClient, request: EnsembleRequest) -> tuple[EnsembleStep, AsyncIterator[EnsembleStep]]:
    """The first response and the generator of the rest: a refusal becomes an HTTP error before any byte is sent."""
    steps = client.generate(request)
    try:
        first = await steps.__anext__()
    except EngineError as e:
        await steps.aclose()
        raise await engine_error(client, e) from None
    except StopAsyncIteration:
        raise APIError(500, "the ensemble ended the request without a response") from None
    return first, steps


async def all_steps(first: EnsembleStep, rest: AsyncIterator[EnsembleStep]) -> AsyncIterator[EnsembleStep]:
    yield first
    async for step in rest:
        yield step


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def token_logprobs(tok: Tokenizer, step: EnsembleStep) -> list[tuple[str, float]]:
    """(token text, logprob) of each token of a response that carries logprobs."""
    return [(token_text(tok, t), lp) for t, lp in zip(step.token_ids, step.logprobs)]


def top_token_logprobs(tok: Tokenizer, step: EnsembleStep) -> list[list[tuple[str, float]]]:
    """Per token of the response: (text, logprob) of the most likely tokens, best first (empty lists when the
    request asked for none)."""
    if not step.top_logprobs:
        return [[] for _ in step.token_ids]
    return [[(token_text(tok, t), lp) for t, lp in top] for top in step.top_logprobs]
