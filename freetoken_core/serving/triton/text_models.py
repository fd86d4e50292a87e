"""Logic of the `tokenizer` and `detokenizer` Triton models (numpy in, numpy out; no Triton imports).

Both are stateless, so any instance count works. The detokenizer reproduces the offline decode
exactly from what each engine response carries (`context_tokens` + `next_tokens`, see
freetoken_core/tokenizer/detokenize.py) plus the request's own stop settings, which the ensemble
feeds it again with every response.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from freetoken_core.serving.stream.cancel import notify_cancel
from freetoken_core.serving.triton.ensemble_secret import ensemble_secret, route_tag
from freetoken_core.serving.triton.chat import (parse_chat_messages, parse_chat_template_kwargs, parse_chat_tools,
                                                tool_call_arguments_as_objects)
from freetoken_core.serving.triton.response import META_LOGPROBS, META_OMIT, EnsembleMeta, read_ensemble_meta
from freetoken_core.serving.triton.request import _scalar, _strings, _text, check_request_parameters, parse_detok_params
from freetoken_core.tokenizer.detokenize import decode_step
from freetoken_core.tokenizer.tokenize import Tokenizer


def _bytes(s: str) -> np.ndarray:
    return np.array([s.encode("utf-8")], dtype=np.object_)


def tokenize_request(tok: Tokenizer, tensors: Mapping[str, np.ndarray], parameters: str = "") -> dict[str, np.ndarray]:
    """text_input / messages (+ apply_chat_template, tools, chat_template_kwargs, stop_words) or input_ids ->
    input_ids, stop_token_ids. parameters: the request's parameters as JSON, where Triton's HTTP generate puts
    unknown (misspelled) fields: refused here, at the ensemble's first step."""
    check_request_parameters(parameters)
    ids = _prompt_ids(tok, tensors)
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
        # proves to the engine that this request comes through the ensemble, whose detokenizer forwards
        # cancels (serving/stream/cancel.py); clients calling `freetoken` directly never get a cancel key
        "ensemble_key": np.array([ensemble_secret().encode()], dtype=np.object_),
        # and that its detokenizer acks each streamed response (the engine's flow control)
        "detok_acks": np.array([True]),
    }


def _prompt_ids(tok: Tokenizer, tensors: Mapping[str, np.ndarray]) -> list[int]:
    text = _scalar(tensors.get("text_input"))
    text = None if text is None else _text(text)
    messages_json = _scalar(tensors.get("messages"))
    messages_json = _text(messages_json) if messages_json is not None and _text(messages_json).strip() else None
    chat = bool(_scalar(tensors.get("apply_chat_template")) or False)
    given_ids = tensors.get("input_ids")
    template_arguments = chat_template_arguments(tensors)
    if template_arguments and not (messages_json is not None or (text is not None and chat and given_ids is None)):
        raise ValueError(f"{' and '.join(template_arguments)}: only with a chat (messages, or text_input with "
                         "apply_chat_template=true)")
    if given_ids is not None:
        if text or messages_json is not None:
            raise ValueError("input_ids: send one prompt (input_ids, text_input or messages), not several")
        ids = [int(t) for t in np.asarray(given_ids).reshape(-1)]
        tok.check_ids("input_ids", ids)
        return ids
    if messages_json is not None:
        if text:  # which one the client meant is a guess either way: refuse instead of picking one
            raise ValueError("send either text_input or messages, not both (messages is the whole chat "
                             "conversation; text_input with apply_chat_template=true is a one-turn chat)")
        messages = tool_call_arguments_as_objects(parse_chat_messages(messages_json))
        return render_chat_ids(tok, messages, template_arguments)
    if text is None:
        raise ValueError("missing input: send text_input (or chat messages as JSON in 'messages', or input_ids)")
    if chat:
        return render_chat_ids(tok, [{"role": "user", "content": text}], template_arguments)
    return tok.encode(text)


