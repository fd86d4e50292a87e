"""Chat messages as the `tokenizer` model accepts them: the roles and keys chat templates use.

A served request's `messages` is JSON from a client, so it is checked strictly here before it
reaches a Jinja chat template (which would render an unknown role such as "wizard" as if it were
meaningful, and drop an unknown key without a word). Roles: the OpenAI chat roles plus `developer`
(OpenAI's newer name for system) and `tool`. Keys: `role`, `content`, and the ones templates of
tool-calling and reasoning models read: `name`, `tool_calls`, `tool_call_id`, `reasoning_content`.
"""

from __future__ import annotations

import json
from typing import Any

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
CHAT_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")
_STRING_KEYS = ("name", "tool_call_id", "reasoning_content")


def parse_chat_messages(text: str) -> list[dict[str, Any]]:
    """The `messages` input (a JSON list of message objects) -> messages ready for a chat template.

    Raises ValueError naming the first bad message and what is wrong with it."""
    try:
        messages = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"messages is not valid JSON: {e}") from None
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty JSON list of {\"role\": ..., \"content\": ...} objects")
    return [_check_message(i, m) for i, m in enumerate(messages)]


def _check_message(i: int, m: Any) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise ValueError(f"chat message {i} must be an object with 'role' and 'content', got {type(m).__name__}")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise ValueError(f"chat message {i} has role {role!r}; allowed roles: {', '.join(CHAT_ROLES)}")
    unknown = sorted(set(m) - set(CHAT_KEYS))
    if unknown:
        raise ValueError(f"chat message {i} (role {role!r}) has unknown key(s) {unknown}; "
                         f"allowed keys: {', '.join(CHAT_KEYS)}")
    for key in _STRING_KEYS:
        if key in m and not isinstance(m[key], str):
            raise ValueError(f"chat message {i} '{key}' must be a string, got {type(m[key]).__name__}")
    tool_calls = m.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise ValueError(f"chat message {i}: only assistant messages carry 'tool_calls' (role is {role!r})")
        if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
            raise ValueError(f"chat message {i} 'tool_calls' must be a list of objects")
    content = m.get("content")
    if content is None:
        # OpenAI's assistant turn that only calls tools has "content": null (or none at all)
        if not (role == "assistant" and tool_calls):
            raise ValueError(f"chat message {i} (role {role!r}) needs 'content' (a string)")
        m = {**m, "content": ""}
    elif isinstance(content, list):  # OpenAI-style content parts: only text parts are understood
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"chat message {i} content part {j} must be {{'type': 'text', 'text': str}}")
    elif not isinstance(content, str):
        raise ValueError(f"chat message {i} 'content' must be a string, got {type(content).__name__}")
    return m


# apply_chat_template's own arguments: the request may not set them through chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                       "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                       "truncation", "max_length", "return_tensors", "return_dict",
                                       "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _json_input(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None


def parse_chat_tools(text: str) -> list[dict[str, Any]]:
    """The `tools` input (OpenAI's tools as a JSON list) -> the list the chat template renders."""
    tools = _json_input("tools", text)
    if not isinstance(tools, list):
        raise ValueError("tools must be a JSON list of {\"type\": \"function\", \"function\": {...}} objects")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def parse_chat_template_kwargs(text: str) -> dict[str, Any]:
    """The `chat_template_kwargs` input (a JSON object, e.g. {"enable_thinking": false}) -> the template's
    extra variables."""
    kwargs = _json_input("chat_template_kwargs", text)
    if not isinstance(kwargs, dict):
        raise ValueError("chat_template_kwargs must be a JSON object of template variables")
    reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {reserved}: they are the request's own fields or "
                         "the server's")
    return kwargs


def tool_call_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI sends a past call's arguments as a JSON string; templates (Qwen3.5's XML one) iterate them as an
    object: a string that holds a JSON object becomes that object."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        out.append(m)
    return out


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call
