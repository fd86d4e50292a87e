"""Triton Python model `detokenizer` (stateless): thin glue over freetoken_core.serving.text_models.

Plain (one response per request, returned from execute) by default; decoupled when the engine's
non-streaming probes are on (nonstream_cancel_probe_ms), because only a decoupled model can end a
probe request with no response, so that no client sees it (freetoken_core/serving/cancel.py)."""

import json
import time

import triton_python_backend_utils as pb_utils

from freetoken_core.serving.cancel import CancelCheckLimiter
from freetoken_core.serving.text_models import cancel_key_of, detokenize_response, forward_cancel, is_probe
from freetoken_core.serving.triton_io import model_tokenizer, respond_each, send_each

INPUTS = ("next_tokens", "context_tokens", "finished", "finish_reason", "stop_reason", "num_input_tokens",
          "num_output_tokens", "logprobs", "prompt_text", "detok_params", "cancel_key", "probe", "meta")


class TritonPythonModel:
    def initialize(self, args):
        self.tok = model_tokenizer(args)
        self.cancel_checks = CancelCheckLimiter()  # is_cancelled() is an IPC round trip
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))

    def _detokenize(self, request, tensors):
        # the client cancelled the ensemble: stop the engine too (probes come rate-limited by the engine)
        key = cancel_key_of(tensors)
        probe = is_probe(tensors)
        if key and (probe or self.cancel_checks.due(key, time.monotonic())) and request.is_cancelled():
            forward_cancel(key)
        if probe and self.decoupled:
            return None  # the FINAL flag alone: nothing reaches the client
        return detokenize_response(self.tok, tensors)

    def execute(self, requests):
        if self.decoupled:
            send_each(pb_utils, requests, INPUTS, self._detokenize)
            return None
        return respond_each(pb_utils, requests, INPUTS, self._detokenize)
