"""The `freetoken` model's runtime: an engine thread that steps the scheduler, a sender thread.

Triton's `execute()` only validates and calls `submit()`; it never waits for the engine. The engine
thread admits new requests, polls cancellation every `cancel_check_interval_ms` (each poll is an IPC
round trip to the server), runs `Scheduler.step()` and turns each DetokenizeMsg into a response.
Responses go through a queue to the sender thread, so a slow `send()` never stalls a step: the
engine thread hands over each step's messages in one queue item (the least Python per response on the
thread the engine's speed depends on), and the sender builds and sends them.

Flow control (issue 13): a streamed ensemble response is acked by the detokenizer once it went on
(serving/cancel.py). A stream may have at most `max_inflight` responses not yet acked; its next
tokens wait meanwhile and go out merged in one response as soon as the ack comes. So while the
detokenizer keeps up every step's tokens get their own response (stream_interval = 1), and only while
it is behind (a time-based rule: the previous response is still queued) do steps merge; the first
token never waits. With one in flight per stream, a stream's responses also stay in order across
several detokenizer instances (each acks only after its send returned).

Every request gets exactly one FINAL flag: with its last tokens, with its error, or alone after a
client cancel. The Triton objects stay behind `Transport` so this file runs in unit tests too.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from freetoken_core.messages import DetokenizeMsg
from freetoken_core.serving.metrics import EngineMetrics
from freetoken_core.serving.request import ParsedRequest
from freetoken_core.serving.cancel import CancelChannel
from freetoken_core.serving.faults import is_device_fatal
from freetoken_core.serving.response import build_ensemble_outputs, build_outputs, build_probe
from freetoken_core.tokenizer.detokenize import DetokWindow, window_anchors

log = logging.getLogger(__name__)

# how often a stream's responses carry its cancel key (= CancelCheckLimiter's default interval)
CANCEL_KEY_INTERVAL_S = 0.2


class Transport(Protocol):
    """What the loop needs from Triton's InferenceResponseSender (one `handle` per request)."""

    def send(self, handle: Any, outputs: dict[str, np.ndarray] | None, error: str | None, final: bool) -> None: ...

    def is_cancelled(self, handle: Any) -> bool: ...


@dataclass
class LoopOptions:
    cancel_check_interval_s: float = 0.2
    metrics_interval_s: float = 0.5
    idle_wait_s: float = 0.05
    # streaming: hold a request's tokens until this many are ready (the first token and the last
    # response go out at once). 1 = a response per engine step; larger values trade streaming
    # granularity for fewer responses, each of which costs the ensemble a detokenizer execution.
    stream_interval: int = 1
    # > 0: probe each non-streaming ensemble request this often (response.build_probe), so that a
    # gRPC cancel reaches the engine before the request ends
    nonstream_probe_interval_s: float = 0.0
    # streamed ensemble responses a request may have sent but not yet acked by the detokenizer
    # (0 = no flow control). 1 keeps each stream in order across several detokenizer instances.
    max_inflight: int = 1
    # until the first ack arrives: an ack this late means the detokenizer sends none (flow control turns off)
    ack_timeout_s: float = 1.0
    # once acks are known to arrive: an ack this late counts as lost and its stream goes on (logged). Long,
    # because a late ack that is waited for keeps order across detokenizer instances, one not waited for
    # may not; a stream whose ack never comes is cancelled or failed by the other paths long before
    ack_lost_s: float = 30.0


@dataclass
class ActiveRequest:
    handle: Any
    parsed: ParsedRequest
    uid: int
    t_arrival: float
    t_first: float | None = None
    window: DetokWindow | None = None  # where the detokenizer's context starts (streaming only)
    output_ids: list[int] = field(default_factory=list)
    # non-streaming requests: everything is sent once, at the end
    held_tokens: list[int] = field(default_factory=list)
    held_logprobs: list[float] = field(default_factory=list)
    # streaming requests: whether anything went out yet (sender thread)
    streamed: bool = False
    cancelled: bool = False
    cancel_key: str = ""  # only for requests from the ensemble (ParsedRequest.return_cancel_key)
    last_probe: float = 0.0
    key_sent_at: float | None = None  # when a response last carried cancel_key (sender thread)
    # flow control (sender thread): seq of the next acked response; seq -> when it was sent
    seq: int = 0
    unacked: dict[int, float] = field(default_factory=dict)

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
                                      self.parsed.omit_outputs, ack)


