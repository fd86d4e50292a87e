"""Defect 1 of issue 14: a cancelled non-streaming ensemble request must not keep the engine busy.

Triton 2.51 never marks the engine's in-flight step cancelled inside an ensemble, and tells no model
about a client that left HTTP /generate (benchmarks/repro_cancel_signals.py, asserted by
test_cancel_signals.py). So: with `nonstream_cancel_probe_ms` the engine probes each non-streaming
ensemble request through the (then decoupled) detokenizer, which sees a gRPC cancel and stops the
engine; and `max_nonstream_tokens` bounds what an unnoticed HTTP disconnect can waste."""

from __future__ import annotations

import json

import pytest

from freetoken_core.config import SamplingParams
from serving_helpers import metric, scrape_metrics, wait_for
from tests.serving.conftest import SERVER_PARAMS
from tests.serving.test_triton_server import PROMPT, Stream, _post, ensemble_inputs

pytestmark = pytest.mark.serving

grpcclient = pytest.importorskip("tritonclient.grpc")


@pytest.fixture(scope="module")
def probe_server(smollm2_path, tmp_path_factory):
    from freetoken_core.serving.launch.server import start_server

    workdir = tmp_path_factory.mktemp("triton-probe")
    params = {**SERVER_PARAMS, "model_path": smollm2_path, "nonstream_cancel_probe_ms": "100",
              "max_nonstream_tokens": "400"}
    handle = start_server(params, repo_dir=workdir / "repo", log_path=workdir / "tritonserver.log", ready_timeout=300)
    yield handle
    handle.stop()


def _m(server, name: str, **labels) -> float:
    return metric(scrape_metrics(server.metrics_url), name, **labels)


def test_grpc_nonstream_cancel_stops_the_engine(probe_server):
    srv = probe_server
    total = _m(srv, "freetoken_kv_cache_total_pages")
    assert wait_for(lambda: _m(srv, "freetoken_kv_cache_free_pages") == total, 30)
    aborted0 = _m(srv, "freetoken_request_finished_total", finish_reason="abort")
    gen0 = _m(srv, "freetoken_generation_tokens_total")
    s = Stream(srv.grpc_url)
    s.client.async_stream_infer("ensemble", ensemble_inputs("Count slowly from one to one hundred.", 350, stream=False,
                                                            ignore_eos=True), request_id="ns")
    assert wait_for(lambda: _m(srv, "freetoken_kv_cache_free_pages") < total, 30)  # it runs
    s.close(cancel=True)
    # aborted through the probe path long before its 350 tokens, and every page is back
    assert wait_for(lambda: _m(srv, "freetoken_request_finished_total", finish_reason="abort") == aborted0 + 1, 15)
    assert wait_for(lambda: _m(srv, "freetoken_kv_cache_free_pages") == total, 10)
    assert _m(srv, "freetoken_generation_tokens_total") - gen0 < 200


def test_probes_are_invisible_to_non_streaming_clients(probe_server, offline_llm):
    ref = offline_llm.generate([PROMPT], SamplingParams(max_tokens=24))[0]
    s = Stream(probe_server.grpc_url)
    try:
        s.client.async_stream_infer("ensemble", ensemble_inputs(PROMPT, 24, stream=False), request_id="one",
                                    enable_empty_final_response=True)
        got = s.collect(1)["one"]
    finally:
        s.close()
    assert got["error"] is None and got["n"] == 1  # one response, however many probes went by
    assert got["text"].decode() == ref.text and got["tokens"] == ref.token_ids
    status, body = _post(f"http://{probe_server.http_url}/v2/models/ensemble/generate",
                         {"text_input": PROMPT, "max_tokens": 24})
    assert status == 200 and json.loads(body)["text_output"] == ref.text, body


def test_streaming_through_the_decoupled_detokenizer_is_exact(probe_server, offline_llm):
    ref = offline_llm.generate([PROMPT], SamplingParams(max_tokens=8))[0]
    s = Stream(probe_server.grpc_url)
    try:
        s.client.async_stream_infer("ensemble", ensemble_inputs(PROMPT, 8), request_id="st",
                                    enable_empty_final_response=True)
        got = s.collect(1)["st"]
    finally:
        s.close()
    assert got["n"] >= 2 and got["text"].decode() == ref.text and got["tokens"] == ref.token_ids


def test_max_nonstream_tokens_refuses_before_any_work(triton_server):
    base = f"http://{triton_server.http_url}/v2/models/ensemble"
    prompt0 = _m(triton_server, "freetoken_prompt_tokens_total")
    status, body = _post(f"{base}/generate", {"text_input": PROMPT, "max_tokens": 65})
    assert status >= 400, body
    err = json.loads(body)["error"]
    assert "max_tokens=65 exceeds max_nonstream_tokens=64" in err and "generate_stream" in err, err
    assert _m(triton_server, "freetoken_prompt_tokens_total") == prompt0  # never admitted
    status, body = _post(f"{base}/generate_stream", {"text_input": PROMPT, "max_tokens": 65, "stream": True,
                                                     "ignore_eos": True})
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1]["num_output_tokens"] == 65, body
