"""Tool calls in generated text -> OpenAI `tool_calls`, incrementally, for the two Qwen formats.

- `hermes` (Qwen3, Qwen2.5): `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`
- `qwen3_xml` (Qwen3.5 / Qwen3.6, Qwen3-Coder):
  `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>`

Text outside the blocks stays content. A block is parsed once its closing tag arrives (its call is then emitted
whole: name and complete arguments in one delta, which OpenAI clients accumulate like any other); a block that does
not parse, or never closes, stays text, verbatim. Streaming and non-streaming share the one state machine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from freetoken_core.serving.openai.tags import split_at_tag

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class ToolDelta:
    content: str = ""
    calls: tuple[ToolCall, ...] = ()


# {function name: {parameter name: JSON-schema type}}: how the XML format's text values become JSON values
ParamTypes = Mapping[str, Mapping[str, str]]
BlockParser = Callable[[str, ParamTypes], "ToolCall | None"]


def parse_hermes_block(body: str, param_types: ParamTypes) -> ToolCall | None:  # noqa: ARG001
    """`{"name": ..., "arguments": {...}}` -> a call, or None when it is not one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_FUNCTION_RE = re.compile(r"\A\s*<function=([^>\n]+)>(.*)</function>\s*\Z", re.S)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def parse_xml_block(body: str, param_types: ParamTypes) -> ToolCall | None:
    """`<function=NAME><parameter=P>value</parameter>...</function>` -> a call, or None when it is not one.
    Values are text; a parameter whose schema type is not `string` is read as JSON when it parses as JSON."""
    m = _FUNCTION_RE.match(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    types = param_types.get(name, {})
    args: dict[str, Any] = {}
    end = 0
    for p in _PARAM_RE.finditer(inner):
        if inner[end:p.start()].strip():  # stray text between parameters: not this format
            return None
        end = p.end()
        value = _strip_one_newline(p.group(2))
        args[p.group(1).strip()] = _typed_value(value, types.get(p.group(1).strip()))
    if inner[end:].strip() or not name:
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _typed_value(value: str, schema_type: str | None) -> Any:
    if schema_type in (None, "string"):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class ToolCallParser:
    """Feed content deltas; get text to pass on and finished calls. States: outside a block (holding a tail that
    may begin `<tool_call>`) and inside one (buffering until `</tool_call>`)."""

    def __init__(self, parse_block: BlockParser, param_types: ParamTypes | None = None) -> None:
        self._parse_block = parse_block
        self._param_types = param_types or {}
        self._in_call = False
        self._pending = ""
        self.calls_seen = 0

    def feed(self, delta: str) -> ToolDelta:
        buf = self._pending + delta
        self._pending = ""
        text: list[str] = []
        calls: list[ToolCall] = []
        while buf:
            if not self._in_call:
                before, found, rest = split_at_tag(buf, CALL_OPEN)
                text.append(before)
                if not found:
                    self._pending = rest
                    break
                self._in_call, buf = True, rest
            else:
                i = buf.find(CALL_CLOSE)
                if i < 0:
                    self._pending = buf
                    break
                body, buf = buf[:i], buf[i + len(CALL_CLOSE):]
                self._in_call = False
                call = self._parse_block(body, self._param_types)
                if call is None:
                    text.append(CALL_OPEN + body + CALL_CLOSE)
                else:
                    calls.append(call)
        self.calls_seen += len(calls)
        return ToolDelta("".join(text), tuple(calls))

    def finish(self) -> ToolDelta:
        """A block that never closed stays text, with its opening tag."""
        pending, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            return ToolDelta(CALL_OPEN + pending)
        return ToolDelta(pending)


TOOL_PARSERS: dict[str, BlockParser] = {"hermes": parse_hermes_block, "qwen3_xml": parse_xml_block}


def tool_parser_for_template(chat_template: str) -> str | None:
    """The registry's pick for a chat template: the XML format where the template writes `<function=`, hermes
    where it writes `<tool_call>`, none otherwise."""
    if CALL_OPEN not in chat_template:
        return None
    return "qwen3_xml" if "<function=" in chat_template else "hermes"


def param_types_of(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, str]]:
    """OpenAI `tools` -> {function: {parameter: JSON-schema type}}."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = {k: v.get("type", "string") for k, v in props.items() if isinstance(v, dict)}
    return out


__all__ = ["ToolCall", "ToolCallParser", "ToolDelta", "TOOL_PARSERS", "param_types_of", "parse_hermes_block",
           "parse_xml_block", "tool_parser_for_template"]
