"""Against the real tritonserver: each of issue 52's accepted-nonsense values is refused with its field (and
limit) named, over HTTP generate, in the sampling_parameters JSON, and on the freetoken and detokenizer models
called directly over gRPC, WHILE two greedy streams run; those finish with exactly the offline text.
A temperature below 1e-5 samples greedily."""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest

from freetoken_core.config import SamplingParams
from tests.serving.test_triton_server import PROMPT, Stream, _input, _post, ensemble_inputs

pytestmark = pytest.mark.serving

grpcclient = pytest.importorskip("tritonclient.grpc")

VOCAB = 49152  # SmolLM2
STREAM_PROMPTS = ["Count slowly from one to one hundred.", PROMPT]
STREAM_TOKENS = 400  # long enough to outlast every bad request of this module


class GreedyStreams:
    """Two greedy ensemble streams on one gRPC stream, collected on a thread of their own."""

    def __init__(self, url: str) -> None:
        self.stream = Stream(url)
        for i, prompt in enumerate(STREAM_PROMPTS):
            self.stream.client.async_stream_infer("ensemble", ensemble_inputs(prompt, STREAM_TOKENS, ignore_eos=True),
                                                  request_id=f"g{i}")
        self.result: dict | None = None
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        self.result = self.stream.collect(len(STREAM_PROMPTS), timeout=900)

    def running(self) -> bool:
        return self.thread.is_alive()


@pytest.fixture(scope="module")
def greedy_streams(triton_server):
    streams = GreedyStreams(triton_server.grpc_url)
    yield streams
    streams.thread.join(900)
    streams.stream.close()


def _generate(server, body: dict) -> tuple[int, dict]:
    status, text = _post(f"http://{server.http_url}/v2/models/ensemble/generate", body)
    return status, json.loads(text)


