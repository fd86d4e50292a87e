"""Glue the Triton Python models share: reading a request's inputs, one response per request."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Mapping

import numpy as np


def input_arrays(pb_utils: Any, request: Any, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The request's inputs among `names` as numpy arrays (absent optional inputs are left out).

    One `request.inputs()` walk instead of a get_input_tensor_by_name per known name: the detokenizer
    knows 13 names and a slim engine response brings 3 (benchmarks/serving_cost.py)."""
    wanted = names if isinstance(names, (set, frozenset)) else frozenset(names)
    return {t.name(): t.as_numpy() for t in request.inputs() if t.name() in wanted}


def model_tokenizer(args: Mapping[str, Any]) -> Any:
    """The tokenizer of the model named by the Triton model's `model_path` parameter.

    The text models encode one short prompt per request (transformers calls the tokenizers library's batch
    encode for it): with that library's thread pool on, each encode is handed to a pool thread and the caller
    woken back, two thread wake-ups on a lone request's way (50-110 us each at the median on the H200 host's
    idle cores, benchmarks/wake_latency.py) for no parallel work. So this process turns the pool off, unless
    TOKENIZERS_PARALLELISM is set (then it is the deployer's choice)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from freetoken_core.serving.params import resolve_model_path
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    params = json.loads(args["model_config"]).get("parameters", {})
    return load_tokenizer(resolve_model_path(params.get("model_path", {}).get("string_value", "")))


def respond_each(
    pb_utils: Any, requests: list[Any], names: Iterable[str], handle: Callable[[Any, dict[str, np.ndarray]], dict],
    on_done: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> list[Any]:
    """One response per request from handle(request, inputs) -> outputs; an exception fails only
    its own request, with its message. on_done(inputs) runs after each request's response was made."""
    names = tuple(names)
    responses = []
    for request in requests:
        tensors: dict[str, np.ndarray] = {}
        try:
            tensors = input_arrays(pb_utils, request, names)
            out = handle(request, tensors)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()]))
        except Exception as e:  # noqa: BLE001
            responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
        if on_done is not None:
            on_done(tensors)
    return responses


def send_each(
    pb_utils: Any, requests: list[Any], names: Iterable[str], handle: Callable[[Any, dict[str, np.ndarray]], dict | None],
    on_sent: Callable[[dict[str, np.ndarray]], None] | None = None,
) -> None:
    """Decoupled models: for each request, handle(request, inputs)'s response and the FINAL flag in one
    send; when it returns None, the FINAL flag alone (no response at all). An exception fails only
    its own request, with its message. on_sent(inputs) runs after each send returned, also after a
    failed one (the detokenizer's delivery ack)."""
    names = tuple(names)
    final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    for request in requests:
        sender = request.get_response_sender()
        tensors: dict[str, np.ndarray] = {}
        try:
            tensors = input_arrays(pb_utils, request, names)
            out = handle(request, tensors)
            response = None if out is None else pb_utils.InferenceResponse(
                [pb_utils.Tensor(k, v) for k, v in out.items()])
        except Exception as e:  # noqa: BLE001
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
        try:
            if response is None:
                sender.send(flags=final)
            else:
                sender.send(response, flags=final)
        finally:
            if on_sent is not None:
                on_sent(tensors)
