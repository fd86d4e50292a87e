"""OpenAI request bodies (pydantic, strict: an unknown field is a 400 naming it) and response shapes.

Requests are validated models; responses are built as plain dicts in OpenAI's exact shapes (one per streamed
chunk: no model validation on the hot path).
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: str
    json_schema: dict[str, Any] | None = None


class _SamplingFields(_Strict):
    """Fields chat and completions share; the extras past OpenAI's (top_k, min_p, ignore_eos, min_tokens,
    repetition_penalty) are vLLM's names."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # the end user's id (OpenAI's abuse monitoring): accepted, not used
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0)


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class APIError(Exception):
    """An OpenAI error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or _ERROR_TYPES.get(status, "server_error")
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; cached_tokens: prompt tokens the prefix cache served (counted in prompt_tokens too)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"  # OpenAI's shape of a tool call's id


def tool_call_dicts(calls: list[Any]) -> list[dict[str, Any]]:
    """A whole answer's calls (tool_parsers.ToolCall) -> its message's `tool_calls`."""
    return [{"id": _call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def tool_call_delta_dicts(pieces: list[Any]) -> list[dict[str, Any]]:
    """Streamed call pieces (tool_parsers.CallPiece) -> a chunk's `delta.tool_calls`: a call's first entry carries
    its id, type and name; every entry its index and the next part of its arguments."""
    out = []
    for p in pieces:
        entry: dict[str, Any] = {"index": p.index, "function": {"arguments": p.arguments}}
        if p.name is not None:
            entry = {"index": p.index, "id": _call_id(), "type": "function",
                     "function": {"name": p.name, "arguments": p.arguments}}
        out.append(entry)
    return out
