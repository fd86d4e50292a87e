"""The `freetoken` model's sender thread: every response goes out here, in order per request.

The engine thread (serving/engine_proc/engine_loop.py) hands over each engine step's messages as one outbox item
(the least Python per response on the thread the engine's speed depends on); this thread builds and
sends them. Streamed messages of a request that wait (the transport was busy, stream_interval, or the
flow control's ack) go out merged into one response (all their next_tokens).

Flow control (issue 13): a streamed ensemble response is acked by the detokenizer once it went on
(serving/stream/cancel.py). A stream may have at most `max_inflight` responses not yet acked; its next
tokens wait meanwhile and go out merged in one response as soon as the ack comes. So while the
detokenizer keeps up every step's tokens get their own response (stream_interval = 1), and only while
it is behind do steps merge; the first token never waits. With one in flight per stream, a stream's
responses also stay in order across several detokenizer instances (each acks only after its send
returned). With `send_order` the instances keep that order themselves (serving/stream/send_order.py): the
sender gives each acked stream a slot of the order table and numbers all its responses, the last one
too, so a stream may have max_inflight in flight and its last response never waits for an ack.

With an inflight budget (`detok_inflight_budget`) an ordered stream's window grows when the instance has few
streams in flight: the budget shared among them, never below max_inflight.

Every REPORT_INTERVAL_S while it sends, the thread logs its rate and where a response's time goes
(`send()` itself, the ack round trip through the ensemble, and a stream's first response split into the
engine thread's wake-up, the engine's time to the first token and the hand-off to this thread), so a served
benchmark shows which part of the served path sets the pace.
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

from freetoken_core.messages import DetokenizeMsg
from freetoken_core.serving.stream.cancel import CancelChannel
from freetoken_core.serving.report import REPORT_INTERVAL_S, percentile
from freetoken_core.serving.engine_proc.loop_options import LoopOptions
from freetoken_core.serving.stream.send_order import SlotAllocator
from freetoken_core.serving.stream.state import StreamState


log = logging.getLogger(__name__)

ACK_UID_MASK = 0x7FFFFFFF  # uids travel in an int32 (response meta)
RETIRE_GRACE_S = 1.0  # a slot whose stream ended without a last response through the detokenizer


class Transport(Protocol):
    """What the loop needs from Triton's InferenceResponseSender (one `handle` per request)."""

    def send(self, handle: Any, outputs: dict | None, error: str | None, final: bool) -> None: ...

    def is_cancelled(self, handle: Any) -> bool: ...


@dataclass
class SenderReport:
    """What the sender did since the last report (sender thread only)."""

    t0: float = field(default_factory=time.perf_counter)
    responses: int = 0
    tokens: int = 0
    send_s: list[float] = field(default_factory=list)  # each transport.send()
    ack_rtt_s: list[float] = field(default_factory=list)  # a streamed response's send -> its ack
    # a stream's first response: (execute() -> engine thread, engine thread -> its first token, that token ->
    # this thread builds the response), where a request's time to its first token goes inside this model
    first_s: list[tuple[float, float, float]] = field(default_factory=list)
    inline: int = 0  # posts built and sent on the posting thread (ResponseSender.inline_max)
    direct: int = 0  # responses sent by the building thread although send workers run (a lone request's)

    def line(self, now: float) -> str:
        dt = max(now - self.t0, 1e-9)
        send, rtt = sorted(self.send_s), sorted(self.ack_rtt_s)
        text = (f"sender: {self.responses / dt:.0f} responses/s, {self.tokens / dt:.0f} streamed tokens/s "
                f"({self.tokens / max(self.responses, 1):.2f} per response), send() p50/p99 "
                f"{1e6 * percentile(send, 0.5):.0f}/{1e6 * percentile(send, 0.99):.0f} us, busy "
                f"{sum(send) / dt:.0%}")
        if self.inline:
            text += f", {self.inline} posts sent inline"
        if self.direct:
            text += f", {self.direct} responses sent without a send worker"
        if rtt:
            text += (f", detokenizer ack round trip p50/p99 {1e3 * percentile(rtt, 0.5):.1f}/"
                     f"{1e3 * percentile(rtt, 0.99):.1f} ms")
        if self.first_s:
            wake, engine, to_sender = (sorted(part) for part in zip(*self.first_s))
            text += (f", first response p50: engine thread woken {1e6 * percentile(wake, 0.5):.0f} us, first token "
                     f"{1e3 * percentile(engine, 0.5):.2f} ms later, at the sender {1e6 * percentile(to_sender, 0.5):.0f}"
                     f" us after that")
        return text


