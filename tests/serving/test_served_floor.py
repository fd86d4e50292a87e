"""benchmarks/served_floor.py's repository serves: each streamed request gets one response a token, the last one
FINAL, never sooner than its engine's own schedule (the floor's ideal)."""

from __future__ import annotations

import pytest

from tests.benchmark_scripts import load_benchmark

pytest.importorskip("tritonclient.grpc")


@pytest.mark.parametrize("extra", [0, 2])
def test_floor_streams_one_response_a_token_on_its_schedule(tmp_path, extra):
    """extra: more small tensors at each hop (--extra-tensors) change nothing the client counts."""
    from freetoken_core.serving.launch.server import spawn_tritonserver, wait_ready
    from freetoken_core.serving.launch.tritonserver import find_tritonserver

    try:
        find_tritonserver()
    except RuntimeError as e:
        pytest.skip(f"no tritonserver: {e}")
    floor = load_benchmark("served_floor")
    ttft_ms, step_ms, tokens = 5.0, 2.0, 6
    repo = floor.write_repository(tmp_path / "repo", ttft_ms, step_ms, extra)
    handle = spawn_tritonserver(repo, log_path=tmp_path / "server.log")
    try:
        wait_ready(handle, 120, models=floor.MODELS)
        rows = floor.python_client(handle.grpc_url, 4, tokens)
    finally:
        handle.stop()
    engine_s = (ttft_ms + (tokens - 1) * step_ms) / 1e3
    assert [responses for _, _, responses in rows] == [tokens] * 4  # the FINAL rides on the last token's response
    assert all(latency >= engine_s and ttft >= ttft_ms / 1e3 for latency, ttft, _ in rows), rows
    table = floor.summary(rows, ttft_ms, step_ms, tokens)
    assert table.splitlines()[2].startswith(f"| 4 | {engine_s * 1e3:.2f} |")
