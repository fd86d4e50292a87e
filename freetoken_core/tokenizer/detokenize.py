"""Incremental detokenization: token ids in, text deltas out, UTF-8 safe, with stop strings.

Contract
--------
For the output ids of one request, the concatenation of all deltas equals
`tokenizer.decode(output_ids, skip_special_tokens=...)` byte for byte (when no stop string cut it).
Deltas never end inside a multi-byte character (no text ending in U+FFFD before the stream
finishes) and never lose the leading space of a SentencePiece or byte-level token.

The text emitted after n tokens is a function of those n tokens alone (not of how they were
split into steps), which is what lets a stateless detokenizer reproduce it:

  * raw(n)  = decode(ids[:j]) for the largest j <= n whose decode does not end with U+FFFD
              (a character still missing bytes, or a SentencePiece byte run still open);
  * hold(n) = the longest end of raw(n) that is a proper prefix of a stop string;
  * emitted(n) = raw(n) minus hold(n), or, once a stop string appears, the text before it
    (through its end with include_stop_str_in_output). The stop string that ends first wins.
  * At finish the whole decode is emitted (held text and trailing U+FFFD included) unless stopped.

Decoding a window instead of all ids
------------------------------------
An *anchor* is a non-special token that decodes alone to non-empty text without U+FFFD and is no
byte piece (`Tokenizer.anchors`, a bool table over the vocabulary). Text decoded from an anchor on
does not depend on the tokens before it (a SentencePiece decoder strips the leading space of the
first token of a decode, which only touches the anchor, the same way in every decode of the
window). So a step needs only the ids from the L-th last anchor before its new ids, where
L = max(1, longest stop string in characters): the window then holds at least L characters of
finished text, enough to re-derive what was emitted and held before.

Stateless use (the Triton detokenizer model, any instance count)
-----------------------------------------------------------------
The engine keeps one `DetokWindow` per request (O(1) per token: a table lookup and a deque) and
sends in each response `context_ids = output_ids[window.start():n]` (the ids before this response's
new ids) with `next_tokens`, then calls `window.push(next_tokens)`. The detokenizer model calls
`decode_step(tokenizer, context_ids, next_tokens, ...)`, which returns exactly the delta that
`IncrementalDetokenizer.add(next_tokens)` returns (it is the same code). The final response sets
`finished=True` to flush held text.

Stop strings end requests in the scheduler: `IncrementalDetokenizer.check_stop(tokens)` consumes
tokens one by one and returns the index of the token at which a stop string completed, so the
scheduler commits tokens through that one and finishes the request.

Known limit: if a model emits invalid UTF-8 through SentencePiece byte pieces (a byte run that never
forms a character), `decode` turns the whole run into U+FFFD while this stream may already have
emitted its valid beginning; byte-level BPE (GPT-2/Llama-3/SmolLM2 style) has no such case.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from .tokenize import REPLACEMENT_CHAR, Tokenizer


@dataclass
class DetokStep:
    """The result of one detokenization step."""

    text: str  # the new text delta
    stopped: bool = False  # a stop string appeared: later tokens add no text
    matched_stop: str | None = None


def window_anchors(stop: Sequence[str] = ()) -> int:
    """How many anchors a window must hold: enough characters to contain any held stop-string prefix."""
    return max([1, *(len(s) for s in stop)])


@dataclass
class DetokWindow:
    """Engine-side tracker: where the decode window of the next step starts (no decoding needed)."""

    anchors: object  # Tokenizer.anchors (numpy bool array indexed by token id)
    min_anchors: int = 1
    num_tokens: int = 0
    _anchor_pos: deque = field(default_factory=deque, repr=False)

    def start(self) -> int:
        """Index into output_ids where the next step's context starts."""
        if len(self._anchor_pos) < self.min_anchors:
            return 0
        return self._anchor_pos[0]

    def push(self, ids: Sequence[int]) -> None:
        n_vocab = len(self.anchors)
        for t in ids:
            if 0 <= t < n_vocab and self.anchors[t]:
                self._anchor_pos.append(self.num_tokens)
                if len(self._anchor_pos) > self.min_anchors:
                    self._anchor_pos.popleft()
            self.num_tokens += 1


def _stable_text(tok: Tokenizer, ids: list[int], lo: int, skip: bool) -> tuple[str, int]:
    """(decode(ids[:j]), j) for the largest j in [lo, len(ids)] whose text does not end with U+FFFD;
    decode(ids[:lo]) if none does. Usually one decode: only open characters make it look further back."""
    for j in range(len(ids), lo, -1):
        text = tok.decode(ids[:j], skip_special_tokens=skip)
        if not text.endswith(REPLACEMENT_CHAR):
            return text, j
    return (tok.decode(ids[:lo], skip_special_tokens=skip) if lo > 0 else ""), lo


