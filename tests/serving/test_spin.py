"""idle_spin_us (serving/spin.py): waiters of a lightly loaded served path look for their next work a while before
they block. What it buys is measured on the GPU host (benchmarks/); here: that it wakes on the hand-off, gives up
after its time, and that the engine loop and the sender spin only while few requests are in flight, with tokens,
text and the FINAL flag exactly as without it."""

from __future__ import annotations

import threading
import time

import pytest

from freetoken_core import SamplingParams
from freetoken_core.serving import engine_loop, sender
from freetoken_core.serving.engine_loop import LoopOptions
from freetoken_core.serving.spin import spin_until
from freetoken_core.serving.text_models import detokenize_response
from test_engine_loop import RecordingTransport, llm, stream_through_loop, tokens_of  # noqa: F401 (fixture)


def test_spin_sees_the_hand_off_of_another_thread():
    flag = threading.Event()
    threading.Timer(0.02, flag.set).start()
    assert spin_until(flag.is_set, 5.0)  # long enough never to run out first, even on a loaded box
    assert flag.is_set()


def test_spin_gives_up_after_its_time_and_answers_at_once_when_ready():
    t0 = time.perf_counter()
    assert not spin_until(lambda: False, 0.01)
    assert time.perf_counter() - t0 >= 0.01
    assert spin_until(lambda: True, 0.0)


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, ready, spin_s):
        self.calls += 1
        return spin_until(ready, spin_s)


@pytest.mark.parametrize("spin_s", [0.0, 0.005])
def test_the_loop_and_the_sender_spin_only_when_asked_and_stay_exact(llm, monkeypatch, spin_s):  # noqa: F811
    in_loop, in_sender = Counting(), Counting()
    monkeypatch.setattr(engine_loop, "spin_until", in_loop)
    monkeypatch.setattr(sender, "spin_until", in_sender)
    prompt = "Write one sentence about cats."
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = llm.generate([prompt], params)[0]
    transport = stream_through_loop(llm, [prompt], params, RecordingTransport(0.0), LoopOptions(idle_spin_s=spin_s))
    responses = transport.sent["h0"]
    assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
    assert [int(t) for out, _, _ in responses for t in tokens_of(out)] == expected.token_ids
    assert "".join(detokenize_response(llm.tokenizer, out)["text_output"][0].decode("utf-8")
                   for out, _, _ in responses) == expected.text
    # one stream: the sender spins between the engine's steps, the engine thread once it has nothing to do
    assert (in_sender.calls > 0) == (spin_s > 0)
    assert (in_loop.calls > 0) == (spin_s > 0)


def test_the_sender_does_not_spin_with_more_than_one_request_in_flight(llm, monkeypatch):  # noqa: F811
    in_sender = Counting()
    monkeypatch.setattr(sender, "spin_until", in_sender)
    transport = RecordingTransport(0.0)
    s = sender.ResponseSender(transport, LoopOptions(idle_spin_s=0.005), engine_loop.CancelChannel(),
                              lambda handle: None, active_requests=lambda: 2)
    s.start()
    try:
        transport.expected = 1
        s.post([("h", {"x": 1}, None, True, None)])
        assert transport.done.wait(10)
    finally:
        s.stop(10)
    assert in_sender.calls == 0
