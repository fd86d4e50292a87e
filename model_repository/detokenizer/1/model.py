"""Triton Python model `detokenizer` (stateless): thin glue over freetoken_core.serving.text_models."""

import json

import triton_python_backend_utils as pb_utils

from freetoken_core.serving.text_models import detokenize_response, forward_cancel
from freetoken_core.serving.params import resolve_model_path
from freetoken_core.tokenizer.tokenize import load_tokenizer

INPUTS = ("next_tokens", "context_tokens", "finished", "finish_reason", "stop_reason", "num_input_tokens",
          "num_output_tokens", "logprobs", "prompt_text", "detok_params", "cancel_key")


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.tok = load_tokenizer(resolve_model_path(params.get("model_path", {}).get("string_value", "")))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = {}
                for name in INPUTS:
                    t = pb_utils.get_input_tensor_by_name(request, name)
                    if t is not None:
                        tensors[name] = t.as_numpy()
                if request.is_cancelled():  # the client cancelled the ensemble: stop the engine too
                    forward_cancel(tensors)
                out = detokenize_response(self.tok, tensors)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in out.items()]))
            except Exception as e:  # noqa: BLE001
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
        return responses
