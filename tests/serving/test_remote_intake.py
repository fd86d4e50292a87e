"""With the engine in its own process the `freetoken` model takes two thread hand-offs off a lone request's way
(issue 13, one stream): execute()'s thread sends the request to the engine itself (EngineLoop.submit), and a small
step's responses go out on the engine thread while the sender thread is idle (ResponseSender.inline_max).

Both must keep what the hand-offs kept: a message that comes before the engine thread registered its request is
not lost; a request's responses stay in order; flow control (acks) and the single FINAL flag hold."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.config import EngineConfig
from freetoken_core.messages import DetokenizeMsg, EngineStats
from freetoken_core.serving.stream.cancel import CancelChannel
from freetoken_core.serving.engine_proc.engine_loop import EngineLoop, LoopOptions
from freetoken_core.serving.engine_proc.engine_process import EngineClient
from freetoken_core.serving.triton.request import ParsedRequest
from freetoken_core.serving.stream.sender import ResponseSender
from freetoken_core.serving.triton.text_models import order_of
from tests.serving.test_engine_loop import AckingTransport, assert_streams_exact


class FastRemoteEngine:
    """An engine in "another process" whose request is answered before add_request even returns: its two
    tokens are ready for the next step() at once, while add_request still holds on (as a slow pipe write would),
    so the engine thread sees them before execute()'s thread could hand the request over."""

    remote = True

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.tokenizer = SimpleNamespace(anchors=None)
        self.add_threads: list[int] = []
        self._ready: list[DetokenizeMsg] = []
        self._lock = threading.Lock()
        self._uids = 0

    def add_request(self, input_ids, params=None) -> int:
        self.add_threads.append(threading.get_ident())
        with self._lock:
            uid, self._uids = self._uids, self._uids + 1
            self._ready += [DetokenizeMsg(uid, [7], num_prompt_tokens=len(input_ids), num_output_tokens=1),
                            DetokenizeMsg(uid, [8], finished=True, finish_reason="length",
                                          num_prompt_tokens=len(input_ids), num_output_tokens=2)]
        time.sleep(self.hold_s)
        return uid

    def has_work(self) -> bool:
        return bool(self._ready)

    def step(self) -> list[DetokenizeMsg]:
        with self._lock:
            msgs, self._ready = self._ready, []
        return msgs

    def abort(self, uid: int) -> bool:
        return False

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 1, 1, 16)

    def close(self) -> None:
        pass


class Recording:
    def __init__(self, expected: int, block: threading.Event | None = None) -> None:
        self.sent: list[tuple] = []  # (handle, outputs, error, final, the sending thread)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.expected = expected
        self.block = block  # the first send waits for it (a busy sender thread)

    def send(self, handle, outputs, error, final) -> None:
        if self.block is not None and not self.sent:
            self.block.wait(10)
        with self.lock:
            self.sent.append((handle, outputs, error, final, threading.get_ident()))
            if sum(r[3] for r in self.sent) == self.expected:
                self.done.set()

    def is_cancelled(self, handle) -> bool:
        return False


def test_a_message_before_its_requests_admission_waits_for_it():
    """The engine answers while execute()'s thread still adds: the engine thread waits for the hand-over instead
    of dropping the tokens, and the request was added on the submitting thread, not the engine thread."""
    engine = FastRemoteEngine(hold_s=0.3)
    transport = Recording(expected=2)
    loop = EngineLoop(engine, transport, LoopOptions(idle_wait_s=0.01))
    loop.start()
    try:
        for i in range(2):
            loop.submit(f"h{i}", ParsedRequest(input_ids=[1, 2, 3], params=SamplingParams(max_tokens=2)))
        assert transport.done.wait(30)
    finally:
        loop.stop()
    assert engine.add_threads == [threading.get_ident()] * 2
    for i in range(2):
        responses = [r for r in transport.sent if r[0] == f"h{i}"]
        assert len(responses) == 1 and responses[0][3] and responses[0][2] is None
        assert list(responses[0][1]["next_tokens"]) == [7, 8]


def make_sender(transport, inline_max: int) -> ResponseSender:
    return ResponseSender(transport, LoopOptions(max_inflight=0), CancelChannel(), lambda handle: None,
                          inline_max=inline_max)


def response(handle: str, final: bool = True) -> tuple:
    return (handle, {"text_output": np.array([handle.encode()], dtype=np.object_)}, None, final, None)


