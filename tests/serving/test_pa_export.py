"""benchmarks/dev/pa_export.py --arrivals and pa_summary.py trace read what a one-stream run's time is made of: when each
token reached the client, and the per-model timeline of any ensemble (whatever its name: here "floor"); benchmarks/openai_pa.py
reads an OpenAI and a Triton export alike (bench_openai.py --load-generator perf_analyzer)."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark


def _request(t0_ms: float, stamps_ms: list[float], tokens: list[int]) -> dict:
    ns = lambda ms: int(ms * 1e6)  # noqa: E731
    return {"timestamp": ns(t0_ms), "response_timestamps": [ns(t0_ms + s) for s in stamps_ms],
            "response_outputs": [{"next_tokens": list(range(n)) if n != 1 else 5} for n in tokens]}


def test_token_arrivals_follow_the_responses_that_carry_them(tmp_path):
    pa = load_benchmark("dev/pa_export")
    # 4 tokens: the first alone at 3 ms, then two merged at 5 ms, the last at 6 ms; a request cut short is left out
    reqs = [_request(0, [3, 5, 6], [1, 2, 1]), _request(100, [2, 4, 8], [1, 2, 1]), _request(200, [1], [1])]
    arrivals = pa.token_arrivals(reqs, 4)
    assert arrivals == {1: 2.5, 2: 4.5, 4: 7.0}
    export = tmp_path / "run" / "ensemble-1.json"
    export.parent.mkdir()
    export.write_text(json.dumps({"experiments": [{"experiment": {"value": 1}, "requests": reqs}]}))
    table = pa.arrivals_table([export], 4)
    assert "| run/ensemble-1.json | 1 | 2.50 | 4.50 | 7.00 |" in table


def test_the_trace_timeline_starts_from_any_ensembles_requests(tmp_path):
    summary = load_benchmark("dev/pa_summary")
    trace = tmp_path / "trace.json"
    ts = lambda name, ms: {"name": name, "ns": int(ms * 1e6)}  # noqa: E731
    trace.write_text(json.dumps([
        {"id": 1, "model_name": "floor", "timestamps": [ts("GRPC_WAITREAD_END", 10), ts("REQUEST_START", 10.1)]},
        {"id": 2, "model_name": "floor_engine", "parent_id": 1, "timestamps": [ts("COMPUTE_START", 10.5)]},
    ]))
    text = summary.trace_timeline(trace)
    assert text.startswith("1 ensemble requests traced")
    assert "| 0.500 | floor_engine | COMPUTE_START | 1 |" in text


def test_slow_spells_group_the_slow_requests_and_tell_a_stall_from_slow_steps(tmp_path):
    pa = load_benchmark("dev/pa_export")
    # one request every 100 ms, 10 ms each (10 responses 1 ms apart); requests 3-5 every step 50% slower, with one
    # normal request bridged inside (4); request 8 one 20 ms stall
    reqs = []
    for i in range(10):
        step = 1.5 if i in (3, 5) else 1.0
        stamps = [step * (k + 1) for k in range(10)]
        if i == 8:
            stamps = stamps[:5] + [s + 20 for s in stamps[5:]]
        reqs.append(_request(100.0 * i, stamps, [1] * 10))
    spells = pa.slow_spells(reqs)
    assert [(s.requests, round(s.start_s, 3), round(s.end_s, 4)) for s in spells] == [(2, 0.3, 0.515), (1, 0.8, 0.83)]
    assert spells[0].latency_p50_ms == 15.0 and spells[0].longest_gap_ms == 1.5
    assert spells[1].longest_gap_ms == 21.0
    assert pa.slow_spells(reqs[:3]) == []  # all alike: none

    export = tmp_path / "run" / "ensemble-1.json"
    export.parent.mkdir()
    export.write_text(json.dumps({"experiments": [{"experiment": {"value": 1}, "requests": reqs}]}))
    # nvidia-smi's lines in the host's local time; the requests' timestamps are ns since the epoch
    from datetime import datetime

    def line(t_s: float, mhz: int) -> str:
        return f"{datetime.fromtimestamp(t_s).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {mhz}, 120.5, 0x0000000000000000"

    gpu = tmp_path / "gpu.csv"
    gpu.write_text("\n".join([line(0.0, 1980), line(0.35, 1500), line(0.5, 1600), line(0.6, 1980), "[N/A], cut"]))
    samples = pa.read_gpu_log(gpu)
    assert [g.sm_mhz for g in samples] == [1980, 1500, 1600, 1980]
    table = pa.slow_table([export], gpu=samples)
    assert "| run/ensemble-1.json | 1 | 10.00 | 0.30-0.52 | 2 | 15.00 | 1.50 | SM 1500 / 1550 MHz, 120 W" in table
    assert "(SM 1500 / 1790 MHz" in table


AB_OUTPUT = """cpus: 16, commit: abc, sources: 123
=== in-process smollm2-135m
concurrency 1: in-process LLM   1400.0 output tok/s
concurrency 16: in-process LLM  12000.0 output tok/s
concurrency 64: in-process LLM  30000.0 output tok/s
=== served smollm2-135m [defaults]
| target | concurrency | requests/s | responses/s | tokens/response | tok/s | p50 ms | p99 ms |
|---|---|---|---|---|---|---|---|
| ensemble | 1 | 10.6 | 1357 | 1.00 | 1357 | 93.5 | 96.3 |
| ensemble | 16 | 110.0 | 11000 | 1.28 | 14080 | 147.1 | 152.4 |
| ensemble | 64 | 250.0 | 9000 | 3.56 | 32000 | 272.9 | 298.1 |

