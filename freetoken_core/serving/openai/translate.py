"""OpenAI request bodies -> ensemble requests. Every field the ensemble cannot honour is refused with a 400 that
names it (never ignored): the engine has no logit bias and no structured output (so `response_format` is `text`
only, and a named or `required` `tool_choice` is asked of the model, not enforced)."""

from __future__ import annotations

from typing import Any

from freetoken_core.serving.openai.ensemble_client import EnsembleRequest
from freetoken_core.serving.openai.generation import param_of_message
from freetoken_core.serving.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest
from freetoken_core.serving.openai.served_model import ServedModel


def _refuse(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", param=param)


def check_model(requested: str, model: ServedModel) -> None:
    if requested != model.name:
        raise APIError(404, f"The model '{requested}' does not exist; this server serves '{model.name}'",
                       param="model", code="model_not_found")


def _check_common(req: ChatCompletionRequest | CompletionRequest, model: ServedModel) -> None:
    check_model(req.model, model)
    if req.n not in (None, 1):
        raise _refuse("n", f"only n=1 is supported (got {req.n}); send n requests instead")
    if req.logit_bias:
        raise _refuse("logit_bias", "not supported by this engine; send the request without it")
    if req.stream_options is not None and not req.stream:
        raise _refuse("stream_options", "only allowed with stream=true")


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise _refuse("stop", "stop strings must not be empty")
    return tuple(stops)


def _sampling(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    return dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop_words=_stops(req.stop))


def _check_tools(req: ChatCompletionRequest) -> None:
    names = [(t.get("function") or {}).get("name") for t in req.tools or []]
    choice = req.tool_choice
    if choice not in (None, "none", "auto", "required"):
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
            raise _refuse("tool_choice", "must be 'none', 'auto', 'required' or "
                                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        if name not in names:
            raise _refuse("tool_choice", f"names the function {name!r}, which is not among the tools {names}")
    if choice not in (None, "none") and not req.tools:
        raise _refuse("tool_choice", "needs tools")
    if req.parallel_tool_calls is False:
        raise _refuse("parallel_tool_calls", "false cannot be enforced until structured output lands; leave it out")


def chat_request(req: ChatCompletionRequest, model: ServedModel) -> EnsembleRequest:
    _check_common(req, model)
    _check_tools(req)
    if req.response_format is not None and req.response_format.type != "text":
        raise _refuse("response_format", f"type {req.response_format.type!r} needs structured output, which this "
                                         "engine does not have yet; only 'text'")
    if req.top_logprobs is not None and not req.logprobs:
        raise _refuse("top_logprobs", "needs logprobs=true")
    if not req.messages:
        raise _refuse("messages", "must be a non-empty list of messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        try:
            max_tokens = model.default_max_tokens(
                model.chat_prompt_tokens(req.messages, req.tools, req.chat_template_kwargs))
        except ValueError as e:
            raise _refuse(param_of_message(str(e)) or "messages", str(e)) from None
    return EnsembleRequest(messages=req.messages, tools=req.tools or None,
                           chat_template_kwargs=req.chat_template_kwargs or None, max_tokens=max_tokens,
                           return_logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0, **_sampling(req))


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completions request: text, or token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if not prompt:
        raise _refuse("prompt", "must not be empty")
    raise _refuse("prompt", f"one prompt per request (got {len(prompt)}); send one request each")


def echo_text(req: CompletionRequest, model: ServedModel) -> str:
    """What `echo` puts before the completion: the prompt's text (token ids decoded)."""
    if not req.echo:
        return ""
    prompt = completion_prompt(req)
    return prompt if isinstance(prompt, str) else model.tokenizer.decode(prompt, skip_special_tokens=False)


def completion_request(req: CompletionRequest, model: ServedModel) -> EnsembleRequest:
    _check_common(req, model)
    if req.suffix:
        raise _refuse("suffix", "not supported (no fill-in-the-middle); send the request without it")
    if req.best_of not in (None, 1):
        raise _refuse("best_of", f"only best_of=1 is supported (got {req.best_of})")
    if req.echo and req.logprobs is not None:
        raise _refuse("echo", "echo with logprobs needs the prompt's logprobs, which the ensemble does not return")
    prompt = completion_prompt(req)
    max_tokens = req.max_tokens
    if isinstance(prompt, list):
        try:
            model.tokenizer.check_ids("prompt", prompt)
        except ValueError as e:
            raise _refuse("prompt", str(e)) from None
    if max_tokens is None:
        max_tokens = model.default_max_tokens(len(prompt) if isinstance(prompt, list)
                                              else model.text_prompt_tokens(prompt))
    text, ids = (None, tuple(prompt)) if isinstance(prompt, list) else (prompt, None)
    return EnsembleRequest(text_input=text, input_ids=ids, max_tokens=max_tokens,
                           return_logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0,
                           **_sampling(req))
