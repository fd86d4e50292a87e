"""Many concurrent streams through the slim ensemble path (issue 13): engine responses that carry only
what the stateless detokenizer needs for each (response.build_ensemble_outputs: `meta`, the context
window, the cancel key only now and then), and the sender thread merging what queues up per request.
Each stream must still get exactly its own tokens, in order, byte-exact text and one FINAL."""

from __future__ import annotations

import queue
import time

import pytest

from freetoken_core.config import SamplingParams

from serving_helpers import metric, scrape_metrics
from test_triton_server import MIXED, ensemble_inputs

pytestmark = pytest.mark.serving

grpcclient = pytest.importorskip("tritonclient.grpc")

N_STREAMS = 32
PROMPTS = ["The capital of France is", MIXED, "def fibonacci(n):", "Once upon a time", "🐍🚀 emoji: "]


def test_32_streams_each_get_their_own_tokens_in_order(triton_server, offline_llm):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(N_STREAMS)]
    max_tokens = [6 + i % 7 for i in range(N_STREAMS)]
    refs = offline_llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])
    before = scrape_metrics(triton_server.metrics_url)

    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    got = {str(i): {"tokens": [], "text": b"", "finals": 0, "after_final": 0} for i in range(N_STREAMS)}
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
    after = scrape_metrics(triton_server.metrics_url)
    reqs = metric(after, "nv_inference_request_success", model="detokenizer") - \
        metric(before, "nv_inference_request_success", model="detokenizer")
    # one detokenizer request per engine response; never more responses than tokens (+ a FINAL each)
    assert N_STREAMS <= reqs <= sum(max_tokens) + N_STREAMS, reqs