| target | streams | sender reports | ack round trip p50 / p99 ms | engine to first token ms | tokens a response | windows a stream |
|---|---|---|---|---|---|---|
| ensemble stubs | 64 | 16 | 27.5 / 40.1 | 5.10 | 3.50 | 2/4 |
=== served smollm2-135m [FREETOKEN_DETOK_MAX_INFLIGHT=8]
| ensemble | 1 | 10.0 | 1280 | 1.00 | 1280 | 99.0 | 101.0 |
| ensemble | 16 | 100.0 | 8000 | 1.60 | 12800 | 150.0 | 160.0 |
| ensemble | 64 | (no result: see /tmp/x/ensemble-64.txt) |||||| 
=== in-process smollm2-135m (again)
concurrency 1: in-process LLM   1420.0 output tok/s
concurrency 16: in-process LLM  14000.0 output tok/s
concurrency 64: in-process LLM  34000.0 output tok/s
"""


def test_targets_read_the_ab_output_against_issue_13():
    """Ratio = served / the mean of the in-process runs before and after; each setting's misses named."""
    summary = load_benchmark("dev/pa_summary")
    inprocess, served = summary.parse_ab_output(AB_OUTPUT)
    assert inprocess == {1: [1400.0, 1420.0], 16: [12000.0, 14000.0], 64: [30000.0, 34000.0]}
    assert list(served) == ["defaults", "FREETOKEN_DETOK_MAX_INFLIGHT=8"]
    assert 64 not in served["FREETOKEN_DETOK_MAX_INFLIGHT=8"]
    report = summary.targets_report(AB_OUTPUT)
    defaults, inflight = report.split("setting [")[1:]
    assert "| 1 | 1,400.0 / 1,420.0 | 1,357 | 0.962 | 1,357 | 1.00 |" in defaults
    assert "targets: all met" in defaults  # 0.962, 1.083, 1.000; 9,000 responses/s; 1.28 tokens a response
    assert "1 streams: ratio 0.908 < 0.95" in inflight
    assert "16 streams: ratio" not in inflight  # 12,800 / 13,000 = 0.985 meets it
    assert "16 streams: 1.60 tokens a response > 1.5" in inflight
    assert "64 streams: no served result" in inflight


SENDER_LINES = [
    "sender: 1193 responses/s, 5167 streamed tokens/s (4.33 per response), send() p50/p99 499/2165 us, busy 72%, "
    "detokenizer ack round trip p50/p99 47.8/57.5 ms, first response p50: engine thread woken 0 us, first token 6.86 "
    "ms later, at the sender 302 us after that, window 8 a stream (2 streams in flight here)",
    "sender: 1184 responses/s, 5081 streamed tokens/s (4.29 per response), send() p50/p99 496/2230 us, busy 72%, "
    "detokenizer ack round trip p50/p99 40.0/50.0 ms, window 4 a stream (4 streams in flight here)",
    "sender: 1197 responses/s, 5159 streamed tokens/s (4.31 per response), send() p50/p99 490/2332 us, busy 72%, "
    "detokenizer ack round trip p50/p99 45.0/55.0 ms, first response p50: engine thread woken 0 us, first token 6.76 "
    "ms later, at the sender 257 us after that, window 4 a stream (4 streams in flight here)",
]


