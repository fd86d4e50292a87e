"""Triton Python model `tokenizer`: thin glue over freetoken_core.serving.triton.text_models."""

import triton_python_backend_utils as pb_utils

from freetoken_core.serving.engine_proc.gc_freeze import freeze_text_model
from freetoken_core.lifetime import watch_parent
from freetoken_core.serving.triton.text_models import tokenize_request
from freetoken_core.serving.triton.triton_io import model_tokenizer, respond_each

INPUTS = ("text_input", "messages", "apply_chat_template", "stop_words")


class TritonPythonModel:
    def initialize(self, args):
        watch_parent("tokenizer stub")
        self.tok = model_tokenizer(args)
        freeze_text_model(args, "tokenizer")

    def execute(self, requests):
        return respond_each(pb_utils, requests, INPUTS, lambda request, tensors: tokenize_request(
            self.tok, tensors, request.parameters()))
