"""Triton Python model `freetoken` (decoupled): thin glue over freetoken_core.serving."""

import json

import triton_python_backend_utils as pb_utils

from freetoken_core.serving.triton.freetoken_model import FreetokenModel


class TritonPythonModel:
    def initialize(self, args):
        if not pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"])):
            raise pb_utils.TritonModelException("the freetoken model must be decoupled (model_transaction_policy)")
        self.impl = FreetokenModel(pb_utils, args)

    def execute(self, requests):
        # Only validates and enqueues: responses come from the engine loop's sender thread.
        self.impl.execute(requests)
        return None

    def finalize(self):
        self.impl.finalize()
