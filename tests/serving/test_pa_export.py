"""benchmarks/pa_export.py --arrivals and pa_summary.py trace read what a one-stream run's time is made of: when each
token reached the client, and the per-model timeline of any ensemble (served_floor.py's is called "floor")."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"freetoken_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _request(t0_ms: float, stamps_ms: list[float], tokens: list[int]) -> dict:
    ns = lambda ms: int(ms * 1e6)  # noqa: E731
    return {"timestamp": ns(t0_ms), "response_timestamps": [ns(t0_ms + s) for s in stamps_ms],
            "response_outputs": [{"next_tokens": list(range(n)) if n != 1 else 5} for n in tokens]}


def test_token_arrivals_follow_the_responses_that_carry_them(tmp_path):
    pa = _module("pa_export")
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
    summary = _module("pa_summary")
    trace = tmp_path / "trace.json"
    ts = lambda name, ms: {"name": name, "ns": int(ms * 1e6)}  # noqa: E731
    trace.write_text(json.dumps([
        {"id": 1, "model_name": "floor", "timestamps": [ts("GRPC_WAITREAD_END", 10), ts("REQUEST_START", 10.1)]},
        {"id": 2, "model_name": "floor_engine", "parent_id": 1, "timestamps": [ts("COMPUTE_START", 10.5)]},
    ]))
    text = summary.trace_timeline(trace)
    assert text.startswith("1 ensemble requests traced")
    assert "| 0.500 | floor_engine | COMPUTE_START | 1 |" in text
