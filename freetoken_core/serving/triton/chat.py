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