def chat_template_arguments(tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """{"tools": [...], "chat_template_kwargs": {...}} of the inputs the request sent (checked), else {}."""
    out: dict[str, Any] = {}
    tools = _scalar(tensors.get("tools"))
    if tools is not None and _text(tools).strip():
        out["tools"] = parse_chat_tools(_text(tools))
    kwargs = _scalar(tensors.get("chat_template_kwargs"))
    if kwargs is not None and _text(kwargs).strip():
        out["chat_template_kwargs"] = parse_chat_template_kwargs(_text(kwargs))
    return out


def render_chat_ids(tok: Tokenizer, messages: list[dict[str, Any]], arguments: Mapping[str, Any]) -> list[int]:
    """The chat's prompt ids with the request's tools and template variables. Tools that the model's template
    does not render are refused: the model would never see them."""
    tools = arguments.get("tools")
    kwargs = dict(arguments.get("chat_template_kwargs") or {})
    if tools and tok.render_chat(messages, True, tools=tools, **kwargs) == tok.render_chat(messages, True, **kwargs):
        raise ValueError("tools: this model's chat template does not render tools (the model would never see "
                         "them); describe them in a system message instead")
    return tok.apply_chat_template(messages, add_generation_prompt=True, **({"tools": tools} if tools else {}),
                                   **kwargs)


def cancel_key_of(tensors: Mapping[str, np.ndarray]) -> str:
    """The engine's cancel key carried by an engine response ("" when it has none)."""
    return _text(_scalar(tensors.get("cancel_key")) or b"")


def is_probe(tensors: Mapping[str, np.ndarray]) -> bool:
    """An engine probe (response.build_probe): no text, nothing for the client."""
    return bool(_scalar(tensors.get("probe")) or False)


def ensemble_meta_of(tensors: Mapping[str, np.ndarray]) -> EnsembleMeta | None:
    """A slim engine response's `meta`, read (response.build_ensemble_outputs); None for the full one."""
    meta = tensors.get("meta")
    return None if meta is None else read_ensemble_meta(meta)


def check_route(meta: EnsembleMeta | None) -> EnsembleMeta | None:
    """A slim response must carry this server's route tag before the detokenizer waits in an order table or acks
    anything for it: a client calling the detokenizer directly is refused at once (serving/triton/ensemble_secret.py)."""
    if meta is not None and meta.route_tag != route_tag():
        raise ValueError("meta is internal to the ensemble: this response was not made by this server's engine")
    return meta


def ack_of(tensors: Mapping[str, np.ndarray]) -> tuple[int, int, int] | None:
    """(engine id, uid, seq) of a response the engine wants acked."""
    m = ensemble_meta_of(tensors)
    return None if m is None else m.ack


def order_of(tensors: Mapping[str, np.ndarray]) -> tuple[int, int, int, int] | None:
    """(engine id, slot, uid, seq) of a response that must follow its stream's previous one across
    detokenizer instances (serving/stream/send_order.py), or None."""
    m = ensemble_meta_of(tensors)
    return None if m is None else m.order


def forward_cancel(key: str) -> bool:
    """A detokenizer request that Triton marks cancelled: tell the engine (serving/stream/cancel.py)."""
    return bool(key) and notify_cancel(key)


def detokenize_response(tok: Tokenizer, tensors: Mapping[str, np.ndarray],
                        meta: EnsembleMeta | None = None) -> dict[str, np.ndarray]:
    """One engine response -> text_output delta, plus the engine outputs passed through.

    Reads both response shapes: the slim ensemble one (`meta`, absent tensors = defaults;
    response.build_ensemble_outputs) and the full one (response.build_outputs). `meta`: the slim
    response's meta already read (ensemble_meta_of), so that a caller that needs it too reads it once."""
    m = meta if meta is not None else ensemble_meta_of(tensors)
    if m is not None:
        new, ctx_ids, finished = m.next_tokens, m.context_tokens.tolist(), m.finished
        passthrough: dict[str, Any] = {"next_tokens_out": new}
        if not m.flags & META_OMIT["finish_reason"]:
            reason = tensors.get("finish_reason")
            passthrough["finish_reason_out"] = (np.asarray(reason).reshape(1).astype(np.object_)
                                                if reason is not None else _EMPTY_STRING)
        if not m.flags & META_OMIT["num_input_tokens"]:
            passthrough["num_input_tokens_out"] = np.array([m.num_input_tokens], dtype=np.uint32)
        if not m.flags & META_OMIT["num_output_tokens"]:
            passthrough["num_output_tokens_out"] = np.array([m.num_output_tokens], dtype=np.uint32)
        if not m.flags & META_OMIT["num_cached_tokens"]:  # sent only when the client asked for it
            passthrough["num_cached_tokens_out"] = np.array([m.num_cached_tokens], dtype=np.uint32)
    else:
        if "next_tokens" not in tensors:
            raise ValueError("an engine response without next_tokens or meta")
        new = np.asarray(tensors["next_tokens"], dtype=np.int32).reshape(-1)
        ctx = tensors.get("context_tokens")
        ctx_ids = [] if ctx is None else np.asarray(ctx).reshape(-1).tolist()
        passthrough = {"next_tokens_out": new}
        finished = bool(_scalar(tensors.get("finished")) or False)
        # Outputs the engine left out (the client sent return_<name>=false) stay out: the ensemble then
        # leaves them out of its response too (Triton 2.51 skips an ensemble output no step produced).
        if "finish_reason" in tensors:
            passthrough["finish_reason_out"] = np.asarray(tensors["finish_reason"]).reshape(1).astype(np.object_)
        for name in ("num_input_tokens", "num_output_tokens", "num_cached_tokens"):
            if name in tensors:
                passthrough[f"{name}_out"] = np.asarray(tensors[name], dtype=np.uint32).reshape(1)
    params = tensors.get("detok_params")
    stop, include, skip = parse_detok_params(_text(_scalar(params) or b"")) if params is not None else _DEFAULT_DETOK
    new_ids = new.tolist()
    tok.check_ids("next_tokens", new_ids)  # a direct call may send any ids: no empty text for a non-token
    tok.check_ids("context_tokens", ctx_ids)
    step = decode_step(tok, ctx_ids, new_ids, skip_special_tokens=skip, stop=stop,
                       include_stop_str_in_output=include, finished=finished)
    prompt = tensors.get("prompt_text")
    text = step.text if prompt is None else _text(_scalar(prompt) or b"") + step.text
    for name in ("top_logprobs", "top_logprob_ids"):  # sent only when the client asked for them
        if name in tensors:
            passthrough[f"{name}_out"] = np.asarray(tensors[name]).reshape(-1)
    logprobs = tensors.get("logprobs")
    if m is None or m.flags & META_LOGPROBS:  # the slim response says whether the client asked for logprobs
        passthrough["logprobs_out"] = (_EMPTY_FLOAT if logprobs is None
                                       else np.asarray(logprobs, dtype=np.float32).reshape(-1))
    return {"text_output": _bytes(text), **passthrough}


_EMPTY_STRING = np.array([b""], dtype=np.object_)
_EMPTY_FLOAT = np.zeros(0, dtype=np.float32)
_DEFAULT_DETOK: tuple[list[str], bool, bool] = ([], False, True)
