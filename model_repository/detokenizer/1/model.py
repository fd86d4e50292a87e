"""Triton Python model `detokenizer` (stateless): thin glue over freetoken_core.serving.triton.text_models.

Decoupled (config.pbtxt): each request's response goes out with `send()` inside execute, and only
then is it acked to the engine (serving/stream/cancel.py AckSender): the engine keeps a stream's next
response back until the previous one is acked, which keeps every stream in order across several
instances of this model and merges tokens only while this model is behind (with detok_send_order the
instances keep that order themselves, serving/stream/send_order.py, and a stream may have several responses in
flight). A plain (not decoupled) config works too (one response per request, returned from execute; acked
just before the return, so without detok_send_order): then run a single instance, or responses of one
stream may overtake each other."""

import json
import time

import triton_python_backend_utils as pb_utils

from freetoken_core.serving.stream.cancel import AckSender, CancelCheckLimiter, channel_dir
from freetoken_core.serving.engine_proc.gc_freeze import freeze_text_model
from freetoken_core.serving.stream.send_order import SendOrder
from freetoken_core.lifetime import watch_parent
from freetoken_core.serving.triton.text_models import (
    cancel_key_of, check_route, detokenize_response, ensemble_meta_of, forward_cancel, is_probe,
)
from freetoken_core.serving.triton.triton_io import respond_each, model_tokenizer, send_each

INPUTS = ("next_tokens", "context_tokens", "finished", "finish_reason", "stop_reason", "num_input_tokens",
          "num_output_tokens", "num_cached_tokens", "logprobs", "top_logprobs", "top_logprob_ids", "prompt_text", "detok_params", "cancel_key", "probe", "meta")


class TritonPythonModel:
    def initialize(self, args):
        watch_parent("detokenizer stub")
        self.tok = model_tokenizer(args)
        self.cancel_checks = CancelCheckLimiter()  # is_cancelled() is an IPC round trip
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.acks = AckSender()
        self.order = SendOrder(channel_dir)  # a stream's responses in order across instances (detok_send_order)
        self._last_meta = (None, None)  # (inputs, their meta) of the response being sent
        freeze_text_model(args, "detokenizer")

    def _detokenize(self, request, tensors):
        # the client cancelled the ensemble: stop the engine too (probes come rate-limited by the engine)
        key = cancel_key_of(tensors)
        probe = is_probe(tensors)
        if key and (probe or self.cancel_checks.due(key, time.monotonic())) and request.is_cancelled():
            forward_cancel(key)
        if probe and self.decoupled:
            return None  # the FINAL flag alone: nothing reaches the client
        meta = check_route(ensemble_meta_of(tensors))
        self._last_meta = (tensors, meta)  # for _sent, right after this response's send
        out = detokenize_response(self.tok, tensors, meta)
        # another instance may still have this stream's previous response
        if meta is not None and meta.order is not None:
            self.order.wait_turn(*meta.order)
        return out

    def _sent(self, tensors):
        seen, meta = self._last_meta
        if seen is not tensors:  # a probe, or _detokenize failed before reading it
            try:
                meta = check_route(ensemble_meta_of(tensors))
            except ValueError:
                return
        if meta is None:
            return
        if meta.order is not None:
            self.order.sent(*meta.order)
        if meta.ack is not None:
            self.acks.add(*meta.ack)

    def execute(self, requests):
        if self.decoupled:
            send_each(pb_utils, requests, INPUTS, self._detokenize, on_sent=self._sent)
            self.acks.flush()
            return None
        responses = respond_each(pb_utils, requests, INPUTS, self._detokenize, on_done=self._sent)
        self.acks.flush()
        return responses
