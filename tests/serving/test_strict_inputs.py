"""Against the real tritonserver: conflicting inputs and unknown chat roles are refused, and
return_<name>=false leaves that output out of every response (HTTP generate, gRPC stream, and the
`freetoken` model called directly), as TensorRT-LLM's ensemble does."""

from __future__ import annotations

import json
import queue

import pytest

from tests.serving.test_triton_server import PROMPT, Stream, _input, _post, ensemble_inputs

pytestmark = pytest.mark.serving

grpcclient = pytest.importorskip("tritonclient.grpc")

OPTIONAL = ("finish_reason", "num_input_tokens", "num_output_tokens")


def _generate(server, body: dict) -> tuple[int, dict]:
    status, text = _post(f"http://{server.http_url}/v2/models/ensemble/generate", body)
    return status, json.loads(text)


def test_return_flags_false_leave_outputs_out_of_http_generate(triton_server):
    status, full = _generate(triton_server, {"text_input": PROMPT, "max_tokens": 4})
    assert status == 200 and set(OPTIONAL) <= set(full), full
    status, bare = _generate(triton_server, {"text_input": PROMPT, "max_tokens": 4, "return_finish_reason": False,
                                             "return_num_input_tokens": False, "return_num_output_tokens": False})
    assert status == 200, bare
    assert not set(OPTIONAL) & set(bare) and bare["text_output"] == full["text_output"], bare
    status, one = _generate(triton_server, {"text_input": PROMPT, "max_tokens": 4, "return_num_input_tokens": False,
                                            "return_finish_reason": True})
    assert status == 200 and "num_input_tokens" not in one and one["finish_reason"] == "length", one
    assert one["num_output_tokens"] == 4


def test_return_flags_false_leave_outputs_out_of_every_streamed_response(triton_server):
    s = Stream(triton_server.grpc_url)
    try:
        ins = ensemble_inputs(PROMPT, 6) + [_input("return_finish_reason", False, "BOOL"),
                                            _input("return_num_output_tokens", False, "BOOL")]
        s.client.async_stream_infer("ensemble", ins, request_id="f", enable_empty_final_response=True)
        names, n = set(), 0
        while True:
            result, error = s.q.get(timeout=120)
            assert error is None, error
            resp = result.get_response()
            names |= {o.name for o in resp.outputs}
            n += bool(resp.outputs)
            if resp.parameters["triton_final_response"].bool_param:
                break
    finally:
        s.close()
    assert n >= 2 and "text_output" in names and "num_input_tokens" in names
    assert "finish_reason" not in names and "num_output_tokens" not in names


def test_return_flags_false_on_the_engine_model_directly(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer("freetoken", [_input("input_ids", [504, 3458, 282], "INT32"),
                                                _input("max_tokens", 3, "INT32"),
                                                _input("return_num_input_tokens", False, "BOOL")])
        result, error = q.get(timeout=120)
    finally:
        client.stop_stream()
        client.close()
    assert error is None, error
    names = {o.name for o in result.get_response().outputs}
    assert "next_tokens" in names and "finish_reason" in names and "num_input_tokens" not in names


@pytest.mark.parametrize("body, match", [
    ({"text_input": PROMPT, "messages": json.dumps([{"role": "user", "content": "Hi"}]), "max_tokens": 4},
     "either text_input or messages, not both"),
    ({"messages": json.dumps([{"role": "wizard", "content": "Hi"}]), "max_tokens": 4},
     "role 'wizard'; allowed roles: system, developer, user, assistant, tool"),
    ({"messages": json.dumps([{"role": "user", "content": "Hi", "colour": "red"}]), "max_tokens": 4},
     "unknown key(s) ['colour']"),
])
def test_conflicting_or_unknown_chat_inputs_fail_alone(triton_server, body, match):
    status, out = _generate(triton_server, body)
    assert status >= 400 and match in out["error"], out
    status, ok = _generate(triton_server, {"messages": json.dumps([
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ann"}]),
        "max_tokens": 4})
    assert status == 200 and ok["num_output_tokens"] == 4, ok