def _hold_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest end of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def _first_stop(text: str, start: int, stop: Sequence[str]) -> tuple[int, str] | None:
    """(position, stop string) of the stop string that ends first in text[start:] (ties: the longer)."""
    best = None
    for s in stop:
        i = text.find(s, start)
        if i >= 0:
            key = (i + len(s), -len(s))
            if best is None or key < best[0]:
                best = (key, i, s)
    return None if best is None else (best[1], best[2])


def decode_step(
    tokenizer: Tokenizer,
    context_ids: Sequence[int],
    new_ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
    finished: bool = False,
) -> DetokStep:
    """Stateless step: the text delta that `new_ids` add after `context_ids`.

    `context_ids` must be the output ids from `DetokWindow.start()` up to the new ids (for the first
    step: empty). `stop` and `include_stop_str_in_output` must be the request's own, every step.
    """
    ctx = list(context_ids)
    ids = ctx + list(new_ids)
    # What was final before this step, relative to the window (the first id of a non-empty window is an
    # anchor, so j >= 1 decodes cleanly unless the window starts at the very beginning of the output).
    before, j_before = _stable_text(tokenizer, ctx, 0, skip_special_tokens)
    start = len(before) - (_hold_len(before, stop) if stop else 0)  # first character not yet emitted
    if finished:
        after = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    else:
        after, _ = _stable_text(tokenizer, ids, j_before, skip_special_tokens)
    if stop:
        found = _first_stop(after, start, stop)
        if found is not None:
            pos, s = found
            end = pos + len(s) if include_stop_str_in_output else pos
            return DetokStep(after[start:end], stopped=True, matched_stop=s)
    hold = _hold_len(after, stop) if stop and not finished else 0
    return DetokStep(after[start : len(after) - hold])


class IncrementalDetokenizer:
    """Stateful detokenizer of one request's output (the scheduler's stop checks, the offline LLM).

    `add(tokens)` returns the new text; `finish()` flushes held text. After a stop string appears,
    `stopped` is True, `matched_stop` names it and later tokens add nothing.

    `prompt_ids` is accepted so callers can pass what they have, but the text is defined by the output
    ids alone (it equals decode(output_ids), as HF users compare it, and as the stateless detokenizer
    can rebuild it without the prompt): the prompt never enters a decode window, so it can neither
    leak into the output nor complete a stop string.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.output_ids: list[int] = []
        self.window = DetokWindow(tokenizer.anchors, window_anchors(self.stop))
        self.text = ""  # everything emitted so far
        self.stopped = False
        self.matched_stop: str | None = None
        self.finished = False
        self.stop_index: int | None = None  # index (in the last add) of the token that completed a stop

    def context_ids(self) -> list[int]:
        """What a stateless decode_step needs before the next new ids."""
        return self.output_ids[self.window.start() :]

    def _step(self, new: list[int], finished: bool) -> str:
        res = decode_step(
            self.tokenizer,
            self.context_ids(),
            new,
            skip_special_tokens=self.skip_special_tokens,
            stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            finished=finished,
        )
        self.output_ids.extend(new)
        self.window.push(new)
        self.text += res.text
        if res.stopped:
            self.stopped, self.matched_stop = True, res.matched_stop
        return res.text

    def add(self, new_tokens: Sequence[int], finished: bool = False) -> str:
        """Append tokens; return the text they make final. With stop strings, tokens go one at a time so
        the token that completes a stop is known (`stop_index`); tokens after it are ignored."""
        self.stop_index = None
        new = list(new_tokens)
        if self.stopped or self.finished:
            return ""
        self.finished = finished
        if not self.stop:
            return self._step(new, finished)
        if not new:
            return self._step([], finished)
        out = []
        for i, t in enumerate(new):
            out.append(self._step([t], finished and i == len(new) - 1))
            if self.stopped:
                self.stop_index = i
                break
        return "".join(out)

    def finish(self) -> str:
        """Flush what was held back (an unfinished stop-string prefix, an incomplete character)."""
        return self.add([], finished=True)

    def check_stop(self, new_tokens: Sequence[int]) -> int | None:
        """Consume tokens; return the index of the token at which a stop string completed, else None."""
        self.add(new_tokens)
        return self.stop_index
