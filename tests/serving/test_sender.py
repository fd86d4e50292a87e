"""The sender thread's report line (serving/stream/sender.py): the served benchmark reads where a response's
time goes from it, so its numbers must be the ones it collected."""

from __future__ import annotations

from freetoken_core.serving.stream.sender import SenderReport, percentile


def test_percentile_of_sorted_values():
    values = [float(i) for i in range(100)]
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.99) == 99.0
    assert percentile([], 0.5) == 0.0 and percentile([3.0], 0.99) == 3.0


def test_report_line_states_rates_send_cost_and_ack_round_trip():
    r = SenderReport(t0=100.0, responses=2000, tokens=3000, send_s=[50e-6] * 1980 + [400e-6] * 20,
                     ack_rtt_s=[0.004] * 98 + [0.020] * 2)
    line = r.line(now=102.0)  # two seconds
    assert "1000 responses/s" in line and "1500 streamed tokens/s" in line and "(1.50 per response)" in line
    assert "send() p50/p99 50/400 us" in line
    assert "busy 5%" in line  # (1980 x 50 us + 20 x 400 us) / 2 s
    assert "ack round trip p50/p99 4.0/20.0 ms" in line
    assert "ack" not in SenderReport(t0=0.0, responses=1, send_s=[1e-5]).line(now=1.0)


def test_report_line_splits_the_first_responses_time():
    r = SenderReport(t0=0.0, responses=10, tokens=10, send_s=[1e-4] * 10,
                     first_s=[(60e-6, 2.5e-3, 80e-6)] * 9 + [(1e-3, 9e-3, 1e-3)])
    line = r.line(now=1.0)
    assert "first response p50: engine thread woken 60 us, first token 2.50 ms later, at the sender 80 us" in line
    assert "first response" not in SenderReport(t0=0.0, responses=1, send_s=[1e-5]).line(now=1.0)


def test_a_streams_first_response_is_timed_once(smollm2_path, monkeypatch):
    """Through a real EngineLoop: every stream's first response adds one (wake, engine, to sender) entry."""
    import threading

    from freetoken_core.serving.stream import sender

    monkeypatch.setattr(sender, "REPORT_INTERVAL_S", 1e9)  # a slow box must not start a new report meanwhile

    from freetoken_core import LLM, SamplingParams
    from freetoken_core.serving.engine_proc.engine_loop import EngineLoop, LoopOptions
    from freetoken_core.serving.triton.request import ParsedRequest

    class Transport:
        def __init__(self) -> None:
            self.finals = 0
            self.done = threading.Event()

        def send(self, handle, outputs, error, final) -> None:
            self.finals += final
            if self.finals == 3:
                self.done.set()

        def is_cancelled(self, handle) -> bool:
            return False

    llm = LLM(smollm2_path, dtype="float32", max_running_req=4)
    transport = Transport()
    loop = EngineLoop(llm.scheduler, transport, LoopOptions(), owns_scheduler=False)
    report = loop.sender._report
    loop.start()
    try:
        for i in range(3):
            loop.submit(f"h{i}", ParsedRequest(input_ids=llm.encode(f"Count to {i + 3}."),
                                               params=SamplingParams(max_tokens=5, ignore_eos=True), stream=True))
        assert transport.done.wait(120)
    finally:
        loop.stop()
    assert len(report.first_s) == 3
    assert all(wake >= 0 and engine > 0 and to_sender >= 0 for wake, engine, to_sender in report.first_s)
