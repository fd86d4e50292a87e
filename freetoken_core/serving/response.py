"""Engine responses of the `freetoken` model: DetokenizeMsg -> output tensors (numpy).

Besides `next_tokens`, each response carries `context_tokens`: the output tokens of the request's
decode window (freetoken_core/tokenizer/detokenize.py: from the L-th last "anchor" token on,
tracked by a DetokWindow per request, O(1) per token). The detokenizer is stateless, so this window
is what lets it decode `next_tokens` exactly: no lost leading space, no multi-byte character split
across responses, stop-string prefixes held back. The window stays short however long the output.
"""

from __future__ import annotations

import numpy as np

from freetoken_core.messages import DetokenizeMsg

def _bytes1(s: str | None) -> np.ndarray:
    return np.array([(s or "").encode("utf-8")], dtype=np.object_)


def build_outputs(
    msg: DetokenizeMsg,
    next_tokens: list[int],
    logprobs: list[float] | None,
    context_tokens: list[int],
    prompt_text: str,
    detok_params: str,
    cancel_key: str = "",
    omit: frozenset[str] = frozenset(),
) -> dict[str, np.ndarray]:
    """One response's tensors. `omit` names outputs the client turned off (return_<name>=false);
    `cancel_key` goes out only when set, i.e. only to the ensemble's detokenizer (serving/cancel.py)."""
    stop = msg.stop_reason
    out = {
        "next_tokens": np.asarray(next_tokens, dtype=np.int32),
        "context_tokens": np.asarray(context_tokens, dtype=np.int32),
        "finished": np.array([msg.finished], dtype=bool),
        "finish_reason": _bytes1(msg.finish_reason if msg.finished else ""),
        "stop_reason": _bytes1("" if stop is None else str(stop)),
        "num_input_tokens": np.array([msg.num_prompt_tokens], dtype=np.uint32),
        "num_output_tokens": np.array([msg.num_output_tokens], dtype=np.uint32),
        "logprobs": np.asarray(logprobs or [], dtype=np.float32),
        "spec_accepted": np.array([msg.spec_accepted], dtype=np.uint32),
        "spec_proposed": np.array([msg.spec_proposed], dtype=np.uint32),
        "prompt_text": _bytes1(prompt_text),
        "detok_params": _bytes1(detok_params),
    }
    for name in omit:
        out.pop(name, None)
    if cancel_key:
        out["cancel_key"] = _bytes1(cancel_key)
    return out


# meta[0] bits of an ensemble response (build_ensemble_outputs), read by text_models.detokenize_response
META_FINISHED = 1
META_OMIT = {"finish_reason": 2, "num_input_tokens": 4, "num_output_tokens": 8}


def build_ensemble_outputs(
    msg: DetokenizeMsg,
    next_tokens: list[int],
    logprobs: list[float] | None,
    context_tokens: list[int],
    prompt_text: str,
    detok_params: str,
    cancel_key: str = "",
    omit: frozenset[str] = frozenset(),
    ack: tuple[int, int, int] | None = None,
) -> dict[str, np.ndarray]:
    """A response meant for the ensemble's stateless detokenizer only: what it needs for this one
    response and nothing else (issue 13: each tensor costs the stub, the IPC and the detokenizer's
    input reads). `meta` = [flags, num_input_tokens, num_output_tokens] replaces four scalar tensors;
    strings and empty arrays that equal the detokenizer's defaults are left out (its inputs are
    optional); `cancel_key` only when the caller says it is due (EngineLoop: first response, then
    every cancel_check interval); spec_* and stop_reason are not ensemble outputs, so never sent.
    `ack` = (engine id, uid, seq): the detokenizer acks this response once it sent it on (meta[3:6],
    serving/cancel.py AckSender; the engine's flow control and per-stream order rest on it)."""
    flags = META_FINISHED if msg.finished else 0
    for name in omit:
        flags |= META_OMIT.get(name, 0)
    meta = [flags, msg.num_prompt_tokens, msg.num_output_tokens]
    if ack is not None:
        meta += ack
    out = {
        "next_tokens": np.asarray(next_tokens, dtype=np.int32),
        "meta": np.array(meta, dtype=np.int32),
    }
    if context_tokens:
        out["context_tokens"] = np.asarray(context_tokens, dtype=np.int32)
    if msg.finished and "finish_reason" not in omit:
        out["finish_reason"] = _bytes1(msg.finish_reason)
    if logprobs:
        out["logprobs"] = np.asarray(logprobs, dtype=np.float32)
    if prompt_text:
        out["prompt_text"] = _bytes1(prompt_text)
    if detok_params:
        out["detok_params"] = _bytes1(detok_params)
    if cancel_key:
        out["cancel_key"] = _bytes1(cancel_key)
    return out


def build_probe(cancel_key: str) -> dict[str, np.ndarray]:
    """An internal response of a non-streaming ensemble request, while it runs: the ensemble schedules
    the detokenizer for it, and Triton marks that new step cancelled if the client cancelled (it never
    marks the engine's step in flight). The decoupled detokenizer forwards the cancel and completes
    the probe with the FINAL flag alone, so no client sees it (benchmarks/repro_cancel_signals.py)."""
    empty = np.zeros(0, dtype=np.int32)
    return {
        "next_tokens": empty, "context_tokens": empty, "finished": np.array([False]),
        "stop_reason": _bytes1(""), "logprobs": np.zeros(0, dtype=np.float32), "prompt_text": _bytes1(""),
        "detok_params": _bytes1(""), "cancel_key": _bytes1(cancel_key), "probe": np.array([True]),
    }
