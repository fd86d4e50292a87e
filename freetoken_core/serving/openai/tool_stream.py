"""Tool-call arguments as they come: per format, a header matcher and an arguments streamer.

A streamer turns the text of one block after its header into the call's arguments as JSON text, piece by piece,
emitting every character as soon as it is known to belong to the arguments. Both formats produce the same JSON
text that parsing the whole block gives (tool_parsers.py), so a streamed answer equals the non-streamed one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from freetoken_core.serving.openai.tags import held_suffix_len

MORE, DONE, BROKEN = "more", "done", "broken"


@dataclass
class Advance:
    arguments: str  # the next piece of the arguments JSON
    consumed: int  # characters of the input it used
    status: str  # MORE: needs more text; DONE: the arguments are complete; BROKEN: the block breaks the format


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# --- hermes: {"name": "f", "arguments": {...}} ------------------------------------------------------------------------
HERMES_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.)+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
HERMES_TAIL = re.compile(r"\s*\}?\s*\Z")  # after the arguments: the outer object's brace (a model may drop it)
_CLOSERS = {"{": "}", "[": "]"}


@dataclass
class HermesArguments:
    """The arguments object's text, verbatim, up to its matching brace (strings and escapes tracked)."""

    stack: list[str] = field(default_factory=list)
    in_string: bool = False
    escaped: bool = False
    started: bool = False

    def advance(self, text: str) -> Advance:
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in _CLOSERS:
                self.stack.append(_CLOSERS[ch])
                self.started = True
            elif ch in "}]":
                if not self.stack or self.stack[-1] != ch:
                    return Advance(text[:i], i, BROKEN)
                self.stack.pop()
                if not self.stack:
                    return Advance(text[: i + 1], i + 1, DONE)
        return Advance(text, len(text), MORE)

    def closing(self) -> str:
        """What ends the arguments where they were cut off (valid JSON unless cut inside a number or a literal)."""
        return ('"' if self.in_string else "") + "".join(reversed(self.stack))


def hermes_arguments_text(body: str) -> str | None:
    """The arguments object of a whole hermes block, verbatim (what streaming sends), or None."""
    m = HERMES_HEADER.match(body)
    if m is None:
        return None
    adv = HermesArguments().advance(body[m.end():])
    return adv.arguments if adv.status == DONE else None


# --- qwen3_xml: <function=f><parameter=p>value</parameter>...</function> ---------------------------------------------
XML_HEADER = re.compile(r"\s*<function=([^>\n]+)>")
XML_TAIL = re.compile(r"\s*\Z")
_PARAM_OPEN = re.compile(r"<parameter=([^>\n]+)>")
PARAM_CLOSE = "</parameter>"
FUNCTION_CLOSE = "</function>"


def _could_become(text: str, *tags: str) -> bool:
    """Whether `text` (no tag complete in it yet) may still grow into one of the tags."""
    return any(tag.startswith(text) or (text.startswith(tag) and "\n" not in text and ">" not in text)
               for tag in tags)


@dataclass
class XmlArguments:
    """Parameters -> a JSON object: `{` at the header, `"p": ` at each parameter, a string value's characters as
    they come (one newline after the tag and one before the closing tag dropped, as the template writes them),
    a typed value (the tool schema says not `string`) once complete, `}` at `</function>`."""

    param_types: Mapping[str, str]
    count: int = 0
    value: str | None = None  # None: between parameters; "string" or "typed": inside a value
    value_started: bool = False

    def advance(self, text: str) -> Advance:
        out: list[str] = []
        pos = 0
        while True:
            rest = text[pos:]
            if self.value is None:
                stripped = rest.lstrip()
                skip = len(rest) - len(stripped)
                if stripped.startswith(FUNCTION_CLOSE):
                    out.append("}")
                    return Advance("".join(out), pos + skip + len(FUNCTION_CLOSE), DONE)
                m = _PARAM_OPEN.match(stripped)
                if m is None:
                    status = MORE if _could_become(stripped, FUNCTION_CLOSE, "<parameter=") else BROKEN
                    return Advance("".join(out), pos, status)  # the spaces stay: broken, they are text
                name = m.group(1).strip()
                typed = self.param_types.get(name, "string") != "string"
                out.append(f"{', ' if self.count else ''}{json_text(name)}: {'' if typed else chr(34)}")
                self.count += 1
                self.value, self.value_started = ("typed" if typed else "string"), False
                pos += skip + m.end()
            elif self.value == "typed":
                i = rest.find(PARAM_CLOSE)
                if i < 0:
                    return Advance("".join(out), pos, MORE)
                raw = rest[:i]
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
                out.append(typed_value_json(raw))
                self.value = None
                pos += i + len(PARAM_CLOSE)
            else:
                if not self.value_started:
                    if not rest:
                        return Advance("".join(out), pos, MORE)
                    self.value_started = True
                    if rest.startswith("\n"):
                        pos += 1
                        continue
                i = rest.find(PARAM_CLOSE)
                if i >= 0:
                    piece = rest[:i]
                    out.append(json_text(piece[:-1] if piece.endswith("\n") else piece)[1:-1] + '"')
                    self.value = None
                    pos += i + len(PARAM_CLOSE)
                    continue
                held = max(held_suffix_len(rest, "\n" + PARAM_CLOSE), held_suffix_len(rest, PARAM_CLOSE))
                out.append(json_text(rest[: len(rest) - held])[1:-1])
                return Advance("".join(out), pos + len(rest) - held, MORE)

    def closing(self) -> str:
        if self.value == "string":
            return '"}'
        return "null}" if self.value == "typed" else "}"


def typed_value_json(raw: str) -> str:
    """A non-string parameter's text as JSON: its JSON value when it parses, else the text as a string."""
    try:
        return json_text(json.loads(raw))
    except json.JSONDecodeError:
        return json_text(raw)