def test_senders_summarize_each_runs_sender_reports(tmp_path):
    """pa_summary.py senders: per run (the log lines gpu_perf_analyzer.sh sliced out while it went on), the median
    ack round trip p50 / p99, engine to first token and tokens a response over the stubs' reports, and the windows
    seen; a run without reports says so, a run without its file is left out."""
    summary = load_benchmark("dev/pa_summary")
    (tmp_path / "sender-ensemble-64.txt").write_text("\n".join(SENDER_LINES) + "\n")
    (tmp_path / "sender-ensemble-16.txt").write_text("")
    table = summary.senders_table(tmp_path, ["1", "16", "64"])
    assert "| ensemble stubs | 64 | 3 | 45.0 / 55.0 | 6.86 | 4.31 | 4/8 |" in table
    assert "| ensemble stubs | 16 | 0 | - | - | - | - |" in table
    assert "| 1 |" not in table and "freetoken" not in table
    # the senders table beside a setting's ensemble table is not read as its rows
    _, served = summary.parse_ab_output(AB_OUTPUT)
    assert served["defaults"][64]["tok_s"] == 32000.0


def _sse(*chunks: dict | str) -> dict:
    """One read of an OpenAI SSE stream as perf_analyzer's profile export holds it: {"response": raw text}."""
    return {"response": "".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks)}


def _delta(**delta) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def _req(t0_ms: float, stamps_ms: list[float], outputs: list[dict] | None = None) -> dict:
    ns = lambda ms: int(ms * 1e6)  # noqa: E731
    req = {"timestamp": ns(t0_ms), "response_timestamps": [ns(t) for t in stamps_ms]}
    if outputs is not None:
        req["response_outputs"] = outputs
    return req


def _export(concurrency: int, requests: list[dict], bounds_ms: list[float]) -> dict:
    """A decoy experiment at another concurrency first: summarize picks the one asked for."""
    decoy = {"experiment": {"mode": "concurrency", "value": 1}, "requests": [_req(0, [1])], "window_boundaries": [0, 1]}
    return {"experiments": [decoy, {"experiment": {"mode": "concurrency", "value": concurrency}, "requests": requests,
                                    "window_boundaries": [int(b * 1e6) for b in bounds_ms]}]}


# windows 0-100-200-300-400 ms: the measured span is the last 3, 100-400 ms (0.3 s); 4 output tokens a request
BOUNDS = [0, 100, 200, 300, 400]


def test_openai_export_counts_the_chunks_that_carry_text():
    pa = load_benchmark("openai_pa")
    cut = json.dumps(_delta(content="D"))
    requests = [
        # sent before the span (no TTFT); text at 80, 120 (two events in one read) and 170 (an event cut in two,
        # counted where it ends): 4/3 tokens each, 2 of them in the span
        _req(50, [60, 80, 120, 150, 170, 180], [
            _sse(_delta(role="assistant", content="")), _sse(_delta(content="A")),
            _sse(_delta(content="B"), _delta(content="C")), {"response": "data: " + cut[:20]},
            {"response": cut[20:] + "\n\n"}, _sse({"choices": [{"delta": {}, "finish_reason": "length"}]}, "[DONE]")]),
        # 4 text reads in the span, the last with [DONE] in the same read: 1 token each; TTFT 190 - 150 = 40
        _req(150, [160, 190, 250, 300, 350], [
            _sse(_delta(role="assistant")), _sse(_delta(content="x")), _sse(_delta(content="y")),
            _sse(_delta(content="z")), _sse(_delta(content="w"), "[DONE]")]),
        # sent in the span, its tokens after it: TTFT 410 - 380 = 30, no tokens counted
        _req(380, [390, 410, 420, 430], [_sse(_delta(role="assistant")), _sse(_delta(content="q")),
                                         _sse(_delta(content="r")), _sse("[DONE]")]),
        # a completions-style chunk (choices[0].text): all 4 tokens at 260; TTFT 60
        _req(200, [260, 270], [_sse({"choices": [{"index": 0, "text": "hi"}]}), _sse("[DONE]")]),
    ]
    m = pa.summarize(_export(16, requests, BOUNDS), "openai", 16, 4)
    assert m.requests == 3 and m.seconds == pytest.approx(0.3)
    assert m.output_tokens == pytest.approx(8 / 3 + 4 + 0 + 4)
    assert sorted(m.ttfts_ms) == pytest.approx([30.0, 40.0, 60.0])
    assert m.output_tokens / m.seconds == pytest.approx(35.5556, rel=1e-4)