def test_a_small_post_to_an_idle_sender_goes_out_on_the_posting_thread():
    transport = Recording(expected=4)
    sender = make_sender(transport, inline_max=2)
    sender.start()
    try:
        sender.post([response("a")])  # sent before post returns, by this thread
        assert [r[0] for r in transport.sent] == ["a"] and transport.sent[0][4] == threading.get_ident()
        sender.post([response("b"), response("c"), response("d")])  # more than inline_max: the sender thread
        assert transport.done.wait(10)
    finally:
        sender.stop(5)
    assert [r[0] for r in transport.sent] == ["a", "b", "c", "d"]
    assert {r[4] for r in transport.sent[1:]} == {sender._thread.ident}
    assert sender.inline_posts == 1


def test_a_small_post_never_overtakes_what_the_sender_thread_still_sends():
    """The sender thread is stuck in a send of an earlier post: a small post queues behind it (no inline send)."""
    release = threading.Event()
    transport = Recording(expected=3, block=release)  # "a" is not final
    sender = make_sender(transport, inline_max=2)
    sender.start()
    try:
        sender.post([response("a", final=False), response("b"), response("c")])
        deadline = time.monotonic() + 10
        while sender._outbox.qsize():  # the sender thread took the post and is in its first send
            assert time.monotonic() < deadline
            time.sleep(0.001)
        sender.post([response("d")])
        assert sender.inline_posts == 0 and not transport.sent
        release.set()
        assert transport.done.wait(10)
    finally:
        release.set()
        sender.stop(5)
    assert [r[0] for r in transport.sent] == ["a", "b", "c", "d"]


def test_off_without_inline_max():
    transport = Recording(expected=1)
    sender = make_sender(transport, inline_max=0)
    sender.start()
    try:
        sender.post([response("a")])
        assert transport.done.wait(10)
    finally:
        sender.stop(5)
    assert transport.sent[0][4] == sender._thread.ident and sender.inline_posts == 0


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", max_running_req=2)


@pytest.mark.parametrize("ack_delay_s,max_inflight,send_order", [(0.0, 1, False), (0.3, 1, False), (0.05, 4, True)])
def test_acked_streams_through_the_engine_process_stay_exact(smollm2_path, llm, ack_delay_s, max_inflight,
                                                              send_order):
    """The served default: the engine process, ensemble streams with acks (one response in flight), with acks at
    once and late; and with detok_send_order (several in flight, every response numbered). Tokens, text and one
    FINAL exact, never more responses unacked than allowed, and some steps went out on the engine thread."""
    prompts = ["Write one sentence about cats.", "数到五"]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = llm.generate(prompts, params)
    client = EngineClient(EngineConfig(model_path=smollm2_path, dtype="float32", max_running_req=2))
    transport = AckingTransport(ack_delay_s)
    transport.expected = len(prompts)
    loop = EngineLoop(client, transport, LoopOptions(max_inflight=max_inflight, send_order=send_order))
    loop.start()  # stop() closes the engine process
    try:
        for i, p in enumerate(prompts):
            loop.submit(f"h{i}", ParsedRequest(input_ids=llm.encode(p), params=params, stream=True,
                                               from_ensemble=True, detok_acks=True))
        assert transport.done.wait(120)
    finally:
        loop.stop()
    assert 1 <= transport.most_unacked <= max_inflight
    assert loop.sender.inline_posts > 0
    assert_streams_exact(transport, expected, llm.tokenizer)
    if send_order:  # each stream's responses numbered 0, 1, ... the last one included
        for i in range(len(prompts)):
            orders = [order_of(out) for out, _, _ in transport.sent[f"h{i}"]]
            assert [o[3] for o in orders] == list(range(len(orders)))


def test_a_request_handed_over_after_the_engine_thread_stopped_still_gets_its_final():
    engine = FastRemoteEngine(hold_s=0.0)
    transport = Recording(expected=1)
    loop = EngineLoop(engine, transport, LoopOptions())
    loop.start()
    loop._stopping.set()  # the engine thread is on its way out (finalize() began)
    loop._wake.set()
    loop._engine_thread.join(10)
    loop.submit("late", ParsedRequest(input_ids=[1, 2, 3], params=SamplingParams(max_tokens=2)))
    loop.stop()
    assert [(r[0], r[3]) for r in transport.sent] == [("late", True)]
    assert "shutting down" in transport.sent[0][2]
