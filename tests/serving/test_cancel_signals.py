"""The Triton 2.51 behaviour the serving layer's cancellation relies on, on tiny stand-in models
(benchmarks/repro_cancel_signals.py; no LLM, ~15 s). If a Triton upgrade changes one of these (say,
it starts cancelling the in-flight decoupled step of an ensemble, or tells models about an HTTP
/generate disconnect), this test says so, and the serving layer can use the new signal."""

from __future__ import annotations

import json

import pytest

from tests.benchmark_scripts import load_benchmark

pytestmark = pytest.mark.serving

pytest.importorskip("tritonclient.grpc")


@pytest.fixture(scope="module")
def repro():
    return load_benchmark("repro_cancel_signals")


@pytest.fixture(scope="module")
def repro_server(repro, tmp_path_factory):
    from freetoken_core.serving.launch.tritonserver import find_tritonserver

    try:
        find_tritonserver()
    except RuntimeError as e:
        pytest.skip(f"no tritonserver: {e}")
    server = repro.ReproServer(tmp_path_factory.mktemp("repro"))
    yield server
    server.stop()


def test_which_model_sees_which_cancel(repro, repro_server):
    r = repro.run_cancel_cases(repro_server)
    run_s = repro.N_STEPS * repro.STEP_S
    # a decoupled model called directly sees a gRPC cancel (and an SSE client gone: the write fails)
    for case in ("grpc stream, direct", "grpc non-stream, direct", "http generate_stream, direct"):
        assert r[case]["gen_saw_cancel_at_step"] is not None and not r[case]["gen_ran_to_end"], (case, r[case])
    # inside an ensemble the engine's step is never marked cancelled; the next step scheduled is
    for case in ("grpc stream, ensemble", "grpc stream, ensemble, decoupled detok", "http generate_stream, ensemble",
                 "grpc non-stream, ensemble + probes"):
        assert r[case]["gen_ran_to_end"] and r[case]["pass_saw_cancel_after_s"] < 2.0, (case, r[case])
    # ...which for a non-streaming request without probes is only its last response
    assert r["grpc non-stream, ensemble"]["pass_saw_cancel_after_s"] >= run_s - 0.5
    # HTTP /generate: nobody is told the client left, directly or in an ensemble, probes or not
    for case in ("http generate, direct", "http generate, ensemble", "http generate, ensemble + probes"):
        out = r[case]
        assert out["gen_ran_to_end"] and out["gen_saw_cancel_at_step"] is None and not out["pass_saw_cancel"], (case, out)


def test_probes_are_invisible_and_generate_looks_like_generate_stream(repro, repro_server):
    vis = repro.probe_visibility(repro_server)
    assert vis["grpc_responses_with_outputs"] == 1 and not vis["grpc_errors"], vis
    assert vis["grpc_text"] == "[0, 1, 2, 3, 4]"
    assert vis["http_status_line"] == "HTTP/1.1 200 OK" and vis["http_body"].count('"text"') == 1, vis
    # the same body on /generate and /generate_stream reaches the model identically (only our ids differ):
    # a model cannot refuse `"stream": true` on /generate before doing the work (defect 4)
    on_generate, on_stream = repro.generate_vs_stream_parameters(repro_server)
    assert json.loads(on_generate) == {"id": "ep-generate"} and json.loads(on_stream) == {"id": "ep-stream"}