ACK_UID_MASK = 0x7FFFFFFF  # uids travel in an int32 (response meta)


class EngineLoop:
    def __init__(self, scheduler: Any, transport: Transport, options: LoopOptions | None = None,
                 metrics: EngineMetrics | None = None, on_device_fatal: Callable[[str], None] | None = None) -> None:
        self.sched = scheduler
        # called once (from the engine thread) when the device became unusable (serving/faults.py)
        self.on_device_fatal = on_device_fatal
        self.dead: str | None = None  # why this engine can serve no more (set once, never cleared)
        self.transport = transport
        self.opt = options or LoopOptions()
        self.metrics = metrics or EngineMetrics()
        self._inbox: queue.SimpleQueue[tuple[Any, ParsedRequest, float]] = queue.SimpleQueue()
        self._wake = threading.Event()
        # one item per engine step (a list of sends), or None to stop; see _sender_main for the shapes
        self._outbox: queue.SimpleQueue[list[tuple] | None] = queue.SimpleQueue()
        # wakes the sender (select) when the outbox gets an item; acks wake it on their own socket
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._active: dict[int, ActiveRequest] = {}
        # requests whose response could not be sent (client gone): the engine thread aborts them
        self._undeliverable: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._cancel_channel = CancelChannel()  # cancels that reach the detokenizer (see cancel.py)
        # sender thread only: streams that wait for acks (masked uid -> request); whether acks come at all
        self._acked_streams: dict[int, ActiveRequest] = {}
        self._acks_seen = False
        self._flow_control = self.opt.max_inflight > 0
        self._stopping = threading.Event()
        # the tokenizer's anchor table (computed once, here, not on the first request)
        self._anchors = scheduler.tokenizer.anchors
        self._engine_thread = threading.Thread(target=self._engine_main, name="freetoken-engine", daemon=True)
        self._sender_thread = threading.Thread(target=self._sender_main, name="freetoken-sender", daemon=True)

    # --- called from Triton's execute() thread --------------------------------------------------
    def start(self) -> None:
        self._engine_thread.start()
        self._sender_thread.start()

    def submit(self, handle: Any, parsed: ParsedRequest) -> None:
        self._inbox.put((handle, parsed, time.perf_counter()))
        self._wake.set()

    def reject(self, handle: Any, error: str) -> None:
        """A request that failed validation: one error response carrying the FINAL flag."""
        self.metrics.count_finish("error")
        self._post([(handle, None, error, True, None)])

    def _post(self, items: list[tuple] | None) -> None:
        self._outbox.put(items)
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # the pipe is full: the sender is awake anyway (or closed)
            pass

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._engine_thread.is_alive():
            self._engine_thread.join(timeout)
        self._post(None)
        if self._sender_thread.is_alive():
            self._sender_thread.join(timeout)
        self._cancel_channel.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        # the engine process (serving/engine_process.py) and tensor-parallel workers stop with the model
        owner = self.sched if hasattr(self.sched, "close") else getattr(self.sched, "engine", None)
        if hasattr(owner, "close"):
            owner.close()

    # --- engine thread ------------------------------------------------------------------------
    def _engine_main(self) -> None:
        last_cancel_check = last_metrics = 0.0
        while not self._stopping.is_set():
            self._admit()
            self._abort_gone()
            now = time.perf_counter()
            if self._active and now - last_cancel_check >= self.opt.cancel_check_interval_s:
                self._check_cancelled()
                last_cancel_check = now
            if self.opt.nonstream_probe_interval_s and self._active:
                self._send_probes(now)
            if self.sched.has_work() and self.dead is None:
                try:
                    msgs = self.sched.step()
                except Exception as e:  # an engine failure must not hang clients
                    msgs = self._on_step_failure(e)
                if msgs:
                    out: list[tuple] = []
                    now = time.perf_counter()
                    for msg in msgs:
                        self._on_message(msg, out, now)
                    if out:
                        self._post(out)
            else:
                self._wake.wait(self.opt.idle_wait_s)
                self._wake.clear()
            if now - last_metrics >= self.opt.metrics_interval_s or not self._active:
                self._push_metrics()
                last_metrics = now
        self._fail_all("the server is shutting down")

    def _on_step_failure(self, e: Exception) -> list[DetokenizeMsg]:
        """A step fault fails the requests of the step(s) in flight, and the engine serves on; a
        device fault (sticky CUDA error) fails everything and ends this engine (serving/faults.py)."""
        what = f"{type(e).__name__}: {e}"
        if not is_device_fatal(e):
            log.exception("engine step failed: failing the requests of the step(s) in flight")
            try:
                return self.sched.fail_step(f"the engine step running this request failed ({what})")
            except Exception:  # the scheduler could not even clean up: nothing in it can be trusted
                log.exception("recovering from the failed step failed: failing every request")
                self._fail_all(f"the engine failed ({what})")
                return []
        log.critical("the device is unusable (%s): failing every request and unloading this model", what,
                     exc_info=e)
        self.dead = f"the engine's device failed ({what}); this model instance is unloading and serves no more"
        self._fail_all(self.dead)
        if self.on_device_fatal is not None:
            try:
                self.on_device_fatal(self.dead)
            except Exception:
                log.exception("on_device_fatal failed")
        return []

    def _admit(self) -> None:
        while True:
            try:
                handle, parsed, t_arrival = self._inbox.get_nowait()
            except queue.Empty:
                return
            if self.dead is not None:
                self.reject(handle, self.dead)
                continue
            try:
                uid = self.sched.add_request(parsed.input_ids, parsed.params)
            except ValueError as e:
                self.reject(handle, str(e))
                continue
            except Exception as e:  # never let one bad request kill the loop
                log.exception("add_request failed")
                self.reject(handle, f"{type(e).__name__}: {e}")
                continue
            window = DetokWindow(self._anchors, window_anchors(parsed.params.stop)) if parsed.stream else None
            key = self._cancel_channel.register(uid) if parsed.return_cancel_key else ""
            self._active[uid] = ActiveRequest(handle, parsed, uid, t_arrival, window=window, cancel_key=key,
                                              last_probe=t_arrival)
            self.metrics.add_prompt_tokens(len(parsed.input_ids))

    def _abort_gone(self) -> None:
        """Abort requests whose client is gone: a send failed, or a detokenizer saw the cancel."""
        gone = set()
        while True:
            try:
                gone.add(id(self._undeliverable.get_nowait()))
            except queue.Empty:
                break
        cancelled = set(self._cancel_channel.poll())
        if not gone and not cancelled:
            return
        for uid, st in list(self._active.items()):
            if (uid in cancelled or id(st.handle) in gone) and not st.cancelled:
                st.cancelled = True
                self.sched.abort(uid)

    def _check_cancelled(self) -> None:
        for uid, st in list(self._active.items()):
            if st.cancelled:
                continue
            try:
                cancelled = self.transport.is_cancelled(st.handle)
            except Exception:  # the sender is gone (client disconnected): same as a cancel
                cancelled = True
            if cancelled:
                st.cancelled = True
                self.sched.abort(uid)

    def _send_probes(self, now: float) -> None:
        out = []
        for st in self._active.values():
            if st.parsed.stream or not st.cancel_key or st.cancelled:
                continue  # streams reach the detokenizer anyway; direct clients would see a probe
            if now - st.last_probe >= self.opt.nonstream_probe_interval_s:
                st.last_probe = now
                out.append((st.handle, build_probe(st.cancel_key), None, False, None))
        if out:
            self._post(out)

    def _on_message(self, msg: DetokenizeMsg, out: list[tuple], now: float) -> None:
        """One step's message for one request -> `out`, the step's list for the sender: (st, msg) for a
        streamed message (the sender merges, holds and builds those), else (handle, outputs, error,
        final, st) for a response as is."""
        st = self._active.get(msg.uid)
        if st is None:
            return
        if msg.next_tokens and st.t_first is None:
            st.t_first = now
            self.metrics.observe_ttft(now - st.t_arrival)
        self.metrics.add_generated_tokens(len(msg.next_tokens))
        if msg.finished:
            del self._active[msg.uid]
            self._cancel_channel.unregister(st.cancel_key)
            self.metrics.count_finish(msg.finish_reason or "stop")
            n_out = msg.num_output_tokens
            if st.t_first is not None and n_out > 1:
                self.metrics.observe_tpot((now - st.t_first) / (n_out - 1))
        if st.cancelled and msg.finished:
            out.append((st.handle, None, None, True, st))  # the FINAL flag alone
            return
        if msg.finish_reason == "error" or msg.error:
            out.append((st.handle, None, msg.error or "the engine failed this request", True, st))
            return
        if msg.finish_reason == "abort":
            out.append((st.handle, None, "the request was aborted", True, st))
            return
        if st.parsed.stream:
            out.append((st, msg))  # built by the sender thread, which merges what waits for a request
            return
        st.output_ids.extend(msg.next_tokens)
        st.held_tokens.extend(msg.next_tokens)
        if msg.logprobs:
            st.held_logprobs.extend(msg.logprobs)
        if msg.finished:
            outputs = st.outputs(msg, st.held_tokens, st.held_logprobs if st.parsed.return_logprobs else None,
                                 [], st.parsed.prompt_text, now)
            out.append((st.handle, outputs, None, True, st))

    def _fail_all(self, error: str) -> None:
        for uid, st in list(self._active.items()):
            try:
                self.sched.abort(uid)
            except Exception:
                log.exception("abort(%d) failed", uid)
            self.metrics.count_finish("error")
            self._cancel_channel.unregister(st.cancel_key)
            self._post([(st.handle, None, error, True, st)])
        self._active.clear()
        # abort() queues final messages; drain them so the scheduler holds nothing for gone requests
        try:
            while self.dead is None and self.sched.has_work() and not self.sched.running and not self.sched.waiting:
                self.sched.step()
        except Exception:
            log.exception("draining aborted requests failed")

    def _push_metrics(self) -> None:
        try:
            self.metrics.set_engine_stats(self.sched.stats())
        except Exception:
            log.exception("metrics update failed")

    # --- sender thread --------------------------------------------------------------------------
    def _sender_main(self) -> None:
        """Send responses in order per request. Streamed messages of a request that wait (the transport
        was busy, stream_interval, or the flow control's ack) go out merged into one response (all
        their next_tokens). Outbox items are lists of (st, msg) (streamed) and (handle, outputs, error,
        final, st | None) (as is; st's waiting messages go first)."""
        waiting: dict[int, tuple[ActiveRequest, list[DetokenizeMsg]]] = {}  # uid -> messages (in order)
        stopping = False
        while not stopping:
            if self._outbox.empty():
                timeout = None if not waiting else self.opt.ack_timeout_s / 4
                fds = [self._wake_r] + ([self._cancel_channel.ack_sock] if self._acked_streams else [])
                try:
                    select.select(fds, [], [], timeout)
                except (OSError, ValueError):
                    pass
            try:
                os.read(self._wake_r, 1 << 16)
            except (BlockingIOError, OSError):
                pass
            while True:
                try:
                    batch = self._outbox.get_nowait()
                except queue.Empty:
                    break
                if batch is None:
                    stopping = True
                    continue
                for item in batch:
                    if len(item) == 2:
                        st, msg = item
                        entry = waiting.get(st.uid)
                        if entry is None:
                            waiting[st.uid] = (st, [msg])
                        else:
                            entry[1].append(msg)
                        continue
                    handle, outputs, error, final, st = item
                    if st is not None:
                        entry = waiting.pop(st.uid, None)
                        if entry is not None:  # keep order: this request's tokens first
                            self._send_stream(*entry)
                        if final:
                            self._acked_streams.pop(st.uid & ACK_UID_MASK, None)
                    self._send(handle, outputs, error, final)
            if self._acked_streams:
                self._drain_acks()
            now = time.perf_counter()
            for uid in list(waiting):
                st, msgs = waiting[uid]
                if stopping or self._may_send(st, msgs, now):
                    del waiting[uid]
                    self._send_stream(st, msgs)

    def _may_send(self, st: ActiveRequest, msgs: list[DetokenizeMsg], now: float) -> bool:
        finished = msgs[-1].finished
        if st.streamed and not finished and self.opt.stream_interval > 1:
            if sum(len(m.next_tokens) for m in msgs) < self.opt.stream_interval:
                return False
        if not st.unacked or len(st.unacked) < self.opt.max_inflight:
            return True
        # acks lost (or a detokenizer that sends none): such a response counts as delivered
        limit = self.opt.ack_lost_s if self._acks_seen else self.opt.ack_timeout_s
        late = [seq for seq, t in st.unacked.items() if now - t >= limit]
        for seq in late:
            del st.unacked[seq]
        if late and self._acks_seen:
            log.warning("request %d: no ack from the detokenizer for %.0f s; sending on", st.uid, limit)
        if late and not self._acks_seen and self._flow_control:
            log.warning("the detokenizer acks no responses (an older model.py?): streaming without flow "
                        "control, so responses of one stream may overtake each other across instances")
            self._flow_control = False
        return len(st.unacked) < self.opt.max_inflight

    def _drain_acks(self) -> None:
        streams = self._acked_streams
        for arr in self._cancel_channel.poll_acks():
            self._acks_seen = True
            acks = arr.tolist()
            for i in range(0, len(acks) - 1, 2):
                st = streams.get(acks[i])
                if st is not None:
                    st.unacked.pop(acks[i + 1], None)

    def _send_stream(self, st: ActiveRequest, msgs: list[DetokenizeMsg]) -> None:
        last = msgs[-1]
        if len(msgs) == 1:
            tokens, logprobs = last.next_tokens, last.logprobs or None
        else:
            tokens = [t for m in msgs for t in m.next_tokens]
            logprobs = [x for m in msgs for x in (m.logprobs or [])] if any(m.logprobs for m in msgs) else None
        if not tokens and not last.finished:
            return
        now = time.perf_counter()
        ack = None
        if st.cancel_key and st.parsed.detok_acks and not last.finished and self._flow_control:
            uid = st.uid & ACK_UID_MASK
            ack = (self._cancel_channel.engine_id, uid, st.seq)
            st.unacked[st.seq] = now
            st.seq += 1
            self._acked_streams[uid] = st
        context = st.output_ids[st.window.start():]
        outputs = st.outputs(last, tokens, logprobs, context, "", now, ack)
        st.output_ids.extend(tokens)
        st.window.push(tokens)
        st.streamed = True
        if last.finished:
            self._acked_streams.pop(st.uid & ACK_UID_MASK, None)
        self._send(st.handle, outputs, None, last.finished)

    def _send(self, handle: Any, outputs: dict | None, error: str | None, final: bool) -> None:
        try:
            self.transport.send(handle, outputs, error, final)
        except Exception as e:  # a client that went away: stop generating for it
            log.info("send failed (%s: %s): aborting the request", type(e).__name__, e)
            if not final:
                self._undeliverable.put(handle)
                self._wake.set()
