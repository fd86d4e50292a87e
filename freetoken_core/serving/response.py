"""Engine responses of the `freetoken` model: DetokenizeMsg -> output tensors (numpy).

Besides `next_tokens`, each response carries `context_tokens`: the tokens just before them (the
tail of prompt + output so far). The detokenizer is stateless, so this window is what lets it
decode `next_tokens` exactly: a leading space that depends on the previous token, a multi-byte
character whose bytes started in an earlier response. The window is short and constant-size, so
responses stay small however long the generation runs.
"""

from __future__ import annotations

import numpy as np

from freetoken_core.messages import DetokenizeMsg

# Tokens of context: enough for any UTF-8 character split over byte tokens (at most 4 bytes),
# plus room for tokenizers whose decode of a token depends on its neighbours.
CONTEXT_WINDOW = 8


def detok_context(prompt_ids: list[int], output_ids: list[int], window: int = CONTEXT_WINDOW) -> list[int]:
    if len(output_ids) >= window:
        return output_ids[-window:]
    need = window - len(output_ids)
    return prompt_ids[-need:] + output_ids


def _bytes1(s: str | None) -> np.ndarray:
    return np.array([(s or "").encode("utf-8")], dtype=np.object_)


def build_outputs(
    msg: DetokenizeMsg,
    next_tokens: list[int],
    logprobs: list[float] | None,
    context_tokens: list[int],
    echo_prompt: bool,
) -> dict[str, np.ndarray]:
    stop = msg.stop_reason
    return {
        "next_tokens": np.asarray(next_tokens, dtype=np.int32),
        "context_tokens": np.asarray(context_tokens, dtype=np.int32),
        "finished": np.array([msg.finished], dtype=bool),
        "finish_reason": _bytes1(msg.finish_reason if msg.finished else ""),
        "stop_reason": _bytes1("" if stop is None else str(stop)),
        "num_input_tokens": np.array([msg.num_prompt_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([msg.num_output_tokens], dtype=np.uint32),
        "logprobs": np.asarray(logprobs or [], dtype=np.float32),
        "echo_prompt": np.array([echo_prompt], dtype=bool),
    }
