"""The `freetoken` model's runtime: an engine thread that steps the scheduler, a sender thread.

Triton's `execute()` only validates and calls `submit()`; it never waits for the engine. The engine
thread admits new requests, polls cancellation every `cancel_check_interval_ms` (each poll is an IPC
round trip to the server), runs `Scheduler.step()` (or takes the steps of the engine process,
serving/engine_proc/engine_process.py) and hands each step's messages to the sender thread in one item
(serving/stream/sender.py), so a slow `send()` never stalls a step. The sender merges, paces (the
detokenizer's acks) and sends.

Every request gets exactly one FINAL flag: with its last tokens, with its error, or alone after a
client cancel. The Triton objects stay behind `Transport` so this file runs in unit tests too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from freetoken_core.messages import DetokenizeMsg
from freetoken_core.serving.engine_proc.loop_options import LoopOptions
from freetoken_core.serving.triton.metrics import EngineMetrics
from freetoken_core.serving.triton.request import ParsedRequest
from freetoken_core.serving.stream.cancel import CancelChannel
from freetoken_core.serving.engine_proc.faults import is_device_fatal
from freetoken_core.serving.triton.response import build_probe
from freetoken_core.serving.stream.sender import ResponseSender, Transport
from freetoken_core.serving.stream.state import StreamState
from freetoken_core.tokenizer.detokenize import DetokWindow, window_anchors

log = logging.getLogger(__name__)



def queue_full_message(limit: int) -> str:
    """The refusal of a request that finds the queue full (the OpenAI frontend answers it with 429)."""
    return (f"the server is busy: {limit} requests are already waiting to start (max_queued_requests={limit}); "
            "retry later")


@dataclass(eq=False)
class ActiveRequest:
    """A request as the engine thread sees it; what the sender thread reads and writes of it is `stream`."""

    stream: StreamState
    # non-streaming requests: everything is sent once, at the end
    held_tokens: list[int] = field(default_factory=list)
    held_logprobs: list[float] = field(default_factory=list)
    held_top_logprobs: list[dict[int, float]] = field(default_factory=list)
    cancelled: bool = False
    last_probe: float = 0.0


class EngineLoop:
    def __init__(self, scheduler: Any, transport: Transport, options: LoopOptions | None = None,
                 metrics: EngineMetrics | None = None, on_device_fatal: Callable[[str], None] | None = None,
                 owns_scheduler: bool = True) -> None:
        self.sched = scheduler
        # stop() closes the scheduler (its engine, process or ranks) unless it is borrowed (an LLM's, which closes it)
        self.owns_scheduler = owns_scheduler
        # called once (from the engine thread) when the device became unusable (serving/engine_proc/faults.py)
        self.on_device_fatal = on_device_fatal
        self.dead: str | None = None  # why this engine can serve no more (set once, never cleared)
        self.transport = transport
        self.opt = options or LoopOptions()
        self.metrics = metrics or EngineMetrics()
        # the engine runs in another process (serving/engine_proc/engine_process.py EngineClient): its add_request may be called
        # from execute()'s thread, and this loop's engine thread only collects the messages it sends
        self._remote = bool(getattr(scheduler, "remote", False))
        # (handle, request, when execute() handed it over, its uid when execute()'s thread already added it)
        self._inbox: queue.SimpleQueue[tuple[Any, ParsedRequest, float, int | None]] = queue.SimpleQueue()
        # max_queued_requests: requests submit() took (execute()'s thread), and of them those that left the queue:
        # started generating, finished or were refused (the engine thread); each counter has one writer
        self._submitted = 0
        self._dequeued = 0
        # held from an early add_request until its inbox entry is in: a message of that uid waits for it
        self._add_lock = threading.Lock()
        self._wake = threading.Event()
        self._active: dict[int, ActiveRequest] = {}
        # requests whose response could not be sent (client gone): the engine thread aborts them
        self._undeliverable: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # cancels that reach the detokenizer (see cancel.py), and the streams' send order across its instances
        self._cancel_channel = CancelChannel(send_order=self.opt.send_order and self.opt.max_inflight > 0)
        self.sender = ResponseSender(transport, self.opt, self._cancel_channel, self._undeliverable_handle,
                                     inline_max=self.opt.inline_send_max if self._remote else 0,
                                     active_requests=self._active.__len__)
        self._stopping = threading.Event()
        # the tokenizer's anchor table (computed once, here, not on the first request)
        self._anchors = scheduler.tokenizer.anchors
        self._engine_thread = threading.Thread(target=self._engine_main, name="freetoken-engine", daemon=True)

    # --- called from Triton's execute() thread --------------------------------------------------
    def start(self) -> None:
        self._engine_thread.start()
        self.sender.start()

    def submit(self, handle: Any, parsed: ParsedRequest) -> None:
        """Hand a request to the engine thread. With the engine in another process the request goes to it from
        here (execute()'s thread), so the engine starts on it without waiting for this thread's wake-up (~0.17 ms
        at one stream on the H200 host); the engine thread still does everything else it does on admission."""
        t_arrival = time.perf_counter()
        limit = self.opt.max_queued_requests
        if limit and self._submitted - self._dequeued >= limit:
            self.reject(handle, queue_full_message(limit))
            return
        self._submitted += 1
        if not self._remote or self.dead is not None or self._stopping.is_set():
            self._inbox.put((handle, parsed, t_arrival, None))
            self._wake.set()
            return
        with self._add_lock:
            try:
                uid = self.sched.add_request(parsed.input_ids, parsed.params)
            except Exception as e:  # noqa: BLE001  the engine thread refuses it as _admit would have
                self._inbox.put((handle, parsed, t_arrival, e))
            else:
                self._inbox.put((handle, parsed, t_arrival, uid))
        self._wake.set()

    def _refuse_queued(self, handle: Any, error: str) -> None:
        """reject() for a request submit() took: it leaves the queue."""
        self._dequeued += 1
        self.reject(handle, error)

    def reject(self, handle: Any, error: str) -> None:
        """A request that failed validation: one error response carrying the FINAL flag."""
        self.metrics.count_finish("error")
        self._post([(handle, None, error, True, None)])

    def _post(self, items: list[tuple] | None) -> None:
        self.sender.post(items)

    def _undeliverable_handle(self, handle: Any) -> None:
        """From the sender thread: a send failed (the client is gone); the engine thread aborts it."""
        self._undeliverable.put(handle)
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        self._stopping.set()
        self._wake.set()
        if self._engine_thread.is_alive():
            self._engine_thread.join(timeout)
        while True:  # handed over after the engine thread's last look: each still gets its one FINAL
            try:
                handle, _, _, added = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(added, int):
                self.sched.abort(added)
            self._refuse_queued(handle, "the server is shutting down")
        self.sender.stop(timeout)
        self._cancel_channel.close()
        if self.owns_scheduler:  # the engine process (engine_process.py) or tensor-parallel workers stop with the model
            self.sched.close()
        self.metrics.clear_gauges()

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
                    self.metrics.after_step()  # its IPC now, once the step's tokens are with the sender
                idle_timed_out = False
            else:
                idle_timed_out = not self._wake.wait(self.opt.idle_wait_s)
                self._wake.clear()
            # on the timer, and once nothing came for idle_wait_s (the gauges then show the engine idle): not
            # the moment a request ends, when its last response and the next request are on their way
            if now - last_metrics >= self.opt.metrics_interval_s or (idle_timed_out and not self._active):
                self._push_metrics()
                last_metrics = now
        self._admit()  # requests handed over since the last look get their FINAL error below too
        self._fail_all("the server is shutting down")

    def _on_step_failure(self, e: Exception) -> list[DetokenizeMsg]:
        """A step fault fails the requests of the step(s) in flight, and the engine serves on; a
        device fault (sticky CUDA error) fails everything and ends this engine (serving/engine_proc/faults.py)."""
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
                handle, parsed, t_arrival, added = self._inbox.get_nowait()
            except queue.Empty:
                return
            if self.dead is not None:
                self._refuse_queued(handle, self.dead)  # (an early add reached no engine: a dead one takes no commands)
                continue
            t_admitted = time.perf_counter()
            if isinstance(added, int):  # execute()'s thread added it (submit): its tokens may already come
                uid, t_admitted = added, t_arrival
            try:
                if added is None:
                    uid = self.sched.add_request(parsed.input_ids, parsed.params)
                elif isinstance(added, BaseException):
                    raise added
            except ValueError as e:
                self._refuse_queued(handle, str(e))
                continue
            except Exception as e:  # never let one bad request kill the loop
                log.error("add_request failed", exc_info=e)
                self._refuse_queued(handle, f"{type(e).__name__}: {e}")
                continue
            window = DetokWindow(self._anchors, window_anchors(parsed.params.stop)) if parsed.stream else None
            key = self._cancel_channel.register(uid) if parsed.from_ensemble else ""
            stream = StreamState(handle, parsed, uid, t_arrival, window=window, cancel_key=key, t_admitted=t_admitted,
                                 route_tag=self.opt.route_tag)
            self._active[uid] = ActiveRequest(stream, last_probe=t_arrival)
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
            if (uid in cancelled or id(st.stream.handle) in gone) and not st.cancelled:
                st.cancelled = True
                self.sched.abort(uid)

    def _check_cancelled(self) -> None:
        for uid, st in list(self._active.items()):
            if st.cancelled:
                continue
            try:
                cancelled = self.transport.is_cancelled(st.stream.handle)
            except Exception:  # the sender is gone (client disconnected): same as a cancel
                cancelled = True
            if cancelled:
                st.cancelled = True
                self.sched.abort(uid)

    def _send_probes(self, now: float) -> None:
        out = []
        for st in self._active.values():
            if st.stream.parsed.stream or not st.stream.cancel_key or st.cancelled:
                continue  # streams reach the detokenizer anyway; direct clients would see a probe
            if now - st.last_probe >= self.opt.nonstream_probe_interval_s:
                st.last_probe = now
                out.append((st.stream.handle, build_probe(st.stream.cancel_key), None, False, None))
        if out:
            self._post(out)

    def _on_message(self, msg: DetokenizeMsg, out: list[tuple], now: float) -> None:
        """One step's message for one request -> `out`, the step's list for the sender: (stream, msg) for a
        streamed message (the sender merges, holds and builds those), else (handle, outputs, error,
        final, stream) for a response as is (stream: the request's StreamState)."""
        st = self._active.get(msg.uid)
        if st is None:
            if not self._remote:
                return
            with self._add_lock:  # an add on execute()'s thread: its inbox entry is in once this lock is free
                pass
            self._admit()
            st = self._active.get(msg.uid)
            if st is None:
                return
        if msg.next_tokens and st.stream.t_first is None:
            st.stream.t_first = now
            self._dequeued += 1
            self.metrics.observe_ttft(now - st.stream.t_arrival)
        self.metrics.add_generated_tokens(len(msg.next_tokens))
        if msg.finished:
            del self._active[msg.uid]
            if st.stream.t_first is None:  # ended before its first token
                self._dequeued += 1
            self._cancel_channel.unregister(st.stream.cancel_key)
            self.metrics.count_finish(msg.finish_reason or "stop")
            n_out = msg.num_output_tokens
            if st.stream.t_first is not None and n_out > 1:
                self.metrics.observe_tpot((now - st.stream.t_first) / (n_out - 1))
        if st.cancelled and msg.finished:
            out.append((st.stream.handle, None, None, True, st.stream))  # the FINAL flag alone
            return
        if msg.finish_reason == "error" or msg.error:
            out.append((st.stream.handle, None, msg.error or "the engine failed this request", True, st.stream))
            return
        if msg.finish_reason == "abort":
            out.append((st.stream.handle, None, "the request was aborted", True, st.stream))
            return
        if st.stream.parsed.stream:
            out.append((st.stream, msg))  # built by the sender thread, which merges what waits for a request
            return
        st.stream.output_ids.extend(msg.next_tokens)
        st.held_tokens.extend(msg.next_tokens)
        if msg.logprobs:
            st.held_logprobs.extend(msg.logprobs)
        if msg.top_logprobs:
            st.held_top_logprobs.extend(msg.top_logprobs)
        if msg.finished:
            outputs = st.stream.outputs(msg, st.held_tokens, st.held_logprobs if st.stream.parsed.return_logprobs else None,
                                 [], st.stream.parsed.prompt_text, now, top_logprobs=st.held_top_logprobs or None)
            out.append((st.stream.handle, outputs, None, True, st.stream))

    def _fail_all(self, error: str) -> None:
        for uid, st in list(self._active.items()):
            if st.stream.t_first is None:
                self._dequeued += 1
            try:
                self.sched.abort(uid)
            except Exception:
                log.exception("abort(%d) failed", uid)
            self.metrics.count_finish("error")
            self._cancel_channel.unregister(st.stream.cancel_key)
            self._post([(st.stream.handle, None, error, True, st.stream)])
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
