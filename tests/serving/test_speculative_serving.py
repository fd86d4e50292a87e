"""Speculative decoding through the served ensemble: responses carry several next_tokens per step,
the text is still exactly the offline (non-speculative) greedy text, and the engine model reports
acceptance counts."""

from __future__ import annotations

import queue

import pytest

from freetoken_core import SamplingParams
from tests.serving.conftest import SERVER_PARAMS
from tests.serving.test_triton_server import Stream, _input, ensemble_inputs

grpcclient = pytest.importorskip("tritonclient.grpc")

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
TEXT = "Repeat the following code exactly, with no other text:\n" + CODE * 2


@pytest.fixture(scope="module", params=["synchronous", "pipelined"])
def spec_server(smollm2_path, tmp_path_factory, request):
    """pipelined: overlap_schedule forced on (CPU), so greedy verify steps chain device-resident
    (spec/pipeline.py) as they do on CUDA."""
    from freetoken_core.serving.launch.server import start_server

    workdir = tmp_path_factory.mktemp("triton-spec")
    params = {**SERVER_PARAMS, "model_path": smollm2_path, "speculative": "ngram", "num_speculative_tokens": "4"}
    if request.param == "pipelined":
        params["overlap_schedule"] = "true"
    handle = start_server(params, repo_dir=workdir / "repo", log_path=workdir / "tritonserver.log", ready_timeout=300)
    yield handle
    handle.stop()


def test_ensemble_streams_multi_token_steps_with_exact_text(spec_server, offline_llm):
    ref = offline_llm.chat([{"role": "user", "content": TEXT}], SamplingParams(max_tokens=40))[0]
    s = Stream(spec_server.grpc_url)
    try:
        s.client.async_stream_infer("ensemble", ensemble_inputs(TEXT, 40, apply_chat_template=True),
                                    request_id="s0", enable_empty_final_response=True)
        got = s.collect(1)["s0"]
    finally:
        s.close()
    assert got["error"] is None
    assert got["tokens"] == ref.token_ids
    assert got["text"].decode() == ref.text
    assert got["n"] < len(got["tokens"])  # some responses carried several tokens


def test_engine_model_reports_acceptance(spec_server, offline_llm):
    ids = offline_llm.encode_chat([{"role": "user", "content": TEXT}])
    client = grpcclient.InferenceServerClient(spec_server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        ins = [_input("input_ids", ids, "INT32"), _input("max_tokens", 40, "INT32"), _input("stream", True, "BOOL")]
        client.async_stream_infer("freetoken", ins, request_id="t0")
        sizes, accepted, proposed = [], 0, 0
        while True:
            result, error = q.get(timeout=120)
            assert error is None, error
            sizes.append(result.as_numpy("next_tokens").size)
            accepted = int(result.as_numpy("spec_accepted")[0])
            proposed = int(result.as_numpy("spec_proposed")[0])
            if bool(result.as_numpy("finished")[0]):
                break
    finally:
        client.stop_stream()
        client.close()
    assert sum(sizes) == 40 and max(sizes) > 1
    assert 0 < accepted <= proposed
