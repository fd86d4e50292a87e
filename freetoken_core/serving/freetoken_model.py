"""The `freetoken` Triton model's body: engine setup, request intake, Triton transport.

model_repository/freetoken/1/model.py only forwards to this class; `pb_utils` is passed in
because it exists only inside the Python-backend stub.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import numpy as np

from freetoken_core.serving.engine_loop import EngineLoop, LoopOptions
from freetoken_core.serving.metrics import TritonMetrics
from freetoken_core.serving.params import (
    engine_config_from_params, parse_model_config_params, serving_options, stream_interval,
)
from freetoken_core.serving.request import parse_request
from freetoken_core.serving.triton_io import input_arrays

log = logging.getLogger("freetoken_core.serving")

INPUT_NAMES = (
    "input_ids", "max_tokens", "stream", "temperature", "top_p", "top_k", "min_p", "seed", "random_seed",
    "min_tokens", "min_length", "ignore_eos", "beam_width", "stop_words", "stop_token_ids", "bad_words",
    "exclude_input_in_output", "return_logprobs", "return_num_input_tokens", "return_num_output_tokens",
    "return_finish_reason", "sampling_parameters", "text_input",
)


class TritonTransport:
    def __init__(self, pb_utils: Any) -> None:
        self.pb = pb_utils

    def send(self, handle: Any, outputs: dict[str, np.ndarray] | None, error: str | None, final: bool) -> None:
        pb = self.pb
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if error is not None:
            handle.send(pb.InferenceResponse(error=pb.TritonError(error)), flags=flags)
        elif outputs is None:
            handle.send(flags=flags)
        else:
            tensors = [pb.Tensor(name, arr) for name, arr in outputs.items()]
            handle.send(pb.InferenceResponse(output_tensors=tensors), flags=flags)

    def is_cancelled(self, handle: Any) -> bool:
        return handle.is_cancelled()


class FreetokenModel:
    def __init__(self, pb_utils: Any, args: dict[str, Any]) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from freetoken_core.scheduler.scheduler import Scheduler

        self.pb = pb_utils
        model_config = json.loads(args["model_config"])
        params = parse_model_config_params(model_config)
        self.options = serving_options(params)
        config = engine_config_from_params(params)
        log.info("starting engine: %s", config)
        self.sched = Scheduler(config)
        self.max_tokens_limit = int(self.options["max_tokens_limit"]) or None
        labels = {"model": args.get("model_name", "freetoken"), "version": str(args.get("model_version", "1"))}
        self.loop = EngineLoop(
            self.sched,
            TritonTransport(pb_utils),
            LoopOptions(
                cancel_check_interval_s=self.options["cancel_check_interval_ms"] / 1000.0,
                metrics_interval_s=self.options["metrics_interval_ms"] / 1000.0,
                stream_interval=stream_interval(self.options),
            ),
            TritonMetrics(pb_utils, labels),
        )
        self.loop.start()
        stats = self.sched.stats()
        log.info("engine ready: %d KV pages of %d tokens", stats.num_total_pages, stats.page_size)

    def execute(self, requests: list[Any]) -> None:
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                parsed = parse_request(input_arrays(pb, request, INPUT_NAMES), self.max_tokens_limit)
            except ValueError as e:
                self.loop.reject(sender, str(e))
                continue
            except Exception as e:  # a malformed tensor must fail only its own request
                log.exception("bad request")
                self.loop.reject(sender, f"invalid request: {type(e).__name__}: {e}")
                continue
            self.loop.submit(sender, parsed)

    def finalize(self) -> None:
        self.loop.stop()
