"""Logic of the `tokenizer` and `detokenizer` Triton models (numpy in, numpy out; no Triton imports).

Both are stateless, so any instance count works. The detokenizer reproduces the offline decode
exactly from what each engine response carries (`context_tokens` + `next_tokens`, see
freetoken_core/tokenizer/detokenize.py) plus the request's own stop settings, which the ensemble
feeds it again with every response.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import numpy as np

from freetoken_core.serving.cancel import notify_cancel
from freetoken_core.serving.request import _scalar, _strings, _text, parse_detok_params
from freetoken_core.tokenizer.detokenize import decode_step
from freetoken_core.tokenizer.tokenize import Tokenizer


def _bytes(s: str) -> np.ndarray:
    return np.array([s.encode("utf-8")], dtype=np.object_)


def tokenize_request(tok: Tokenizer, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """text_input / messages (+ apply_chat_template, stop_words) -> input_ids, stop_token_ids."""
    text = _scalar(tensors.get("text_input"))
    messages_json = _scalar(tensors.get("messages"))
    chat = bool(_scalar(tensors.get("apply_chat_template")) or False)
    if messages_json is not None and _text(messages_json).strip():
        try:
            messages = json.loads(_text(messages_json))
        except json.JSONDecodeError as e:
            raise ValueError(f"messages is not valid JSON: {e}") from None
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
    elif text is not None:
        text = _text(text)
        if chat:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            ids = tok.encode(text)
    else:
        raise ValueError("missing input: send text_input (or chat messages as JSON in 'messages')")
    if not ids:
        raise ValueError("the prompt is empty after tokenization")
    # A stop word that is one special token (e.g. "<|im_end|>") must stop by id: with
    # skip_special_tokens it never appears in the decoded text that stop strings are matched on.
    stop_ids = []
    special = tok.special_ids
    for seq in tok.stop_words_to_ids(_strings(tensors.get("stop_words"))):
        if len(seq) == 1 and seq[0] in special:
            stop_ids.append(seq[0])
    return {
        "input_ids": np.asarray(ids, dtype=np.int32),
        "stop_token_ids": np.asarray(stop_ids, dtype=np.int32),
    }


def cancel_key_of(tensors: Mapping[str, np.ndarray]) -> str:
    """The engine's cancel key carried by an engine response ("" when it has none)."""
    return _text(_scalar(tensors.get("cancel_key")) or b"")


def forward_cancel(key: str) -> bool:
    """A detokenizer request that Triton marks cancelled: tell the engine (serving/cancel.py)."""
    return bool(key) and notify_cancel(key)


def detokenize_response(tok: Tokenizer, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One engine response -> text_output delta, plus the engine outputs passed through."""
    new = [int(t) for t in np.asarray(tensors["next_tokens"]).reshape(-1)]
    ctx = [int(t) for t in np.asarray(tensors["context_tokens"]).reshape(-1)]
    finished = bool(_scalar(tensors.get("finished")) or False)
    stop, include, skip = parse_detok_params(_text(_scalar(tensors.get("detok_params")) or b""))
    step = decode_step(tok, ctx, new, skip_special_tokens=skip, stop=stop,
                       include_stop_str_in_output=include, finished=finished)
    text = _text(_scalar(tensors.get("prompt_text")) or b"") + step.text
    passthrough: dict[str, Any] = {
        "next_tokens_out": np.asarray(new, dtype=np.int32),
        "finish_reason_out": np.asarray(tensors.get("finish_reason", _bytes(""))).reshape(1).astype(np.object_),
        "num_input_tokens_out": np.asarray(tensors.get("num_input_tokens", [0]), dtype=np.uint32).reshape(1),
        "num_output_tokens_out": np.asarray(tensors.get("num_output_tokens", [0]), dtype=np.uint32).reshape(1),
        "logprobs_out": np.asarray(tensors.get("logprobs", []), dtype=np.float32).reshape(-1),
    }
    return {"text_output": _bytes(text), **passthrough}
