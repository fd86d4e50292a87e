"""Tool calls in generated text -> OpenAI `tool_calls`, incrementally, for the two Qwen formats.

- `hermes` (Qwen3, Qwen2.5): `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`
- `qwen3_xml` (Qwen3.5 / Qwen3.6, Qwen3-Coder):
  `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>\n</tool_call>`

Text outside the blocks stays content. A call streams from its header on: its name, then its arguments as they
come (ToolCallParser says what happens to blocks that are not calls). Streaming and non-streaming answers share
the one state machine.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from freetoken_core.serving.openai.tags import held_suffix_len, split_at_tag
from freetoken_core.serving.openai.tool_stream import (
    BROKEN, DONE, HERMES_HEADER, HERMES_TAIL, MORE, XML_HEADER, XML_TAIL, Advance, HermesArguments, XmlArguments,
)

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


@dataclass(frozen=True)
class CallPiece:
    """A part of one call as it streams: its first piece carries the name, every piece more of the arguments."""

    index: int  # the call's position among this answer's calls
    name: str | None
    arguments: str


@dataclass(frozen=True)
class ToolDelta:
    content: str = ""
    pieces: tuple[CallPiece, ...] = ()


def assemble_calls(pieces: list[CallPiece]) -> list[ToolCall]:
    """A whole answer's pieces -> its calls."""
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for p in pieces:
        if p.name is not None:
            names[p.index] = p.name
        args.setdefault(p.index, []).append(p.arguments)
    return [ToolCall(names[i], "".join(args[i])) for i in sorted(names)]


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


def _header_name(fmt: str, m: re.Match[str]) -> str | None:
    if fmt != "hermes":
        return m.group(1).strip() or None
    try:
        return json.loads(f'"{m.group(1)}"') or None
    except json.JSONDecodeError:  # a bad escape in the name: the block is parsed whole, at its closing tag
        return None


@dataclass(frozen=True)
class _Format:
    parse_block: BlockParser  # a whole block (closed before its header matched)
    header: re.Pattern[str]  # the start of a block whose call streams: group 1 is the function's name
    tail: re.Pattern[str]  # what may follow the arguments before `</tool_call>`


class ToolCallParser:
    """Feed content deltas; get the text to pass on and the calls' pieces as they come.

    Outside a block, text passes (holding a tail that may begin `<tool_call>`). Inside one, once its header is
    complete (hermes: `{"name": "f", "arguments": `; XML: `<function=f>`) the call starts: a piece with its name,
    then its arguments as they come (tool_stream.py). A block whose header never matches is parsed whole at
    `</tool_call>` and stays text, verbatim, when it is not a call. A block that breaks the format after its header
    ends its call there (the arguments closed where JSON allows) and the rest of the block, if any, stays text; a call cut
    off by the end of the output is closed the same way. Every decision depends on the text alone, never on how it
    was split into chunks, so streamed and whole answers agree."""

    def __init__(self, fmt: str, param_types: ParamTypes | None = None) -> None:
        self._format = TOOL_FORMATS[fmt]
        self._fmt = fmt
        self._param_types = param_types or {}
        self._state = "text"  # text | header | arguments | tail | broken
        self._buf = ""
        self._args: HermesArguments | XmlArguments | None = None
        self.calls_started = 0

    def feed(self, delta: str) -> ToolDelta:
        self._buf += delta
        text: list[str] = []
        pieces: list[CallPiece] = []
        while self._step(text, pieces):
            pass
        return ToolDelta("".join(text), tuple(pieces))

    def finish(self) -> ToolDelta:
        """The end of the output: a block that never closed stays text (with its opening tag), a call that was
        streaming is closed."""
        pieces: tuple[CallPiece, ...] = ()
        buf, self._buf = self._buf, ""
        if self._state == "header":
            buf = CALL_OPEN + buf
        elif self._state == "arguments":
            pieces = (CallPiece(self.calls_started - 1, None, self._args.closing()),)
            buf = ""  # held back as a possible tag start: the cut-off arguments end there
        elif self._state == "tail" and self._format.tail.match(buf):
            buf = ""  # the call was complete; only its closing tag is missing
        self._state = "text"
        return ToolDelta(buf, pieces)

    def _step(self, text: list[str], pieces: list[CallPiece]) -> bool:
        """Advance one state on the buffered text; False when it needs more."""
        buf = self._buf
        if self._state == "text":
            before, found, rest = split_at_tag(buf, CALL_OPEN)
            text.append(before)
            self._buf = rest
            if found:
                self._state = "header"
            return found
        close = buf.find(CALL_CLOSE)
        if self._state == "header":
            m = self._format.header.match(buf if close < 0 else buf[:close])
            name = _header_name(self._fmt, m) if m is not None else None
            if name:
                self._args = (HermesArguments() if self._fmt == "hermes"
                              else XmlArguments(self._param_types.get(name, {})))
                pieces.append(CallPiece(self.calls_started, name, "" if self._fmt == "hermes" else "{"))
                self.calls_started += 1
                self._buf, self._state = buf[m.end():], "arguments"
                return True
            if close < 0:
                return False
            body, self._buf, self._state = buf[:close], buf[close + len(CALL_CLOSE):], "text"
            call = self._format.parse_block(body, self._param_types)
            if call is None:
                text.append(CALL_OPEN + body + CALL_CLOSE)
            else:
                pieces.append(CallPiece(self.calls_started, call.name, call.arguments))
                self.calls_started += 1
            return True
        if self._state == "arguments":
            usable = buf[:close] if close >= 0 else buf[: len(buf) - held_suffix_len(buf, CALL_CLOSE)]
            adv = self._args.advance(usable)
            self._buf = buf[adv.consumed:]
            if adv.status == MORE and close >= 0:  # the block closed inside the arguments
                adv = Advance(adv.arguments, adv.consumed, BROKEN)
            if adv.status == BROKEN:
                adv = Advance(adv.arguments + self._args.closing(), adv.consumed, BROKEN)
            if adv.arguments:
                pieces.append(CallPiece(self.calls_started - 1, None, adv.arguments))
            if adv.status == MORE:
                return False
            self._state = "tail" if adv.status == DONE else "broken"
            return True
        if close < 0:  # tail or broken: the rest of the block waits for its closing tag
            return False
        rest, self._buf, state = buf[:close], buf[close + len(CALL_CLOSE):], self._state
        self._state = "text"
        if (state == "broken" and rest.strip()) or (state == "tail" and not self._format.tail.match(rest)):
            text.append(rest + CALL_CLOSE)  # what the call could not take stays text
        return True


TOOL_FORMATS: dict[str, _Format] = {
    "hermes": _Format(parse_hermes_block, HERMES_HEADER, HERMES_TAIL),
    "qwen3_xml": _Format(parse_xml_block, XML_HEADER, XML_TAIL),
}
TOOL_PARSERS = tuple(TOOL_FORMATS)  # the registry's names


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


__all__ = ["CallPiece", "ToolCall", "ToolCallParser", "ToolDelta", "TOOL_FORMATS", "TOOL_PARSERS", "assemble_calls",
           "param_types_of", "parse_hermes_block", "parse_xml_block", "tool_parser_for_template"]
