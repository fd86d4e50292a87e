"""Against the real tritonserver: no client-visible response carries a cancel field, and a forged or
guessed cancel key does not cancel anyone's request (issue 14, defect 2)."""

from __future__ import annotations

import json
import queue
import time

import pytest

from freetoken_core.serving.stream.cancel import KEY_SEP, notify_cancel
from freetoken_core.serving.triton.response import read_ensemble_meta
from serving_helpers import metric, scrape_metrics, wait_for
from tests.serving.test_triton_server import PROMPT, _input, _post

pytestmark = pytest.mark.serving

grpcclient = pytest.importorskip("tritonclient.grpc")


def _no_cancel_field(obj) -> bool:
    return not any("cancel" in k for k in obj)


def test_no_client_visible_response_carries_a_cancel_field(triton_server):
    base = f"http://{triton_server.http_url}/v2/models"
    # the engine model called directly (HTTP generate with input_ids): its outputs, no cancel key
    status, body = _post(f"{base}/freetoken/generate", {"input_ids": [504, 3458, 282], "max_tokens": 3})
    assert status == 200, body
    direct = json.loads(body)
    assert direct["next_tokens"] and _no_cancel_field(direct), direct
    status, body = _post(f"{base}/ensemble/generate", {"text_input": PROMPT, "max_tokens": 3})
    assert status == 200 and _no_cancel_field(json.loads(body)), body
    status, body = _post(f"{base}/ensemble/generate_stream", {"text_input": PROMPT, "max_tokens": 3, "stream": True})
    events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    assert status == 200 and len(events) >= 2 and all(_no_cancel_field(e) for e in events), body
    # gRPC, direct, streaming: no cancel_key output in any response
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer("freetoken", [_input("input_ids", [504, 3458, 282], "INT32"),
                                                _input("max_tokens", 3, "INT32"), _input("stream", True, "BOOL")])
        names = set()
        while True:
            result, error = q.get(timeout=60)
            assert error is None, error
            names |= {o.name for o in result.get_response().outputs}
            if bool(result.as_numpy("finished")[0]):
                break
    finally:
        client.stop_stream()
        client.close()
    assert "next_tokens" in names and _no_cancel_field(names), names


def _aborted(server) -> float:
    return metric(scrape_metrics(server.metrics_url), "freetoken_request_finished_total", finish_reason="abort")


def test_a_client_cannot_claim_to_be_the_ensemble(triton_server):
    """`ensemble_key` is the tokenizer step's proof: a client that sends one is refused at once, and the old
    `return_cancel_key` input is gone (an unknown input)."""
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        for name, value, dtype in (("ensemble_key", "guess", "BYTES"), ("return_cancel_key", True, "BOOL")):
            q: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: q.put((result, error)))
            t0 = time.monotonic()
            client.async_stream_infer("freetoken", [
                _input("input_ids", [504, 3458, 282], "INT32"), _input("max_tokens", 4, "INT32"),
                _input(name, value, dtype)], enable_empty_final_response=True)
            result, error = q.get(timeout=30)
            assert error is not None and name in str(error), (name, result, error)
            assert time.monotonic() - t0 < 5
            client.stop_stream()
    finally:
        client.close()


def test_forged_cancel_keys_do_not_cancel(triton_server):
    """A request that plays the ensemble's tokenizer step (with the server's secret) learns the socket;
    tokens it makes up there cancel nothing, the real one cancels at once."""
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    aborted0 = _aborted(triton_server)
    try:
        client.async_stream_infer("freetoken", [
            _input("input_ids", [504, 3458, 282], "INT32"), _input("max_tokens", 400, "INT32"),
            _input("stream", True, "BOOL"), _input("ignore_eos", True, "BOOL"),
            _input("ensemble_key", triton_server.ensemble_secret, "BYTES")], enable_empty_final_response=True)
        result, error = q.get(timeout=60)
        assert error is None, error
        key = result.as_numpy("cancel_key")[0].decode()
        path, _, token = key.rpartition(KEY_SEP)
        for forged in (f"{path}{KEY_SEP}{'0' * 32}", f"{path}{KEY_SEP}{token[::-1]}", f"{path}{KEY_SEP}1"):
            assert notify_cancel(forged)  # delivered to the engine's socket...
        time.sleep(0.5)
        n_before = q.qsize()
        time.sleep(0.5)
        assert q.qsize() > n_before and _aborted(triton_server) == aborted0  # ...and ignored: still running
        assert notify_cancel(key)
        assert wait_for(lambda: _aborted(triton_server) == aborted0 + 1, 10)
        tokens = 1
        while True:  # the stream ends with one FINAL, long before 400 tokens
            result, error = q.get(timeout=30)
            assert error is None, error
            resp = result.get_response()
            if resp.outputs:  # a slim (ensemble-shaped) response: its tokens are packed in meta
                tokens += read_ensemble_meta(result.as_numpy("meta")).next_tokens.size
            if resp.parameters["triton_final_response"].bool_param:
                break
        assert tokens < 400
    finally:
        client.stop_stream()
        client.close()


def test_forged_detokenizer_requests_are_refused_at_once(triton_server):
    """A client that calls the detokenizer with a slim engine response it made up (naming a stream's slot in an
    order table) is refused before the detokenizer waits for that stream's turn or acks anything."""
    from freetoken_core.messages import DetokenizeMsg
    from freetoken_core.serving.triton.response import build_ensemble_outputs

    msg = DetokenizeMsg(uid=5, next_tokens=[504], finished=False)
    meta = build_ensemble_outputs(msg, [504], None, [], "", "", ack=(12345, 5, 3), order_slot=0,
                                  route_tag=(1, 2))["meta"]
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    try:
        for _ in range(3):
            q: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: q.put((result, error)))
            t0 = time.monotonic()
            client.async_stream_infer("detokenizer", [_input("meta", meta.tolist(), "INT32")], enable_empty_final_response=True)
            result, error = q.get(timeout=30)
            took = time.monotonic() - t0
            client.stop_stream()
            assert error is not None and "meta is internal" in str(error), (result, error)
            assert took < 0.5, f"refused only after {took:.2f} s"
    finally:
        client.close()


@pytest.mark.parametrize("path, body", [
    ("/v2/repository/models/ensemble/unload", {}),
    ("/v2/systemsharedmemory/region/probe/register", {"key": "/triton_python_backend_shm_region_x", "offset": 0,
                                                        "byte_size": 64}),
    ("/v2/logging", {"log_verbose_level": 1}),
    ("/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
])
def test_admin_apis_need_the_admin_header(triton_server, path, body):
    """Model control, shared-memory registration, logging and trace settings are closed to clients; the admin
    header opens the harmless ones (read the logging settings back)."""
    status, text = _post(f"http://{triton_server.http_url}{path}", body)
    assert status == 403 and "freetoken-admin" in text, (status, text)


def test_the_admin_header_opens_them(triton_server):
    import urllib.request

    req = urllib.request.Request(f"http://{triton_server.http_url}/v2/logging", headers=triton_server.admin_headers)
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and "log_verbose_level" in json.loads(r.read())
