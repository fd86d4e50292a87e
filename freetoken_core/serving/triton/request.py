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
    "n", "best_of", "use_beam_search",
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
    # the request came through the ensemble (its tokenizer step proved it: serving/triton/ensemble_secret.py): responses
    # carry a cancel key for the detokenizer (serving/stream/cancel.py); a direct client never sees a cancel field
    from_ensemble: bool = False
    # set by the ensemble's tokenizer step too: its detokenizer acks each streamed response, and the
    # engine paces the stream by them (flow control); a client emulating the tokenizer without a
    # detokenizer that acks leaves it unset and is not paced
    detok_acks: bool = False


# return_<output> inputs: true or absent = send the output, false = leave it out
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


def _coerce_scalar(name: str, value: Any, kind: type) -> Any:
    """One JSON value -> bool / int / float / str, exactly: genai-perf's numbers sent as strings ("128", "0.9",
    "true") convert; any other type (2 for a bool, 1.7 for an integer, null or a number for a string) is refused."""
    what = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}.get(kind, kind.__name__)
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "false", "0"):
                return value.lower() in ("true", "1")
        elif kind is int and not isinstance(value, bool):
            if isinstance(value, int):
                return value
            if isinstance(value, float) and value.is_integer():
                return int(value)
            if isinstance(value, str):
                return int(value)
        elif kind is float and not isinstance(value, bool):
            if isinstance(value, (int, float, str)):
                return float(value)
        elif kind is str and isinstance(value, str):
            return value
    except (TypeError, ValueError, OverflowError):
        pass
    raise ValueError(f"sampling_parameters: {name} must be {what}, got {value!r}")


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """A `sampling_parameters` value -> its SamplingParams field's type (ranges: SamplingParams.validate)."""
    args = typing.get_args(annotation) if _is_union(annotation) else ()
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    if value is None and type(None) in args:
        return None
    if typing.get_origin(base) is list:
        (item_type,) = typing.get_args(base) or (str,)
        if isinstance(value, item_type) and not isinstance(value, bool):  # one stop string or one stop id
            value = [value]
        if not isinstance(value, list):
            raise ValueError(f"sampling_parameters: {name} must be a list of {item_type.__name__} "
                             f"(or one {item_type.__name__}), got {value!r}")
        return [_coerce_scalar(name, v, item_type) for v in value]
    return _coerce_scalar(name, value, base)


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


# Request parameters the models read: none. Triton's HTTP generate endpoints put every JSON key that names no input
# of the model into the request's parameters (gRPC clients may send parameters too), and the ensemble hands them to
# each step: a misspelled input ("max_token") would be ignored silently, so each one is refused by name.
KNOWN_REQUEST_PARAMETERS: frozenset[str] = frozenset()


def check_request_parameters(parameters_json: str) -> None:
    """Refuse a request's parameters (`request.parameters()` of the Python backend, a JSON object) that no model
    reads, naming them."""
    try:
        parameters = json.loads(parameters_json) if parameters_json and parameters_json.strip() else {}
    except json.JSONDecodeError:
        raise ValueError(f"the request's parameters are not a JSON object: {parameters_json[:200]!r}") from None
    unknown = sorted(set(parameters) - KNOWN_REQUEST_PARAMETERS) if isinstance(parameters, dict) else []
    if unknown:
        raise ValueError(f"unknown request field(s) {unknown}: neither an input of this model nor a parameter it "
                         "reads (check the spelling; GET /v2/models/<model>/config lists the inputs, sampling "
                         "settings may also go in the sampling_parameters JSON)")


def parse_request(
    tensors: Mapping[str, np.ndarray],
    max_tokens_limit: int | None = None,
    vocab_size: int | None = None,
    max_nonstream_tokens: int | None = None,
    parameters: str = "",
    from_ensemble: bool = False,
) -> ParsedRequest:
    """Validate one request; raise ValueError with a message that names the bad input or limit.
    parameters: the request's parameters as JSON (check_request_parameters)."""
    check_request_parameters(parameters)
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
    take("presence_penalty", "presence_penalty", float)
    take("frequency_penalty", "frequency_penalty", float)
    take("repetition_penalty", "repetition_penalty", float)
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
    top_n = _scalar(tensors.get("num_top_logprobs"))
    if top_n is not None and int(top_n) != 0:
        kwargs["logprobs"] = int(top_n)  # SamplingParams.validate bounds it
    elif return_logprobs and kwargs.get("logprobs") is None:
        kwargs["logprobs"] = 0
    params = SamplingParams(**kwargs)
    params.validate(max_tokens_limit or None, vocab_size)
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
    omit = frozenset(name for name, flag in flags.items() if flag is not None and not bool(flag))
    if not bool(_scalar(tensors.get("return_num_cached_tokens")) or False):  # sent only when asked
        omit |= {"num_cached_tokens"}
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
