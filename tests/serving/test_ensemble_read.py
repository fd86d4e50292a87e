"""The frontend's reading of an ensemble response (serving/openai/ensemble_client.py): each output decoded once,
the same values as tritonclient's own `as_numpy`, on a real ModelInferResponse as Triton sends it."""

from __future__ import annotations

import numpy as np
import pytest

grpc_service = pytest.importorskip("tritonclient.grpc.service_pb2")
from tritonclient.grpc import InferResult  # noqa: E402
from tritonclient.utils import serialize_byte_tensor  # noqa: E402

from freetoken_core.serving.openai.ensemble_client import decode_outputs, read_step  # noqa: E402


def _response(outputs: dict[str, tuple[str, np.ndarray]], no_raw: str | None = None):
    """A ModelInferResponse with these outputs (name -> (Triton datatype, array)) in raw_output_contents; `no_raw`
    is an output sent in the typed `contents` field instead, last, as an older server may."""
    response = grpc_service.ModelInferResponse(model_name="ensemble", id="r1")
    for name, (datatype, array) in outputs.items():
        out = response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        if name == no_raw:
            out.contents.bytes_contents.extend([bytes(v) for v in array.reshape(-1)])
            continue
        raw = serialize_byte_tensor(array).item() if datatype == "BYTES" else array.tobytes()
        response.raw_output_contents.append(raw)
    return response


def test_decoded_outputs_are_as_numpy_s_values():
    outputs = {
        "text_output": ("BYTES", np.array([" héllo".encode()], dtype=np.object_)),
        "next_tokens": ("INT32", np.array([[17, 4, 99]], dtype=np.int32)),
        "logprobs": ("FP32", np.array([-0.5, -1.25, -3.0], dtype=np.float32)),
        "finish_reason": ("BYTES", np.array([b"length"], dtype=np.object_)),
        "num_input_tokens": ("INT32", np.array([20], dtype=np.int32)),
        "num_output_tokens": ("INT32", np.array([3], dtype=np.int32)),
        "num_cached_tokens": ("INT32", np.array([16], dtype=np.int32)),
        "top_logprob_ids": ("INT32", np.array([17, 3, 4, 5, 99, 7], dtype=np.int32)),
        "top_logprobs": ("FP32", np.array([-0.5, -2, -1.25, -1.5, -3, -4], dtype=np.float32)),
        "empty": ("INT32", np.zeros((0,), dtype=np.int32)),
        "typed": ("BYTES", np.array([b"x", b"yz"], dtype=np.object_)),
    }
    response = _response(outputs, no_raw="typed")
    decoded = decode_outputs(response)
    assert set(decoded) == set(outputs)
    for name in outputs:
        assert decoded[name] == InferResult(response).as_numpy(name).reshape(-1).tolist(), name
    step = read_step(response)
    assert step.text == " héllo" and step.token_ids == (17, 4, 99) and step.logprobs == (-0.5, -1.25, -3.0)
    assert type(step.token_ids[0]) is int and type(step.logprobs[0]) is float
    assert step.finish_reason == "length"
    assert (step.num_input_tokens, step.num_output_tokens, step.num_cached_tokens) == (20, 3, 16)
    assert step.top_logprobs == (((17, -0.5), (3, -2.0)), ((4, -1.25), (5, -1.5)), ((99, -3.0), (7, -4.0)))


def test_a_response_without_the_optional_outputs():
    step = read_step(_response({"text_output": ("BYTES", np.array([b""], dtype=np.object_))}))
    assert step.text == "" and step.token_ids == () and step.logprobs == () and step.finish_reason == ""
    assert step.num_input_tokens is None and step.num_cached_tokens is None and step.top_logprobs == ()


def test_the_request_is_the_one_tritonclient_builds():
    """EnsembleRequest.infer_request against tritonclient's own InferInput path: the same protobuf message."""
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc._utils import _get_inference_request
    from tritonclient.utils import np_to_triton_dtype

    from freetoken_core.serving.openai.ensemble_client import EnsembleRequest

    request = EnsembleRequest(messages=[{"role": "user", "content": "héllo"}], input_ids=(5, 6, 7), max_tokens=9,
                              temperature=0.5, seed=3, ignore_eos=True, stop_words=("a", "bc"), top_logprobs=2,
                              return_logprobs=True)
    inputs = []
    for name, value in request.tensors().items():
        tensor = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    expected = _get_inference_request("ensemble", inputs, "", "r7", None, 0, False, False, 0, None, None)
    assert request.infer_request("ensemble", "r7") == expected