class SendWorkers:
    """Threads that call transport.send for the sender thread (`sender_threads` > 1).

    Triton's `InferenceResponseSender.send()` releases the GIL and waits for the server to take the
    response (python_backend's ResponseSender::Send: one IPC round trip to a server thread per
    response), so one thread has at most one response in flight. Several workers keep several in
    flight. A request always goes to the same worker (by its handle), so its responses stay in order;
    its next streamed response waits until the last one was delivered (`StreamState.handed` /
    `delivered`), so a backlog merges into fewer responses instead of piling up in a queue."""

    def __init__(self, count: int, deliver: Callable[[tuple], None]) -> None:
        self._deliver = deliver
        self._queues: list[queue.SimpleQueue[tuple | None]] = [queue.SimpleQueue() for _ in range(count)]
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"freetoken-send-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    def put(self, item: tuple) -> None:
        # by the handle, so a request's responses (streamed, probes, its final) share one queue; mixed,
        # because object addresses are multiples of 16 or 64 and would all land on one worker
        h = ((id(item[0]) >> 4) * 2654435761) & 0xFFFFFFFF
        self._queues[(h >> 16) % len(self._queues)].put(item)

    def _run(self, q: "queue.SimpleQueue[tuple | None]") -> None:
        while True:
            item = q.get()
            if item is None:
                return
            self._deliver(item)

    def stop(self, timeout: float) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout)


