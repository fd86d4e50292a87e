"""Tool-call and reasoning parsers of the OpenAI frontend over recorded Qwen-format outputs: whole, split into two
stream chunks at every position, one character a chunk, and malformed. Calls stream: their name at the header,
their arguments as they come, and every split gives the same pieces joined."""

from __future__ import annotations

import json

import pytest

from freetoken_core.serving.openai.reasoning import ReasoningParser
from freetoken_core.serving.openai.tool_parsers import (ToolCall, ToolCallParser, assemble_calls, param_types_of,
                                                        tool_parser_for_template)

# Recorded shapes of Qwen3 (hermes JSON) and Qwen3.5/3.6 (XML) outputs
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
XML = ('<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n'
       '</parameter>\n</function>\n</tool_call>')
THINKING = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
PREFILLED = "The user greets me.\n</think>\n\nHello! How can I help?"

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]


def _chunkings(text: str):
    """The whole text, every split into two chunks, and one character a chunk."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def _run_tools(fmt: str, chunks: list[str], tools=None) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(fmt, param_types_of(tools))
    text, pieces = [], []
    for c in chunks:
        d = parser.feed(c)
        text.append(d.content)
        pieces.extend(d.pieces)
    d = parser.finish()
    assert [p.index for p in pieces if p.name is not None] == list(range(parser.calls_started))
    return "".join(text) + d.content, assemble_calls(pieces + list(d.pieces))


def _run_reasoning(chunks: list[str], prefilled: bool) -> tuple[str, str]:
    parser = ReasoningParser(starts_in_reasoning=prefilled)
    r, c = [], []
    for chunk in chunks + [None]:
        d = parser.feed(chunk) if chunk is not None else parser.finish()
        r.append(d.reasoning)
        c.append(d.content)
    return "".join(r), "".join(c)


def test_hermes_calls_at_every_split():
    expected = [ToolCall("get_weather", '{"city": "Paris", "days": 2}'), ToolCall("get_time", '{"tz": "CET"}')]
    for chunks in _chunkings(HERMES):
        text, calls = _run_tools("hermes", chunks)
        assert calls == expected, chunks
        assert text == "Let me check.\n\n", chunks


def test_xml_calls_at_every_split_typed_by_the_tool_schema():
    for chunks in _chunkings(XML):
        text, calls = _run_tools("qwen3_xml", chunks, WEATHER_TOOLS)
        assert text == "" and len(calls) == 1, chunks
        assert calls == [ToolCall("get_weather", '{"city": "San Francisco", "days": 3}')], chunks
    _, calls = _run_tools("qwen3_xml", [XML])  # no schema: values stay strings
    assert json.loads(calls[0].arguments) == {"city": "San Francisco", "days": "3"}


def test_arguments_stream_as_they_come():
    """The name goes out with the header; each argument character soon after it arrives (only what may be the
    start of a closing tag waits)."""
    parser = ToolCallParser("hermes")
    d = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')
    assert d.content == "" and [(p.name, p.arguments) for p in d.pieces] == [("get_weather", ""), (None, '{"city": "Par')]
    assert [p.arguments for p in parser.feed('is"').pieces] == ['is"']
    assert [p.arguments for p in parser.feed("}}\n</tool_call>done").pieces] == ["}"]
    parser = ToolCallParser("qwen3_xml", param_types_of(WEATHER_TOOLS))
    d = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fr")
    assert "".join(p.arguments for p in d.pieces) == '{"city": "San Fr' and d.pieces[0].name == "get_weather"
    assert "".join(p.arguments for p in parser.feed("ancisco\n</param").pieces) == "ancisco"
    assert "".join(p.arguments for p in parser.feed("eter>\n<parameter=days>\n1").pieces) == '", "days": '
    assert "".join(p.arguments for p in parser.feed("4\n</parameter>\n</function>").pieces) == "14}"


def test_xml_string_values_are_json_escaped_at_every_split():
    text = '<tool_call>\n<function=say>\n<parameter=text>\nline "one"\n\\two\n\n</parameter>\n</function>\n</tool_call>'
    for chunks in _chunkings(text):
        out, calls = _run_tools("qwen3_xml", chunks)
        assert out == "" and calls == [ToolCall("say", json.dumps({"text": 'line "one"\n\\two\n'}))], chunks


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "<tool_call>\n[1, 2]\n</tool_call>"),  # not an object
    ("hermes", "<tool_call>\n{\"arguments\": {}}\n</tool_call>"),  # no name
    ("hermes", "<tool_call>\n{\"name\": \"\", \"arguments\": {}}\n</tool_call>"),  # empty name
    ("hermes", "before <tool_call>\nI will call a tool now"),  # never closed, never a call
    ("qwen3_xml", "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),  # the other format
    ("qwen3_xml", "<tool_call>\nf(a=1)\n</tool_call> and on"),
    ("hermes", "a <tool_cal and < and <tool"),  # tag prefixes that never complete
])
def test_malformed_blocks_stay_text_verbatim(fmt, text):
    for chunks in _chunkings(text):
        out, calls = _run_tools(fmt, chunks)
        assert calls == [] and out == text, chunks


@pytest.mark.parametrize("fmt, text, calls, rest", [
    # the outer brace missing: the arguments were complete
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call> after', [("f", '{"a": 1}')], " after"),
    # keys in the other order: not a streaming header, parsed whole at the closing tag
    ("hermes", '<tool_call>{"arguments": {"a": [1]}, "name": "f"}</tool_call>', [("f", '{"a": [1]}')], ""),
    # the block closed inside the arguments: they are closed where they were cut
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ["x", "y</tool_call>!', [("f", '{"a": ["x", "y"]}')], "!"),
    # junk after the arguments: the call stands, the junk stays text
    ("hermes", '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>', [("f", "{}")],
     '} oops</tool_call>'),
    # the output ended inside a call (max_tokens): closed likewise
    ("hermes", 'x<tool_call>{"name": "f", "arguments": {"q": "abc', [("f", '{"q": "abc"}')], "x"),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}', [("f", "{}")], ""),  # never closed, complete
    ("qwen3_xml", "<tool_call>\n<function=f>\nstray<parameter=a>1</parameter>\n</function>\n</tool_call>",
     [("f", "{}")], "\nstray<parameter=a>1</parameter>\n</function>\n</tool_call>"),
    ("qwen3_xml", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",  # parameter unclosed
     [("f", '{"a": "1\\n</function>"}')], ""),
    ("qwen3_xml", "<tool_call>\n<function=f>\n<parameter=a>\nhello", [("f", '{"a": "hello"}')], ""),
])
def test_blocks_broken_after_their_header_end_their_call_at_every_split(fmt, text, calls, rest):
    for chunks in _chunkings(text):
        out, got = _run_tools(fmt, chunks)
        assert [(c.name, c.arguments) for c in got] == calls and out == rest, chunks


def test_malformed_block_then_good_block():
    text = "<tool_call>oops</tool_call>" + XML
    for chunks in _chunkings(text):
        out, calls = _run_tools("qwen3_xml", chunks)
        assert out == "<tool_call>oops</tool_call>" and [c.name for c in calls] == ["get_weather"], chunks


def test_plain_text_passes_without_holding_more_than_a_tag_prefix():
    parser = ToolCallParser("hermes")
    assert parser.feed("Hello <b>world</b> <").content == "Hello <b>world</b> "
    assert parser.feed("tool").content == ""
    assert parser.feed("s>").content == "<tools>"


def test_reasoning_at_every_split():
    for chunks in _chunkings(THINKING):
        assert _run_reasoning(chunks, prefilled=False) == ("\nThe user greets me.\n", "Hello! How can I help?"), chunks
    for chunks in _chunkings(PREFILLED):
        assert _run_reasoning(chunks, prefilled=True) == ("The user greets me.\n", "Hello! How can I help?"), chunks


@pytest.mark.parametrize("text, prefilled, expected", [
    ("Just an answer.", False, ("", "Just an answer.")),
    ("  <thin", False, ("", "  <thin")),  # a tag that never completes stays content
    ("<think>still thinking when max_tokens hit", False, ("still thinking when max_tokens hit", "")),
    ("thinking, cut off </thi", True, ("thinking, cut off </thi", "")),
    ("an answer </think> mentioned", False, ("", "an answer </think> mentioned")),  # no open tag: content
    ("<think></think>", False, ("", "")),
])
def test_reasoning_edge_cases(text, prefilled, expected):
    for chunks in _chunkings(text):
        assert _run_reasoning(chunks, prefilled) == expected, chunks


def test_registry_picks_the_format_from_the_chat_template():
    assert tool_parser_for_template("{{ '<tool_call>\\n<function=' + name }}") == "qwen3_xml"
    assert tool_parser_for_template("{{- '<tool_call>\\n{\"name\": \"' }}") == "hermes"
    assert tool_parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None
