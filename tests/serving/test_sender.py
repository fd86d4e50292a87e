"""The sender thread's report line (serving/sender.py): the served benchmark reads where a response's
time goes from it, so its numbers must be the ones it collected."""

from __future__ import annotations

from freetoken_core.serving.sender import SenderReport, percentile


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
