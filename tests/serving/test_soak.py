"""A short soak of the served ensemble (benchmarks/soak.py, issue 14): a couple of hundred mixed requests
(gRPC streams, SSE, HTTP generate, gRPC non-streaming; greedy, seeded sampling, stop words, chat), a
quarter of them cancelled at random points. Every completed request ends with exactly one FINAL and
the text of its solo run (fp32), nothing errs, and once idle no KV page is held."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.serving

pytest.importorskip("tritonclient.grpc")
pytest.importorskip("psutil")


def test_short_soak(triton_server):
    soak = load_benchmark("soak")
    cfg = soak.SoakConfig(requests=150, concurrency=8, cancel_fraction=0.25, max_tokens=16, seed=1)
    report = soak.run_soak(triton_server.grpc_url, triton_server.http_url, triton_server.metrics_url, cfg,
                           triton_server.process.pid, log=lambda *_: None)
    print("\n" + soak.format_report(report))
    assert report.requests == 150 and report.cancelled >= 20
    assert {k for k in report.by_kind if "/" not in k} == set(soak.KINDS)
    assert report.errors == 0 and report.bad_finals == 0 and report.mismatches == 0, report.examples
    assert report.leaked_pages == 0 and report.running_after == 0 and report.waiting_after == 0
    # a gross leak would show in 120 requests; small steps are allocator noise (the 1,000-request
    # CPU soak and the H200 soak in benchmarks/RESULTS.md measure growth properly)
    growth = report.rss_growth_pct()
    assert set(growth) >= {"tritonserver", "stub:freetoken", "stub:tokenizer", "stub:detokenizer"}, growth
    assert all(g < 25.0 for g in growth.values()), growth
