"""LoopOptions: what the engine loop and its response sender run with, resolved for one `freetoken` instance."""

from __future__ import annotations

from dataclasses import dataclass

from freetoken_core.serving.config import ServingConfig

_SERVED = ServingConfig()


@dataclass(frozen=True)
class LoopOptions:
    """What the engine loop runs with: the ServingConfig resolved for one instance (triton/freetoken_model.py
    loop_options: seconds, auto counts, send order as the detokenizer allows). The defaults are ServingConfig's;
    send order and its budget need the ensemble's order table and a decoupled detokenizer, so they stay off until
    loop_options finds them; idle_wait_s, the ack timeouts and inline_send_max are the loop's own constants."""

    cancel_check_interval_s: float = _SERVED.cancel_check_interval_ms / 1000.0
    metrics_interval_s: float = _SERVED.metrics_interval_ms / 1000.0
    idle_wait_s: float = 0.05
    # streaming: hold a request's tokens until this many are ready (the first token and the last
    # response go out at once): ServingConfig.stream_interval
    stream_interval: int = _SERVED.stream_interval
    # > 0: probe each non-streaming ensemble request this often (response.build_probe), so that a
    # gRPC cancel reaches the engine before the request ends
    nonstream_probe_interval_s: float = _SERVED.nonstream_cancel_probe_ms / 1000.0
    # streamed ensemble responses a request may have sent but not yet acked by the detokenizer
    # (0 = no flow control). 1 keeps each stream in order across several detokenizer instances.
    max_inflight: int = 1
    # until the first ack arrives: an ack this late means the detokenizer sends none (flow control turns off)
    ack_timeout_s: float = 1.0
    # once acks are known to arrive: an ack this late counts as lost and its stream goes on (logged). Long,
    # because a late ack that is waited for keeps order across detokenizer instances, one not waited for
    # may not; a stream whose ack never comes is cancelled or failed by the other paths long before
    ack_lost_s: float = 30.0
    # threads that call transport.send (serving/stream/sender.py SendWorkers); 1 = the sender thread itself
    sender_threads: int = 1
    # the detokenizer instances keep each stream's responses in order themselves (serving/stream/send_order.py), so
    # a stream may have max_inflight responses in flight across several instances, and its last response
    # never waits for an ack
    send_order: bool = False
    # > 0 (with send_order): responses this instance's ordered streams may have unacked together, shared out among
    # them; a stream's window is max(max_inflight, inflight_budget // its streams in flight)
    inflight_budget: int = 0
    # with the engine in its own process (its engine thread runs no steps): a step of at most this many items
    # is sent on the engine thread itself while the sender thread is idle (ResponseSender.inline_max; 0 = never)
    inline_send_max: int = 2
    # what the ensemble's slim responses carry to prove they come from this server (serving/triton/ensemble_secret.py)
    route_tag: tuple[int, int] = (0, 0)