def _grpc_first(server, model: str, inputs: list, parameters: dict | None = None) -> tuple[object, str | None]:
    """The first response (or error) of one request on a fresh gRPC stream."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, parameters=parameters)
        result, error = q.get(timeout=120)
    finally:
        client.stop_stream()
        client.close()
    return result, None if error is None else str(error)


def _sp(**d) -> dict:
    return {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 8, **d})}


HTTP_CASES = [  # (body, what the error must say)
    (_sp(top_k=10**23, temperature=1.0), f"top_k must be -1 or 0 (disabled) or in [1, {VOCAB}] (the vocabulary size)"),
    (_sp(seed=10**30), "seed must be in [0, 9223372036854775807]"),
    (_sp(ignore_eos=2), "ignore_eos must be true or false, got 2"),
    (_sp(stop={"a": 1}), "stop must be a list of str"),
    (_sp(stop=[None]), "stop must be a string, got None"),
    (_sp(stop=[1, 2]), "stop must be a string, got 1"),
    (_sp(stop_token_ids=[1.7]), "stop_token_ids must be an integer, got 1.7"),
    (_sp(stop_token_ids=[1e20]), f"stop_token_ids must be integers in [0, {VOCAB - 1}] (the vocabulary)"),
    (_sp(temperature=1e39), "temperature must be in [0, 3.403e+38]"),
    (_sp(logprobs=1.5), "logprobs must be an integer, got 1.5"),
    (_sp(min_tokens=9), "min_tokens=9 is larger than max_tokens=8"),
    ({"text_input": PROMPT, "max_token": 100, "temprature": 0.5}, "unknown request field(s) ['max_token', 'temprature']"),
    ({"text_input": PROMPT, "max_tokens": 8, "parameters": {"colour": "red"}}, "unknown request field(s) ['colour']"),
    ({"text_input": PROMPT, "max_tokens": 8, "top_k": 100000}, f"top_k must be -1 or 0 (disabled) or in [1, {VOCAB}]"),
    ({"text_input": PROMPT, "max_tokens": 8, "random_seed": 2**64 - 1}, "seed must be in [0, 9223372036854775807]"),
    ({"text_input": PROMPT, "max_tokens": 8, "seed": -1}, "seed must be in [0, 9223372036854775807]"),
    ({"text_input": PROMPT, "max_tokens": 8, "min_tokens": -1}, "min_tokens must be in [0, "),
]


@pytest.mark.parametrize("body, match", HTTP_CASES, ids=[m[:40] for _, m in HTTP_CASES])
def test_http_generate_refuses_naming_the_field(triton_server, greedy_streams, body, match):
    assert greedy_streams.running(), "the greedy streams ended before the bad requests: raise STREAM_TOKENS"
    status, out = _generate(triton_server, body)
    assert status >= 400 and match in out.get("error", ""), out


IDS = [504, 3458, 282]
GRPC_CASES = [  # (model, inputs, request parameters, what the error must say)
    ("freetoken", [_input("top_k", 100000, "INT32")], None, f"top_k must be -1 or 0 (disabled) or in [1, {VOCAB}]"),
    ("freetoken", [_input("stop_token_ids", [2, VOCAB], "INT32")], None,
     f"stop_token_ids must be integers in [0, {VOCAB - 1}]"),
    ("freetoken", [_input("random_seed", 2**64 - 1, "UINT64")], None, "seed must be in [0, 9223372036854775807]"),
    ("freetoken", [_input("sampling_parameters", json.dumps({"top_k": 10**23, "temperature": 1.0}), "BYTES")], None,
     "top_k must be -1 or 0"),
    ("freetoken", [], {"max_token": 100}, "unknown request field(s) ['max_token']"),
    ("detokenizer", [], None, f"next_tokens: token id 60000 is outside the vocabulary [0, {VOCAB})"),
]


@pytest.mark.parametrize("model, extra, parameters, match", GRPC_CASES, ids=[c[3][:40] for c in GRPC_CASES])
def test_direct_model_call_refuses_naming_the_field(triton_server, greedy_streams, model, extra, parameters, match):
    assert greedy_streams.running(), "the greedy streams ended before the bad requests: raise STREAM_TOKENS"
    if model == "freetoken":
        inputs = [_input("input_ids", IDS, "INT32"), _input("max_tokens", 4, "INT32")] + extra
    else:
        inputs = [_input("next_tokens", [60000], "INT32"), _input("context_tokens", [504], "INT32"),
                  _input("finished", True, "BOOL")]
    _, error = _grpc_first(triton_server, model, inputs, parameters)
    assert error is not None and match in error, error


def test_tiny_temperature_is_greedy_and_genai_perf_payloads_pass(triton_server, greedy_streams, offline_llm):
    ref = offline_llm.generate([PROMPT], SamplingParams(max_tokens=8))[0]
    for body in (_sp(temperature=1e-40), {"text_input": PROMPT, "max_tokens": 8, "temperature": 1e-40},
                 # genai-perf's tensorrtllm and vllm payloads over HTTP generate: no key is refused
                 {"text_input": PROMPT, "max_tokens": 8, "min_length": 8, "stream": False},
                 {"text_input": PROMPT, "exclude_input_in_output": True, "stream": False,
                  "sampling_parameters": json.dumps({"max_tokens": "8", "min_tokens": "8"})}):
        status, out = _generate(triton_server, body)
        assert status == 200 and out["text_output"] == ref.text and out["next_tokens"] == ref.token_ids, (body, out)


def test_greedy_streams_finish_with_their_exact_text(greedy_streams, offline_llm):
    """Last in the module: the two streams that ran through every bad request above."""
    refs = offline_llm.generate(STREAM_PROMPTS, SamplingParams(max_tokens=STREAM_TOKENS, ignore_eos=True))
    t0 = time.monotonic()
    greedy_streams.thread.join(900)
    assert not greedy_streams.running(), f"streams still running after {time.monotonic() - t0:.0f} s"
    got = greedy_streams.result
    for i, ref in enumerate(refs):
        g = got[f"g{i}"]
        assert g["error"] is None, g
        assert g["tokens"] == ref.token_ids and g["text"].decode() == ref.text, f"stream {i}"
