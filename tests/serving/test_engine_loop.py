"""EngineLoop without a server: a transport that records what Triton's response sender would get.
A slow transport makes streaming messages pile up; they must merge into fewer responses whose
tokens, order, stateless-detokenized text and single FINAL flag are exactly right."""

from __future__ import annotations

import threading
import time

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.serving.engine_loop import EngineLoop, LoopOptions
from freetoken_core.serving.metrics import EngineMetrics
from freetoken_core.serving.request import ParsedRequest
from freetoken_core.serving.text_models import detokenize_response


class RecordingTransport:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.sent: dict[str, list[tuple[dict | None, str | None, bool]]] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.expected = 0

    def send(self, handle, outputs, error, final) -> None:
        time.sleep(self.delay_s)  # a slow IPC send: messages queue up behind it
        with self.lock:
            self.sent.setdefault(handle, []).append((outputs, error, final))
            if final and sum(1 for r in self.sent.values() if r[-1][2]) == self.expected:
                self.done.set()

    def is_cancelled(self, handle) -> bool:
        return False


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", max_running_req=8)


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_streaming_responses_merge_exactly(llm, delay_s):
    prompts = ["Write one sentence about cats.", "Dis bonjour en français, s'il te plaît.", "数到五"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = RecordingTransport(delay_s)
    transport.expected = len(prompts)
    loop = EngineLoop(llm.scheduler, transport)
    loop.start()
    try:
        for i, p in enumerate(prompts):
            loop.submit(f"h{i}", ParsedRequest(input_ids=llm.encode(p), params=params, stream=True))
        assert transport.done.wait(120)
    finally:
        loop.stop()
    for i, exp in enumerate(expected):
        responses = transport.sent[f"h{i}"]
        assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
        tokens = [int(t) for out, _, _ in responses for t in out["next_tokens"]]
        assert tokens == exp.token_ids
        text = "".join(
            detokenize_response(llm.tokenizer, out)["text_output"][0].decode("utf-8") for out, _, _ in responses
        )
        assert text == exp.text
        if delay_s:
            assert len(responses) < len(tokens)  # merged while the transport was busy


class CancellingTransport(RecordingTransport):
    """Reports handle "h0" cancelled once it has had `after` responses; records who asked."""

    def __init__(self, after: int) -> None:
        super().__init__(0.0)
        self.after = after
        self.asked_from: set[str] = set()

    def is_cancelled(self, handle) -> bool:
        self.asked_from.add(threading.current_thread().name)
        with self.lock:
            return handle == "h0" and len(self.sent.get("h0", [])) >= self.after


class CountingMetrics(EngineMetrics):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (method, thread name)

    def _note(self, name: str) -> None:
        self.calls.append((name, threading.current_thread().name))

    def observe_ttft(self, seconds: float) -> None:
        self._note("observe_ttft")

    def count_finish(self, reason: str) -> None:
        self._note(f"finish:{reason}")

    def set_engine_stats(self, stats) -> None:
        self._note("stats")


def test_cancel_polls_and_metrics_run_off_the_engine_thread(llm):
    """Triton's is_cancelled and metric updates are IPC round trips: the control thread makes them,
    a cancel it finds still aborts the request (FINAL alone, pages back), metrics still arrive."""
    free0 = llm.scheduler.stats().num_free_pages
    transport = CancellingTransport(after=2)
    transport.expected = 2
    metrics = CountingMetrics()
    loop = EngineLoop(llm.scheduler, transport, LoopOptions(cancel_check_interval_s=0.01, control_tick_s=0.01), metrics)
    loop.start()
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        short = SamplingParams(max_tokens=8, ignore_eos=True)
        loop.submit("h0", ParsedRequest(input_ids=llm.encode("Count to one thousand."), params=params, stream=True))
        loop.submit("h1", ParsedRequest(input_ids=llm.encode("Say hi."), params=short, stream=True))
        assert transport.done.wait(120)
    finally:
        loop.stop()
    cancelled = transport.sent["h0"]
    assert cancelled[-1] == (None, None, True)  # the FINAL flag alone
    assert sum(len(out["next_tokens"]) for out, _, _ in cancelled[:-1]) < 400
    assert len([1 for out, _, _ in transport.sent["h1"] for _ in out["next_tokens"]]) == 8
    assert transport.asked_from == {"freetoken-control"}
    assert {t for _, t in metrics.calls} <= {"freetoken-control", threading.current_thread().name}
    names = [n for n, _ in metrics.calls]
    assert names.count("observe_ttft") == 2 and "finish:length" in names and "stats" in names
    assert llm.scheduler.stats().num_free_pages == free0