def test_triton_export_counts_the_responses_with_text_output():
    pa = load_benchmark("openai_pa")

    def out(text: str, tokens=5) -> dict:  # every ensemble output is in each response; an absent one is ""
        return {"text_output": text, "next_tokens": tokens if text else "", "finish_reason": ""}

    requests = [
        # sent before the span: text at 110, 140, 200 (an empty text_output at 130, the empty final at 210): all in
        _req(90, [110, 130, 140, 200, 210], [out("Hel"), out(""), out("lo", [6, 7]), out(" w"), out("")]),
        # TTFT 20; text at 320, 390 (in) and 405 (after the span): 8/3 tokens in
        _req(300, [320, 390, 405, 410], [out("a"), out("b"), out("c"), out("")]),
        # no outputs exported: every response counts, 2 of 3 in the span; TTFT 30
        _req(120, [150, 250, 420]),
    ]
    m = pa.summarize(_export(16, requests, BOUNDS), "grpc", 16, 4)
    assert m.requests == 2 and m.seconds == pytest.approx(0.3)
    assert m.output_tokens == pytest.approx(4 + 8 / 3 + 8 / 3)
    assert sorted(m.ttfts_ms) == pytest.approx([20.0, 30.0])
    # fewer than 4 boundaries: the whole span; none: first send to last response
    assert pa.measured_span({"window_boundaries": [5, 9]}) == (5, 9)
    assert pa.measured_span({"requests": requests[1:]}) == (int(120e6), int(420e6))


def test_perf_analyzer_inputs_and_commands_send_the_same_chat_on_both_sides(tmp_path):
    pa = load_benchmark("openai_pa")
    chat = [{"role": "user", "content": "[openai 4 00000] hello"}]
    oa = pa.PaTarget("openai", "http://127.0.0.1:9000/v1", "127.0.0.1:8001", "smol", "unused", 64)
    grpc = pa.PaTarget("grpc", "http://127.0.0.1:9000/v1", "127.0.0.1:8001", "smol", "unused", 64)
    body = json.loads(json.dumps(pa.input_data(oa, [chat[0]["content"], "b"])))
    assert len(body["data"]) == 2
    assert body["data"][0]["payload"] == [{"model": "smol", "messages": chat, "max_tokens": 64, "stream": True,
                                           "ignore_eos": True}]
    tensors = json.loads(json.dumps(pa.input_data(grpc, [chat[0]["content"], "b"])))["data"][0]
    assert json.loads(tensors.pop("messages")[0]) == chat
    assert tensors == {"max_tokens": [64], "ignore_eos": [True], "stream": [True]}

    load = pa.measured_args(4, 4000, 6, 10, tmp_path / "e.json")
    assert pa.command(oa, tmp_path / "d.json", load) == [
        "perf_analyzer", "-m", "smol", "--service-kind", "openai", "--endpoint", "v1/chat/completions",
        "-u", "127.0.0.1:9000", "-i", "http", "--async", "--input-data", str(tmp_path / "d.json"),
        "--concurrency-range", "4", "--max-threads", "4", "--measurement-interval", "4000",
        "--stability-percentage", "10", "--max-trials", "6", "--percentile", "50",
        "--profile-export-file", str(tmp_path / "e.json")]
    keyed = pa.command(pa.PaTarget("openai", "http://h:1/api/v1", None, "smol", "sk-1", 64), tmp_path / "d.json", [])
    assert keyed[keyed.index("-H") + 1] == "Authorization:Bearer sk-1" and "api/v1/chat/completions" in keyed
    assert pa.command(grpc, tmp_path / "d.json", [])[:8] == [
        "perf_analyzer", "-m", "ensemble", "-u", "127.0.0.1:8001", "-i", "grpc", "--streaming"]


def test_bench_openai_table_shows_the_medians_of_the_rounds():
    # --rounds 3: each side's three runs at one concurrency reduce to their medians, the ratio from those
    bench = load_benchmark("bench_openai")
    run = lambda side, tok, p50, p90: bench.SideResult(side, 16, 100, tok, 1.0, p50, p90)  # noqa: E731
    results = [run("grpc", 1000, 14.0, 20.0), run("openai", 950, 15.0, 21.0), run("grpc", 1100, 11.0, 15.0),
               run("openai", 900, 14.0, 20.0), run("grpc", 1050, 13.0, 19.0), run("openai", 1000, 99.0, 99.0)]
    row = [line for line in bench.table(results).splitlines() if line.startswith("| 16 |")]
    assert row == ["| 16 | 1050.0 | 950.0 | 0.905 | 13.0 / 19.0 | 15.0 / 21.0 |"]
