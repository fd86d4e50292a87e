"""`<think>...</think>` -> `reasoning_content`, incrementally (Qwen3 / Qwen3.5 / Qwen3.6 and DeepSeek-R1 style).

One state machine serves streaming and non-streaming alike (non-streaming feeds the whole text once), so both
give the same split for any chunking. A template that prefills `<think>` in the generation prompt makes the model
write only the closing tag: such a parser starts inside the reasoning. Text after `</think>` loses its leading
whitespace (the model writes `</think>\n\n` before the answer).
"""

from __future__ import annotations

from dataclasses import dataclass

from freetoken_core.serving.openai.tags import split_at_tag

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Feed text deltas; get reasoning and content deltas. States: `start` (nothing but whitespace seen yet),
    `reasoning`, `answer_start` (after `</think>`, dropping whitespace), `content`."""

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._pending = ""

    def feed(self, delta: str) -> ReasoningDelta:
        buf = self._pending + delta
        self._pending = ""
        reasoning, content = [], []
        while buf:
            if self._state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._state, buf = "reasoning", stripped[len(THINK_OPEN):]
                elif THINK_OPEN.startswith(stripped):  # whitespace, or the tag's beginning: wait for more
                    self._pending = buf
                    buf = ""
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                before, found, rest = split_at_tag(buf, THINK_CLOSE)
                reasoning.append(before)
                if found:
                    self._state, buf = "answer_start", rest
                else:
                    self._pending, buf = rest, ""
            elif self._state == "answer_start":
                buf = buf.lstrip()
                if buf:
                    self._state = "content"
            else:
                content.append(buf)
                buf = ""
        return ReasoningDelta("".join(reasoning), "".join(content))

    def finish(self) -> ReasoningDelta:
        """What is held at the end of the output: a tag that never completed is text of its part."""
        pending, self._pending = self._pending, ""
        if self._state == "reasoning":
            return ReasoningDelta(reasoning=pending)
        if self._state == "start" and not pending.strip():
            return ReasoningDelta()
        return ReasoningDelta(content=pending)

