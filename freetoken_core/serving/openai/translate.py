"""OpenAI request bodies -> ensemble requests. Every field the ensemble cannot honour is refused with a 400 that
names it (never ignored): the engine has no logit bias, no top-logprobs outputs, no structured output,
and the tokenizer step takes no tools or chat-template arguments yet."""

from __future__ import annotations

from typing import Any

from freetoken_core.serving.openai.ensemble_client import EnsembleRequest
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


def chat_request(req: ChatCompletionRequest, model: ServedModel) -> EnsembleRequest:
    _check_common(req, model)
    if req.tools:
        raise _refuse("tools", "the ensemble's tokenizer step takes no tools yet (the chat template cannot render "
                               "them); describe tools in a system message")
    if req.tool_choice not in (None, "none", "auto"):
        raise _refuse("tool_choice", "only 'auto' or 'none' until the ensemble takes tools")
    if req.parallel_tool_calls is not None:
        raise _refuse("parallel_tool_calls", "the ensemble takes no tools yet")
    if req.chat_template_kwargs:
        raise _refuse("chat_template_kwargs", "the ensemble's tokenizer step takes no chat-template arguments yet")
    if req.response_format is not None and req.response_format.type != "text":
        raise _refuse("response_format", f"type {req.response_format.type!r} needs structured output, which this "
                                         "engine does not have yet; only 'text'")
    if req.top_logprobs:
        raise _refuse("top_logprobs", "the ensemble returns only the sampled token's logprob; only 0 is accepted")
    if req.top_logprobs is not None and not req.logprobs:
        raise _refuse("top_logprobs", "needs logprobs=true")
    if not req.messages:
        raise _refuse("messages", "must be a non-empty list of messages")
    max_tokens = req.max_completion_tokens or req.max_tokens
    if max_tokens is None:
        try:
            max_tokens = model.default_max_tokens(model.chat_prompt_tokens(req.messages))
        except ValueError as e:
            raise _refuse("messages", str(e)) from None
    return EnsembleRequest(messages=req.messages, max_tokens=max_tokens, return_logprobs=req.logprobs,
                           **_sampling(req))


def completion_prompt(req: CompletionRequest) -> str:
    """The one text prompt of a completions request."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, str) for p in prompt):
        raise _refuse("prompt", f"one prompt per request (got {len(prompt)}); send one request each")
    raise _refuse("prompt", "token-id prompts are not supported: the ensemble has no input_ids input; send text")


def completion_request(req: CompletionRequest, model: ServedModel) -> EnsembleRequest:
    _check_common(req, model)
    if req.suffix:
        raise _refuse("suffix", "not supported (no fill-in-the-middle); send the request without it")
    if req.best_of not in (None, 1):
        raise _refuse("best_of", f"only best_of=1 is supported (got {req.best_of})")
    if req.logprobs:
        raise _refuse("logprobs", "the ensemble returns only the sampled token's logprob; only 0 is accepted")
    if req.echo and req.logprobs is not None:
        raise _refuse("echo", "echo with logprobs needs the prompt's logprobs, which the ensemble does not return")
    prompt = completion_prompt(req)
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = model.default_max_tokens(model.text_prompt_tokens(prompt))
    return EnsembleRequest(text_input=prompt, max_tokens=max_tokens, return_logprobs=req.logprobs is not None,
                           **_sampling(req))
