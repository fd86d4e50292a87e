"""Request tensors of the `freetoken` model -> token ids + SamplingParams + response options.

Kept free of Triton imports: callers hand in {input name: numpy array}, so this is unit-tested
without a server. Names follow what Triton LLM clients already send: the TensorRT-LLM ensemble
(`max_tokens`, `min_length`, `random_seed`, `stop_words`, `beam_width`) and the vLLM backend
(`sampling_parameters` JSON, whose values genai-perf sends as strings, `exclude_input_in_output`).
Precedence: SamplingParams defaults < `sampling_parameters` JSON < explicit tensors.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from freetoken_core.config import SamplingParams

# vLLM SamplingParams keys we do not implement: refused by name instead of silently ignored.
_UNSUPPORTED_VLLM_KEYS = {
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "use_beam_search",
    "length_penalty", "early_stopping", "prompt_logprobs", "bad_words", "logits_processors",
    "truncate_prompt_tokens", "guided_decoding", "logit_bias", "allowed_token_ids",
}


@dataclass
class ParsedRequest:
    input_ids: list[int]
    params: SamplingParams
    stream: bool = False
    # Default True: text_output holds generated text only. Explicit False on a non-streaming
    # request prepends the prompt text (the vLLM backend's echo).
    exclude_input_in_output: bool = True
    return_logprobs: bool = False
    prompt_text: str = ""  # put before the output (non-streaming echo), else ""
    detok_params: str = ""  # the detokenizer's settings as JSON ("" = defaults)
    # outputs the client turned off (return_finish_reason / return_num_input_tokens /
    # return_num_output_tokens = false): left out of every response, as TensorRT-LLM's ensemble does
    omit_outputs: frozenset[str] = frozenset()
    # the request came through the ensemble (its tokenizer step proved it: serving/ensemble_secret.py): responses
    # carry a cancel key for the detokenizer (serving/cancel.py); a direct client never sees a cancel field
    from_ensemble: bool = False
    # set by the ensemble's tokenizer step too: its detokenizer acks each streamed response, and the
    # engine paces the stream by them (flow control); a client emulating the tokenizer without a
    # detokenizer that acks leaves it unset and is not paced
    detok_acks: bool = False


# return_<output> inputs: true = send the output, false = leave it out, absent = send it unless the serving parameter
# optional_outputs is "asked"
OPTIONAL_OUTPUTS = ("finish_reason", "num_input_tokens", "num_output_tokens")


def _scalar(arr: np.ndarray | None) -> Any:
    if arr is None:
        return None
    flat = np.asarray(arr).reshape(-1)
    if flat.size == 0:
        return None
    if flat.size != 1:
        raise ValueError(f"expected one value, got shape {list(np.asarray(arr).shape)}")
    v = flat[0]
    return v.item() if hasattr(v, "item") else v


def _text(v: Any) -> str:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("string input is not valid UTF-8") from None
    return str(v)


def _strings(arr: np.ndarray | None) -> list[str]:
    if arr is None:
        return []
    return [_text(v) for v in np.asarray(arr).reshape(-1) if _text(v) != ""]


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """genai-perf sends sampling_parameters values as strings ("128"): convert by field type."""
    args = typing.get_args(annotation) if _is_union(annotation) else ()
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    origin = typing.get_origin(base)
    if value is None and type(None) in args:
        return None
    try:
        if base is bool:
            if isinstance(value, str):
                if value.lower() in ("true", "1"):
                    return True
                if value.lower() in ("false", "0"):
                    return False
                raise ValueError
            return bool(value)
        if base is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError
                return int(value)
            return int(value)
        if base is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if origin is list:
            if isinstance(value, (str, int)):
                value = [value]
            (item_type,) = typing.get_args(base) or (str,)
            return [item_type(v) for v in value]
    except (TypeError, ValueError):
        raise ValueError(f"sampling_parameters: {name}={value!r} is not a valid {getattr(base, '__name__', base)}") from None
    return value


def parse_sampling_parameters(text: str) -> dict[str, Any]:
    """The vLLM-backend `sampling_parameters` JSON string -> SamplingParams keyword arguments."""
    try:
        raw = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"sampling_parameters is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"sampling_parameters must be a JSON object, got {type(raw).__name__}")
    unsupported = sorted(set(raw) & _UNSUPPORTED_VLLM_KEYS)
    if unsupported:
        raise ValueError(f"sampling_parameters: unsupported key(s) {unsupported}")
    hints = typing.get_type_hints(SamplingParams)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"sampling_parameters: unknown key(s) {unknown}; known: {sorted(known)}")
    return {k: _coerce(k, v, hints[k]) for k, v in raw.items()}


def parse_request(
    tensors: Mapping[str, np.ndarray],
    max_tokens_limit: int | None = None,
    vocab_size: int | None = None,
    max_nonstream_tokens: int | None = None,
    send_unasked_outputs: bool = True,
    from_ensemble: bool = False,
) -> ParsedRequest:
    """Validate one request; raise ValueError with a message that names the bad input or limit.
    send_unasked_outputs (serving parameter optional_outputs): whether an optional output whose return_<name> input
    the client left out is sent (True, "all") or only one it asked for (False, "asked": the vLLM backend's rule)."""
    ids = tensors.get("input_ids")
    if ids is None:
        raise ValueError("missing required input 'input_ids'")
    ids = np.asarray(ids).reshape(-1)
    if ids.size == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be integers, got {ids.dtype}")
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        raise ValueError(f"input_ids must be in [0, {vocab_size if vocab_size is not None else 'vocab'}), "
                         f"got values in [{int(ids.min())}, {int(ids.max())}]")

    kwargs: dict[str, Any] = {}
    sp = _scalar(tensors.get("sampling_parameters"))
    if sp is not None:
        kwargs.update(parse_sampling_parameters(_text(sp)))

    def take(tensor_name: str, field: str, conv=lambda v: v) -> None:
        v = _scalar(tensors.get(tensor_name))
        if v is not None:
            kwargs[field] = conv(v)

    take("max_tokens", "max_tokens", int)
    take("temperature", "temperature", float)
    take("top_p", "top_p", float)
    take("top_k", "top_k", int)
    take("min_p", "min_p", float)
    take("random_seed", "seed", int)  # TensorRT-LLM's name
    take("seed", "seed", int)
    take("min_length", "min_tokens", int)  # TensorRT-LLM's name (genai-perf sends it)
    take("min_tokens", "min_tokens", int)
    take("ignore_eos", "ignore_eos", bool)
    stops = _strings(tensors.get("stop_words"))
    if stops:
        kwargs["stop"] = list(kwargs.get("stop") or []) + stops
    stop_ids = tensors.get("stop_token_ids")
    if stop_ids is not None and np.asarray(stop_ids).size:
        kwargs["stop_token_ids"] = list(kwargs.get("stop_token_ids") or []) + [int(t) for t in np.asarray(stop_ids).reshape(-1)]
    if _strings(tensors.get("bad_words")):
        raise ValueError("bad_words is not supported by this engine; send the request without it")
    beam = _scalar(tensors.get("beam_width"))
    if beam is not None and int(beam) != 1:
        raise ValueError(f"beam_width={beam} is not supported (only 1: no beam search)")

    return_logprobs = bool(_scalar(tensors.get("return_logprobs")) or False)
    if return_logprobs and kwargs.get("logprobs") is None:
        kwargs["logprobs"] = 0
    params = SamplingParams(**kwargs)
    params.validate(max_tokens_limit or None)
    exclude = _scalar(tensors.get("exclude_input_in_output"))
    exclude = True if exclude is None else bool(exclude)
    stream = bool(_scalar(tensors.get("stream")) or False)
    if not stream and max_nonstream_tokens and params.max_tokens > max_nonstream_tokens:
        raise ValueError(
            f"max_tokens={params.max_tokens} exceeds max_nonstream_tokens={max_nonstream_tokens}, the server's "
            "limit for a non-streaming request (a client that leaves HTTP /generate is not noticed before the "
            "reply, so the server bounds the work): stream longer outputs (generate_stream, or stream=true)")
    prompt = _scalar(tensors.get("text_input"))
    flags = {name: _scalar(tensors.get(f"return_{name}")) for name in OPTIONAL_OUTPUTS}
    omit = frozenset(name for name, flag in flags.items()
                     if (not send_unasked_outputs if flag is None else not bool(flag)))
    return ParsedRequest(
        input_ids=[int(t) for t in ids],
        params=params,
        stream=stream,
        exclude_input_in_output=exclude,
        return_logprobs=params.logprobs is not None,
        prompt_text=_text(prompt) if (prompt is not None and not exclude and not stream) else "",
        detok_params=detok_params_json(params),
        omit_outputs=omit,
        from_ensemble=from_ensemble,
        detok_acks=bool(_scalar(tensors.get("detok_acks")) or False),
    )


def detok_params_json(params: SamplingParams) -> str:
    """What the stateless detokenizer must know about a request, as JSON; "" when all are defaults."""
    d: dict[str, Any] = {}
    if params.stop:
        d["stop"] = list(params.stop)
    if params.include_stop_str_in_output:
        d["include_stop_str_in_output"] = True
    if not params.skip_special_tokens:
        d["skip_special_tokens"] = False
    return json.dumps(d) if d else ""


def parse_detok_params(text: str) -> tuple[list[str], bool, bool]:
    """(stop strings, include_stop_str_in_output, skip_special_tokens) from detok_params_json's output."""
    d = json.loads(text) if text.strip() else {}
    return list(d.get("stop", [])), bool(d.get("include_stop_str_in_output", False)), bool(d.get("skip_special_tokens", True))
