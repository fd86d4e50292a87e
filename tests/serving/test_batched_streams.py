"""Many concurrent streams through the slim ensemble path (issue 13): engine responses that carry only
what the stateless detokenizer needs for each (response.build_ensemble_outputs: `meta`, the context
window, the cancel key only now and then), and the sender thread merging what queues up per request.
Each stream must still get exactly its own tokens, in order, byte-exact text and one FINAL: with the
session server (one detokenizer instance on this box) and with two instances, one response in flight
per stream (the flow control that keeps a stream in order across instances, serving/stream/sender.py), four
send workers (sender_threads=4: several sends in flight at once, each request on one worker) and the step
messages through shared-memory rings (engine_msg_ring_kib, serving/engine_proc/msg_ring.py: one per instance)."""

from __future__ import annotations

import ast
import os
import queue
import time

import pytest

from freetoken_core.config import SamplingParams
from freetoken_core.serving.engine_proc.msg_ring import supported as ring_supported

from serving_helpers import metric, scrape_metrics
from test_triton_server import MIXED, ensemble_inputs

pytestmark = pytest.mark.serving

grpcclient = pytest.importorskip("tritonclient.grpc")

N_STREAMS = 32
PROMPTS = ["The capital of France is", MIXED, "def fibonacci(n):", "Once upon a time", "🐍🚀 emoji: "]


