"""StreamState: one request as the response sender sees it (whom to send to, what went out, its flow control).

The engine thread makes it when it admits the request and sets t_first before it posts the request's first
message; from then on the sender thread writes the rest (a send worker only `delivered`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from freetoken_core.messages import DetokenizeMsg
from freetoken_core.serving.triton.request import ParsedRequest
from freetoken_core.serving.triton.response import build_ensemble_outputs, build_outputs
from freetoken_core.tokenizer.detokenize import DetokWindow

# how often a stream's responses carry its cancel key (= CancelCheckLimiter's default interval)
CANCEL_KEY_INTERVAL_S = 0.2


@dataclass(eq=False)
class StreamState:
    handle: Any
    parsed: ParsedRequest
    uid: int
    t_arrival: float  # execute() handed it over
    t_first: float | None = None  # the engine thread had its first token
    t_admitted: float = 0.0  # the engine thread took it from the inbox (its wake-up after execute())
    window: DetokWindow | None = None  # where the detokenizer's context starts (streaming only)
    output_ids: list[int] = field(default_factory=list)
    # whether anything went out yet (streaming)
    streamed: bool = False
    cancel_key: str = ""  # only for requests from the ensemble (ParsedRequest.from_ensemble)
    route_tag: tuple[int, int] = (0, 0)  # LoopOptions.route_tag (serving/triton/ensemble_secret.py)
    key_sent_at: float | None = None  # when a response last carried cancel_key (sender thread)
    # flow control (sender thread): seq of the next acked response; seq -> when it was sent
    seq: int = 0
    unacked: dict[int, float] = field(default_factory=dict)
    order_slot: int | None = None  # its slot in the send-order table (send_order), from its first acked response
    # send workers (sender_threads > 1): responses handed to this request's worker (sender thread) and
    # delivered by it (the worker); one writer each
    handed: int = 0
    delivered: int = 0

    def outputs(self, msg: DetokenizeMsg, tokens: list[int], logprobs: list[float] | None,
                context: list[int], prompt_text: str, now: float,
                ack: tuple[int, int, int] | None = None) -> dict:
        """This response's tensors: the slim ensemble shape for the ensemble's requests (only what the
        detokenizer needs for this one response), the full one for direct clients, whose outputs stay
        as config.pbtxt lists them. The cancel key rides on the first response and then once per
        CANCEL_KEY_INTERVAL_S: the detokenizer asks Triton about a cancel only that often anyway."""
        if not self.cancel_key:
            return build_outputs(msg, tokens, logprobs, context, prompt_text, self.parsed.detok_params, "",
                                 self.parsed.omit_outputs)
        key = ""
        if self.key_sent_at is None or now - self.key_sent_at >= CANCEL_KEY_INTERVAL_S:
            key, self.key_sent_at = self.cancel_key, now
        return build_ensemble_outputs(msg, tokens, logprobs, context, prompt_text, self.parsed.detok_params, key,
                                      self.parsed.omit_outputs, ack, self.order_slot, self.parsed.return_logprobs,
                                      self.route_tag)
