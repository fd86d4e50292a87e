"""Triton Python model `detokenizer` (stateless): thin glue over freetoken_core.serving.text_models."""

import time

import triton_python_backend_utils as pb_utils

from freetoken_core.serving.cancel import CancelCheckLimiter
from freetoken_core.serving.text_models import cancel_key_of, detokenize_response, forward_cancel
from freetoken_core.serving.triton_io import model_tokenizer, respond_each

INPUTS = ("next_tokens", "context_tokens", "finished", "finish_reason", "stop_reason", "num_input_tokens",
          "num_output_tokens", "logprobs", "prompt_text", "detok_params", "cancel_key")


class TritonPythonModel:
    def initialize(self, args):
        self.tok = model_tokenizer(args)
        self.cancel_checks = CancelCheckLimiter()  # is_cancelled() is an IPC round trip

    def _detokenize(self, request, tensors):
        # the client cancelled the ensemble: stop the engine too
        key = cancel_key_of(tensors)
        if self.cancel_checks.due(key, time.monotonic()) and request.is_cancelled():
            forward_cancel(key)
        return detokenize_response(self.tok, tensors)

    def execute(self, requests):
        return respond_each(pb_utils, requests, INPUTS, self._detokenize)
