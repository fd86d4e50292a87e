"""One request's generated text -> reasoning, content and tool calls, chunk by chunk (reasoning.py, then
tool_parsers.py on what is not reasoning). Streaming and non-streaming answers both go through it."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken_core.serving.openai.reasoning import ReasoningParser
from freetoken_core.serving.openai.tool_parsers import CallPiece, ParamTypes, ToolCallParser


@dataclass(frozen=True)
class OutputDelta:
    content: str = ""
    reasoning: str = ""
    calls: tuple[CallPiece, ...] = ()  # pieces of tool calls as they stream

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)


class OutputPipe:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @classmethod
    def for_model(cls, tool_format: str | None, starts_in_reasoning: bool | None, tools_on: bool,
                  param_types: ParamTypes | None = None) -> "OutputPipe":
        """The parsers the model's chat template calls for (tool calls unless tool_choice is 'none'); param_types
        (tool_parsers.param_types_of the request's tools) type the XML format's values."""
        reasoning = None if starts_in_reasoning is None else ReasoningParser(starts_in_reasoning)
        tools = ToolCallParser(tool_format, param_types) if tool_format and tools_on else None
        return cls(reasoning, tools)

    @property
    def num_calls(self) -> int:
        return self._tools.calls_started if self._tools is not None else 0

    def feed(self, text: str) -> OutputDelta:
        return self._step(text, final=False)

    def finish(self) -> OutputDelta:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> OutputDelta:
        reasoning = ""
        if self._reasoning is not None:
            r = self._reasoning.finish() if final else self._reasoning.feed(text)
            reasoning, text = r.reasoning, r.content
        if self._tools is None:
            return OutputDelta(content=text, reasoning=reasoning)
        t = self._tools.feed(text)
        content, calls = t.content, t.pieces
        if final:
            rest = self._tools.finish()
            content, calls = content + rest.content, calls + rest.pieces
        return OutputDelta(content=content, reasoning=reasoning, calls=calls)

    @property
    def has_reasoning(self) -> bool:
        return self._reasoning is not None