class ResponseSender:
    """The sender thread. `post` takes a list of items (one engine step's), or None to stop:
    (st, msg) for a streamed message (merged, held and built here), (handle, outputs, error, final,
    st | None) for a response as is (st's waiting messages go first).

    `inline_max` > 0: a post of at most that many items, made while this thread is idle and nothing is queued
    ahead of it, is built and sent on the posting thread itself (under the same lock this thread holds while it
    works, so every state below has one writer at a time and each request's order holds). At one stream that
    takes a thread hand-off (~0.1 ms on the H200 host: a pipe wake-up) off the first and the last response's
    way; under load this thread is rarely idle and the posts queue as before. Only for a posting thread that
    can afford a send() (the engine process's instance: its engine thread runs no steps)."""

    def __init__(self, transport: Transport, options: LoopOptions, cancel_channel: CancelChannel,
                 on_undeliverable: Callable[[Any], None], inline_max: int = 0,
                 active_requests: Callable[[], int] | None = None) -> None:
        self.transport = transport
        self.opt = options
        self.inline_max = inline_max
        # how many requests this model instance has in flight (read from here: the engine thread keeps the count)
        self._active_requests = active_requests
        # held by whichever thread builds and sends: this one between its waits, or a poster sending inline
        self._lock = threading.Lock()
        # streamed messages that wait (uid -> the request and its messages, in order)
        self._waiting: dict[int, tuple[StreamState, list[DetokenizeMsg]]] = {}
        self._stopping = False
        self.inline_posts = 0  # how many posts went out on the posting thread (tests, the report)
        self._cancel_channel = cancel_channel
        self._on_undeliverable = on_undeliverable  # a send failed (client gone): the engine aborts it
        self._outbox: queue.SimpleQueue[list[tuple] | None] = queue.SimpleQueue()
        # wakes the thread (select) when the outbox gets an item; acks wake it on their own socket
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # streams that wait for acks (masked uid -> request); whether acks come at all
        self._acked_streams: dict[int, StreamState] = {}
        self._acks_seen = False
        # send_order: slots of the order table; finished streams' slots wait here (masked uid -> slot, the
        # seq of their last response or -1 when none goes through the detokenizer, since when) until that
        # response is acked, so that no response still waiting on the slot sees it reused
        self._slots = SlotAllocator(cancel_channel.order) if cancel_channel.order is not None else None
        self._retiring: dict[int, tuple[int, int, float]] = {}
        self._next_retire_check = 0.0
        self._flow_control = self.opt.max_inflight > 0
        self._report = SenderReport()
        self._workers = SendWorkers(options.sender_threads, self._deliver) if options.sender_threads > 1 else None
        self._thread = threading.Thread(target=self._run, name="freetoken-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def post(self, items: list[tuple] | None) -> None:
        if items is not None and 0 < len(items) <= self.inline_max and self._send_inline(items):
            return
        self._outbox.put(items)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # the pipe is full: the sender is awake anyway (or closed)
            pass

    def _send_inline(self, items: list[tuple]) -> bool:
        """Build and send `items` on this (the posting) thread when the sender thread is idle and nothing waits
        in the outbox (so nothing posted earlier is still unsent); False: post them as usual."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if not self._outbox.empty() or self._stopping:
                return False
            listening = bool(self._acked_streams or self._retiring)
            self._take(items)
            self._send_due(time.perf_counter())
            self.inline_posts += 1
            self._report.inline += 1
            # the sender thread chose its wait before this: wake it when it must now wait otherwise (acks to
            # listen for, messages held back for an ack)
            wake = bool(self._waiting) or (not listening and bool(self._acked_streams or self._retiring))
        finally:
            self._lock.release()
        if wake:
            self._wake()
        return True

    def stop(self, timeout: float) -> None:
        self.post(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._workers is not None:  # after the sender thread: everything it handed over goes out
            self._workers.stop(timeout)
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _run(self) -> None:
        while True:
            if self._outbox.empty():
                with self._lock:  # what a poster sent inline meanwhile may have changed what to wait for
                    timeout = None if not self._waiting else self.opt.ack_timeout_s / 4
                    listen = self._acked_streams or self._retiring
                fds = [self._wake_r] + ([self._cancel_channel.ack_sock] if listen else [])
                try:
                    select.select(fds, [], [], timeout)
                except (OSError, ValueError):
                    pass
            try:
                os.read(self._wake_r, 1 << 16)
            except (BlockingIOError, OSError):
                pass
            with self._lock:
                while True:
                    try:
                        batch = self._outbox.get_nowait()
                    except queue.Empty:
                        break
                    if batch is None:
                        self._stopping = True
                        continue
                    self._take(batch)
                now = time.perf_counter()
                self._send_due(now)
                if now - self._report.t0 >= REPORT_INTERVAL_S:
                    if self._report.responses:
                        line = self._report.line(now)
                        if self.opt.inflight_budget > 0:  # what the budget gives a stream now
                            line += (f", window {self._ordered_window()} a stream ({len(self._acked_streams)} "
                                     f"streams in flight here)")
                        log.info("%s", line)
                    self._report = SenderReport(t0=now)
                if self._stopping:
                    return

    def _take(self, batch: list[tuple]) -> None:
        """One post's items: streamed messages join their request's waiting ones; a response as is goes out now,
        after its request's waiting messages (with the lock held)."""
        waiting = self._waiting
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
                    self._retire(st, -1)
            self._send(handle, outputs, error, final)

    def _send_due(self, now: float) -> None:
        """Take the acks that came, free retired slots, send each waiting stream whose turn it is (with the lock
        held; all of them when stopping)."""
        if self._acked_streams or self._retiring:
            self._drain_acks()
        if self._retiring and now >= self._next_retire_check:
            self._free_retired(now)
            self._next_retire_check = now + 0.1
        waiting = self._waiting
        due = [uid for uid, (st, msgs) in waiting.items() if self._stopping or self._may_send(st, msgs, now)]
        # a lone request: send on this thread. A send worker has nothing to overlap its send with then, and its
        # hand-off costs a thread wake-up (~55-90 us on the H200 host) on every token; _may_send saw the
        # request's previous response delivered, so its order holds. With more requests the workers send: a
        # send on this thread holds back the others' responses that come due meanwhile (on the H200 with every
        # lone due response sent here, 16 streams over 8 instances merged 1.81 tokens a response, against
        # 1.23-1.40 with the workers: RESULTS.md, twenty-eighth session)
        direct = (self._workers is not None and len(due) == 1 and not self._stopping
                  and self._active_requests is not None and self._active_requests() <= 1)
        for uid in due:
            st, msgs = waiting.pop(uid)
            self._send_stream(st, msgs, direct)

    def _may_send(self, st: StreamState, msgs: list[DetokenizeMsg], now: float) -> bool:
        if st.handed != st.delivered:  # a send worker still has this request's previous response
            return False
        finished = msgs[-1].finished
        if st.streamed and not finished and self.opt.stream_interval > 1:
            if sum(len(m.next_tokens) for m in msgs) < self.opt.stream_interval:
                return False
        if st.order_slot is not None and finished:
            return True  # the detokenizer keeps it behind the stream's earlier responses: no ack to wait for
        if st.order_slot is not None:
            window = self._ordered_window()
        else:  # a stream without a slot (the table was full) keeps its order the old way: one in flight
            window = self.opt.max_inflight if self._slots is None else 1
        if not st.unacked or len(st.unacked) < window:
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
        return len(st.unacked) < window

    def _ordered_window(self) -> int:
        """How many responses an ordered stream may have unacked: max_inflight, or with an inflight budget its
        share of it among this instance's streams in flight (few streams: more each; many: max_inflight)."""
        budget = self.opt.inflight_budget
        if budget <= 0:
            return self.opt.max_inflight
        return max(self.opt.max_inflight, budget // max(len(self._acked_streams), 1))

    def _drain_acks(self) -> None:
        streams = self._acked_streams
        now = time.perf_counter()
        rtts = self._report.ack_rtt_s
        for arr in self._cancel_channel.poll_acks():
            self._acks_seen = True
            acks = arr.tolist()
            for i in range(0, len(acks) - 1, 2):
                st = streams.get(acks[i])
                if st is not None:
                    sent = st.unacked.pop(acks[i + 1], None)
                    if sent is not None:
                        rtts.append(now - sent)
                elif self._retiring:
                    gone = self._retiring.get(acks[i])
                    if gone is not None and gone[1] == acks[i + 1]:  # its last response went on: reuse the slot
                        del self._retiring[acks[i]]
                        self._slots.give_back(gone[0])

    def _retire(self, st: StreamState, last_seq: int) -> None:
        """A finished stream's slot waits for its last response's ack (last_seq), or, when no response of
        it goes through the detokenizer any more (-1: an error, an abort), for a short grace."""
        if st.order_slot is not None:
            self._retiring[st.uid & ACK_UID_MASK] = (st.order_slot, last_seq, time.perf_counter())
            st.order_slot = None

    def _free_retired(self, now: float) -> None:
        for uid, (slot, last_seq, since) in list(self._retiring.items()):
            if now - since >= (self.opt.ack_lost_s if last_seq >= 0 else RETIRE_GRACE_S):
                del self._retiring[uid]
                self._slots.give_back(slot)

    def _send_stream(self, st: StreamState, msgs: list[DetokenizeMsg], direct: bool = False) -> None:
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
        ordered = self._slots is not None
        # with send_order the last response is numbered and acked too: its ack frees the stream's slot
        if st.cancel_key and st.parsed.detok_acks and self._flow_control and (ordered or not last.finished):
            uid = st.uid & ACK_UID_MASK
            if ordered and st.seq == 0:
                st.order_slot = self._slots.take(uid)
            ack = (self._cancel_channel.engine_id, uid, st.seq)
            if not last.finished:
                st.unacked[st.seq] = now
                self._acked_streams[uid] = st
            st.seq += 1
        if not st.streamed and st.t_first is not None:
            self._report.first_s.append((st.t_admitted - st.t_arrival, st.t_first - st.t_admitted, now - st.t_first))
        context = st.output_ids[st.window.start():]
        outputs = st.outputs(last, tokens, logprobs, context, "", now, ack)
        st.output_ids.extend(tokens)
        st.window.push(tokens)
        st.streamed = True
        if last.finished:
            self._acked_streams.pop(st.uid & ACK_UID_MASK, None)
            self._retire(st, st.seq - 1 if ack is not None else -1)
        self._report.tokens += len(tokens)
        self._send(st.handle, outputs, None, last.finished, st, direct)

    def _send(self, handle: Any, outputs: dict | None, error: str | None, final: bool,
              st: StreamState | None = None, direct: bool = False) -> None:
        """Deliver on this thread (no send workers, or `direct`: nothing of this request is with its worker), else
        hand it to the request's worker."""
        if self._workers is None or direct:
            self._report.direct += direct
            self._deliver((handle, outputs, error, final, None))
            return
        if st is not None:
            st.handed += 1
        self._workers.put((handle, outputs, error, final, st))

    def _deliver(self, item: tuple) -> None:
        """One transport.send (on the sender thread, or on a send worker)."""
        handle, outputs, error, final, st = item
        t0 = time.perf_counter()
        try:
            self.transport.send(handle, outputs, error, final)
        except Exception as e:  # a client that went away: stop generating for it
            log.info("send failed (%s: %s): aborting the request", type(e).__name__, e)
            if not final:
                self._on_undeliverable(handle)
        report = self._report
        report.responses += 1
        report.send_s.append(time.perf_counter() - t0)
        if st is not None:  # a worker: the sender thread may hand this request's next response over
            st.delivered += 1
            try:
                os.write(self._wake_w, b"x")
            except (BlockingIOError, OSError):
                pass