def _start_scaled(smollm2_path, workdir, env: dict[str, str], params: dict[str, str]):
    from freetoken_core.serving.launch.server import start_server
    from tests.serving.conftest import SERVER_PARAMS

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return start_server({**SERVER_PARAMS, "model_path": smollm2_path, **params},
                            repo_dir=workdir / "repo", log_path=workdir / "tritonserver.log", ready_timeout=300)
    finally:
        for k, v in old.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def scaled_out(smollm2_path, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("triton2")
    handle = _start_scaled(smollm2_path, workdir,
                           {"FREETOKEN_DETOKENIZER_INSTANCES": "2", "FREETOKEN_FREETOKEN_INSTANCES": "2"},
                           {"detok_max_inflight": "1", "sender_threads": "4", "engine_msg_ring_kib": "64"})
    for model in ("detokenizer", "freetoken"):
        assert "count: 2" in (workdir / "repo" / model / "config.pbtxt").read_text()
    from freetoken_core.serving.launch.repository import get_parameter

    assert get_parameter((workdir / "repo" / "freetoken" / "config.pbtxt").read_text(), "engine_msg_ring_kib") == "64"
    log = (workdir / "tritonserver.log").read_text()
    assert log.count("ready (shared at") == 1 and log.count("joined the shared engine") == 1  # one engine, two instances
    if ring_supported():
        assert log.count("step messages through a shared-memory ring") == 2  # each instance its own
    yield handle
    handle.stop()
    # Triton spread the streams over both instances (the engine logs what each submitted when it stops)
    line = [x for x in (workdir / "tritonserver.log").read_text().splitlines() if "requests per instance" in x]
    assert line, "the shared engine did not log its per-instance counts"
    counts = ast.literal_eval(line[-1].split("requests per instance", 1)[1].strip())
    assert set(counts) == {0, 1} and min(counts.values()) > 0, counts


@pytest.fixture(scope="module")
def ordered_out(smollm2_path, tmp_path_factory):
    """Two detokenizer instances that keep each stream in order themselves (detok_send_order): four
    responses of a stream may be in flight at once, across both instances. Also the opt-in settings: the engine
    process runs on a CPU of its own with the rest of the server on the others (engine_cpus, where the host has
    two or more), two send workers share the
    numbered responses (sender_threads=2: each stream on one worker, beside the order table), and an inflight
    budget (detok_inflight_budget=64: 4 a stream while 16 or more run, up to 64 for the last one)."""
    workdir = tmp_path_factory.mktemp("triton-ordered")
    cpus = sorted(os.sched_getaffinity(0))
    engine_cpus = str(cpus[-1]) if len(cpus) > 1 else ""
    handle = _start_scaled(smollm2_path, workdir, {"FREETOKEN_DETOKENIZER_INSTANCES": "2"},
                           {"detok_send_order": "1", "engine_cpus": engine_cpus, "sender_threads": "2",
                            "detok_inflight_budget": "64"})
    assert "count: 2" in (workdir / "repo" / "detokenizer" / "config.pbtxt").read_text()
    from freetoken_core.serving.launch.repository import get_parameter

    freetoken_config = (workdir / "repo" / "freetoken" / "config.pbtxt").read_text()
    assert get_parameter(freetoken_config, "detok_send_order") == "1"
    assert get_parameter(freetoken_config, "sender_threads") == "2"
    assert get_parameter(freetoken_config, "detok_inflight_budget") == "64"
    if engine_cpus:
        assert f"engine process on CPU(s) {engine_cpus}" in (workdir / "tritonserver.log").read_text()
        assert os.sched_getaffinity(handle.process.pid) == set(cpus[:-1])
    yield handle
    handle.stop()
    log = (workdir / "tritonserver.log").read_text()
    assert "for the one before it" not in log  # no response ever waited out its turn (send_order.py)


@pytest.mark.parametrize("server", ["triton_server", "scaled_out", "ordered_out"])
def test_32_streams_each_get_their_own_tokens_in_order(server, request, offline_llm):
    triton_server = request.getfixturevalue(server)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(N_STREAMS)]
    max_tokens = [6 + i % 7 for i in range(N_STREAMS)]
    refs = offline_llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    before = scrape_metrics(triton_server.metrics_url)

    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    got = {str(i): {"tokens": [], "text": b"", "finals": 0, "after_final": 0, "optional": set()}
           for i in range(N_STREAMS)}
    try:
        for i in range(N_STREAMS):
            client.async_stream_infer("ensemble", ensemble_inputs(prompts[i], max_tokens[i]), request_id=str(i),
                                      enable_empty_final_response=True)
        done = 0
        deadline = time.monotonic() + 300
        while done < N_STREAMS:
            result, error = q.get(timeout=max(0.1, deadline - time.monotonic()))
            assert error is None, error
            resp = result.get_response()
            r = got[resp.id]
            if r["finals"]:
                r["after_final"] += 1
            if resp.outputs:
                r["tokens"] += result.as_numpy("next_tokens").reshape(-1).tolist()
                r["text"] += b"".join(result.as_numpy("text_output").reshape(-1))
                r["optional"] |= {o.name for o in resp.outputs} & {"finish_reason", "num_input_tokens",
                                                                   "num_output_tokens", "logprobs"}
            if resp.parameters["triton_final_response"].bool_param:
                r["finals"] += 1
                done += 1
        time.sleep(0.5)  # anything after a FINAL would arrive now
        while not q.empty():
            result, _ = q.get_nowait()
            got[result.get_response().id]["after_final"] += 1
    finally:
        client.stop_stream()
        client.close()
    for i, ref in enumerate(refs):
        r = got[str(i)]
        assert r["finals"] == 1 and r["after_final"] == 0, (i, r)
        assert r["tokens"] == ref.token_ids, (i, r["tokens"], ref.token_ids)
        assert r["text"].decode("utf-8") == ref.text, (i, r["text"], ref.text)
        # optional outputs: all of them; logprobs only when asked
        expected = {"finish_reason", "num_input_tokens", "num_output_tokens"}
        assert r["optional"] == expected, (i, r["optional"])
    after = scrape_metrics(triton_server.metrics_url)
    reqs = metric(after, "nv_inference_request_success", model="detokenizer") - \
        metric(before, "nv_inference_request_success", model="detokenizer")
    # one detokenizer request per engine response; never more responses than tokens (+ a FINAL each)
    assert N_STREAMS <= reqs <= sum(max_tokens) + N_STREAMS, reqs


def test_cancel_mid_stream_scaled_out(scaled_out):
    """The cancel still reaches the engine through whichever detokenizer instance gets the next response,
    and the `freetoken` instance that holds the request aborts it in the shared engine."""
    two_detokenizers = scaled_out
    from serving_helpers import wait_for
    from test_triton_server import Stream

    def aborted() -> float:
        return metric(scrape_metrics(two_detokenizers.metrics_url), "freetoken_request_finished_total",
                      finish_reason="abort")

    def pages() -> tuple[float, float]:
        m = scrape_metrics(two_detokenizers.metrics_url)
        return metric(m, "freetoken_kv_cache_free_pages"), metric(m, "freetoken_kv_cache_total_pages")

    assert wait_for(lambda: pages()[0] == pages()[1], 60)
    a0 = aborted()
    s = Stream(two_detokenizers.grpc_url)
    s.client.async_stream_infer("ensemble", ensemble_inputs("Count slowly from one to one hundred.", 400,
                                                            ignore_eos=True), request_id="x")
    s.q.get(timeout=60)
    s.close(cancel=True)
    assert wait_for(lambda: aborted() == a0 + 1, 20)
    assert wait_for(lambda: pages()[0] == pages()[1], 20), pages()
