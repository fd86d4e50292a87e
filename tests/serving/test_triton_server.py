"""Against a real tritonserver (tests/serving/conftest.py): the ensemble and the freetoken model
answer like the offline LLM, concurrently, byte for byte, and fail bad requests one by one."""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from freetoken_core.config import SamplingParams

from serving_helpers import metric, scrape_metrics, wait_for

pytestmark = pytest.mark.serving

grpcclient = pytest.importorskip("tritonclient.grpc")

PROMPT = "The capital of France is"
MIXED = "把这句话翻译成英文并保留表情：我爱写代码 🐍🚀！然后写 Python: print('你好, 世界')"


# --- helpers --------------------------------------------------------------------------------------
def _input(name: str, value, dtype: str):
    arr = np.array(value if isinstance(value, list) else [value])
    if dtype == "BYTES":
        arr = np.array([v.encode() if isinstance(v, str) else v for v in arr.reshape(-1)], dtype=object)
    else:
        arr = arr.astype({"INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32,
                          "BOOL": bool}[dtype])
    t = grpcclient.InferInput(name, list(arr.shape), dtype)
    t.set_data_from_numpy(arr)
    return t


def ensemble_inputs(text: str, max_tokens: int, stream: bool = True, **extra):
    types = {"temperature": "FP32", "top_p": "FP32", "top_k": "INT32", "min_tokens": "INT32", "min_length": "INT32",
             "exclude_input_in_output": "BOOL", "ignore_eos": "BOOL", "sampling_parameters": "BYTES",
             "apply_chat_template": "BOOL", "stop_words": "BYTES", "return_logprobs": "BOOL"}
    ins = [_input("text_input", text, "BYTES"), _input("max_tokens", max_tokens, "INT32"), _input("stream", stream, "BOOL")]
    return ins + [_input(k, v, types[k]) for k, v in extra.items()]


class Stream:
    """One gRPC bidirectional stream; collects responses per request id."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)))

    def collect(self, n_requests: int, timeout: float = 120.0) -> dict[str, dict]:
        """Read until n_requests saw their final response (or an error)."""
        out: dict[str, dict] = {}
        done = 0
        deadline = time.monotonic() + timeout
        while done < n_requests:
            result, error = self.q.get(timeout=max(0.1, deadline - time.monotonic()))
            if error is not None:
                rid = getattr(error, "request_id", None) or "?"
                out.setdefault(rid, {"text": b"", "tokens": [], "error": None})["error"] = str(error)
                done += 1
                continue
            resp = result.get_response()
            rid = resp.id
            r = out.setdefault(rid, {"text": b"", "tokens": [], "error": None, "n": 0})
            final = resp.parameters.get("triton_final_response")
            if final is not None and final.bool_param and not resp.outputs:
                done += 1
                continue
            text = result.as_numpy("text_output")
            r["text"] += b"".join(text.reshape(-1))
            r["tokens"] += result.as_numpy("next_tokens").reshape(-1).tolist()
            r["finish_reason"] = result.as_numpy("finish_reason").reshape(-1)[0].decode()
            logprobs = result.as_numpy("logprobs")  # only when the request asked for them (return_logprobs)
            r["logprobs"] = r.get("logprobs", []) + ([] if logprobs is None else [logprobs.reshape(-1).tolist()])
            r["sizes"] = r.get("sizes", []) + [result.as_numpy("next_tokens").size]
            r["n"] = r.get("n", 0) + 1
            if final is not None and final.bool_param:
                done += 1
        return out

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def offline(llm, prompts: list[str], max_tokens: list[int]):
    return llm.generate(prompts, [SamplingParams(max_tokens=m) for m in max_tokens])


def _post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


# --- correctness ----------------------------------------------------------------------------------
def test_grpc_stream_equals_offline(triton_server, offline_llm):
    ref = offline(offline_llm, [PROMPT], [16])[0]
    s = Stream(triton_server.grpc_url)
    try:
        s.client.async_stream_infer("ensemble", ensemble_inputs(PROMPT, 16), request_id="r0",
                                    enable_empty_final_response=True)
        got = s.collect(1)["r0"]
    finally:
        s.close()
    assert got["error"] is None
    assert got["text"].decode() == ref.text
    assert got["tokens"] == ref.token_ids
    assert got["finish_reason"] == ref.finish_reason
    assert got["n"] >= 2  # it streamed


def test_logprobs_come_only_when_asked_one_per_token(triton_server, offline_llm):
    """return_logprobs=true: every streamed response carries one logprob per token it brings, those the engine
    computed offline; without it no response carries a logprobs output at all (one tensor fewer a response)."""
    ref = offline_llm.generate([PROMPT], [SamplingParams(max_tokens=8, logprobs=0)])[0]
    s = Stream(triton_server.grpc_url)
    try:
        s.client.async_stream_infer("ensemble", ensemble_inputs(PROMPT, 8, return_logprobs=True), request_id="lp",
                                    enable_empty_final_response=True)
        s.client.async_stream_infer("ensemble", ensemble_inputs(PROMPT, 8), request_id="plain",
                                    enable_empty_final_response=True)
        got = s.collect(2)
    finally:
        s.close()
    asked, plain = got["lp"], got["plain"]
    assert asked["error"] is None and plain["error"] is None
    assert asked["tokens"] == plain["tokens"] == ref.token_ids
    assert [len(lp) for lp in asked["logprobs"]] == asked["sizes"]  # each response: one per token
    np.testing.assert_allclose([v for lp in asked["logprobs"] for v in lp], ref.logprobs, rtol=1e-4, atol=1e-4)
    assert plain["logprobs"] == []


def test_http_generate_stream_and_non_streaming_equal_offline(triton_server, offline_llm):
    ref = offline(offline_llm, [PROMPT], [16])[0]
    base = f"http://{triton_server.http_url}/v2/models/ensemble"
    status, body = _post(f"{base}/generate_stream", {"text_input": PROMPT, "max_tokens": 16, "stream": True})
    assert status == 200, body
    events = [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) >= 2
    assert "".join(e["text_output"] for e in events) == ref.text
    assert events[-1]["finish_reason"] == ref.finish_reason

    status, body = _post(f"{base}/generate", {"text_input": PROMPT, "max_tokens": 16})
    assert status == 200, body
    one = json.loads(body)
    assert one["text_output"] == ref.text and one["next_tokens"] == ref.token_ids
    assert one["num_input_tokens"] == len(ref.prompt_token_ids) and one["num_output_tokens"] == len(ref.token_ids)

    # Triton's HTTP/gRPC unary infer refuses models with a decoupled step; gRPC clients send stream=false
    # on a stream and get one response. With exclude_input_in_output=false the prompt is echoed (vLLM backend).
    st = Stream(triton_server.grpc_url)
    try:
        st.client.async_stream_infer("ensemble", ensemble_inputs(PROMPT, 16, stream=False, exclude_input_in_output=False),
                                     request_id="one")
        got = st.collect(1)["one"]
    finally:
        st.close()
    assert got["n"] == 1 and got["text"].decode() == PROMPT + ref.text


def test_16_concurrent_streams(triton_server, offline_llm):
    prompts = [f"Question {i}: what is {i} plus {i * 3}? Answer:" if i % 2 else f"Write one sentence about the number {i}."
               for i in range(16)]
    lens = [6 + (i * 5) % 19 for i in range(16)]
    refs = offline(offline_llm, prompts, lens)
    s = Stream(triton_server.grpc_url)
    try:
        for i, (p, m) in enumerate(zip(prompts, lens)):
            s.client.async_stream_infer("ensemble", ensemble_inputs(p, m), request_id=f"c{i}")
        got = s.collect(16, timeout=300)
    finally:
        s.close()
    for i, ref in enumerate(refs):
        g = got[f"c{i}"]
        assert g["error"] is None, g
        assert g["tokens"] == ref.token_ids, f"request {i}"
        assert g["text"].decode() == ref.text, f"request {i}"


def test_mixed_script_stream_is_byte_exact(triton_server, offline_llm):
    """Chinese, emoji and code: multi-byte characters span tokens; the stream must not split them."""
    params = SamplingParams(max_tokens=40)
    ids = offline_llm.tokenizer.apply_chat_template([{"role": "user", "content": MIXED}], add_generation_prompt=True)
    ref = offline_llm.generate([ids], params)[0]
    s = Stream(triton_server.grpc_url)
    try:
        s.client.async_stream_infer("ensemble", ensemble_inputs(MIXED, 40, apply_chat_template=True), request_id="m")
        got = s.collect(1)["m"]
    finally:
        s.close()
    assert got["tokens"] == ref.token_ids
    assert got["text"] == ref.text.encode("utf-8")
    assert got["text"].decode("utf-8")  # every delta was whole UTF-8 (concatenation decodes strictly)
    # the model must actually have produced multi-byte text for this test to mean something
    assert any(ord(ch) > 0x7F for ch in ref.text), ref.text


def test_genai_perf_payloads(triton_server):
    """The payload shapes genai-perf writes for its tensorrtllm and vllm backends, unchanged."""
    s = Stream(triton_server.grpc_url)
    try:
        # tensorrtllm: text_input, max_tokens, stream, min_length (output-tokens deterministic)
        s.client.async_stream_infer("ensemble", [
            _input("text_input", "Tell me a story.", "BYTES"), _input("max_tokens", 8, "INT32"),
            _input("stream", True, "BOOL"), _input("min_length", 8, "INT32")], request_id="trt")
        # vllm: text_input, exclude_input_in_output, stream, sampling_parameters with string values
        s.client.async_stream_infer("ensemble", [
            _input("text_input", "Tell me a story.", "BYTES"), _input("exclude_input_in_output", True, "BOOL"),
            _input("stream", True, "BOOL"),
            _input("sampling_parameters", json.dumps({"max_tokens": "8", "min_tokens": "8"}), "BYTES")],
            request_id="vllm")
        got = s.collect(2)
    finally:
        s.close()
    for rid in ("trt", "vllm"):
        assert got[rid]["error"] is None, got[rid]
        assert len(got[rid]["tokens"]) == 8 and got[rid]["finish_reason"] == "length"


def test_stop_words_match_offline(triton_server, offline_llm):
    ref = offline_llm.generate([PROMPT], SamplingParams(max_tokens=16, stop=["answer"]))[0]
    s = Stream(triton_server.grpc_url)
    try:
        s.client.async_stream_infer("ensemble", ensemble_inputs(PROMPT, 16, stop_words=["answer"]), request_id="s")
        got = s.collect(1)["s"]
    finally:
        s.close()
    assert got["text"].decode() == ref.text and got["finish_reason"] == "stop"


# --- cancel, errors, metrics ---------------------------------------------------------------------
def _pages(triton_server) -> tuple[float, float]:
    m = scrape_metrics(triton_server.metrics_url)
    return metric(m, "freetoken_kv_cache_free_pages"), metric(m, "freetoken_kv_cache_total_pages")


def test_cancel_mid_stream_frees_pages(triton_server):
    assert wait_for(lambda: _pages(triton_server)[0] == _pages(triton_server)[1], 60)
    free0, total = _pages(triton_server)
    aborted0 = metric(scrape_metrics(triton_server.metrics_url), "freetoken_request_finished_total", finish_reason="abort")

    # token in, token out, straight to the decoupled engine model: the cancel reaches the scheduler
    c = grpcclient.InferenceServerClient(triton_server.grpc_url)
    first = threading.Event()
    c.start_stream(callback=lambda result, error: first.set())
    ids = list(range(1000, 1300))  # a prompt that holds several pages
    c.async_stream_infer("freetoken", [_input("input_ids", ids, "INT32"), _input("max_tokens", 500, "INT32"),
                                       _input("stream", True, "BOOL"), _input("ignore_eos", True, "BOOL")])
    assert first.wait(60)
    assert wait_for(lambda: _pages(triton_server)[0] < free0, 10)  # it holds pages while it runs
    c.stop_stream(cancel_requests=True)
    c.close()

    def aborted() -> float:
        return metric(scrape_metrics(triton_server.metrics_url), "freetoken_request_finished_total", finish_reason="abort")

    # aborted by the scheduler (long before its 500 tokens), and every page is back
    assert wait_for(lambda: aborted() == aborted0 + 1, 20)
    assert wait_for(lambda: _pages(triton_server)[0] == free0, 10), _pages(triton_server)

    # through the ensemble: Triton (2.51) does not mark the in-flight decoupled step cancelled, but the
    # detokenizer sees it and forwards it to the engine (serving/stream/cancel.py): aborted long before 400 tokens
    gen0 = metric(scrape_metrics(triton_server.metrics_url), "freetoken_generation_tokens_total")
    s = Stream(triton_server.grpc_url)
    s.client.async_stream_infer("ensemble", ensemble_inputs("Count slowly from one to one hundred.", 400,
                                                            ignore_eos=True), request_id="x")
    s.q.get(timeout=60)
    s.close(cancel=True)
    assert wait_for(lambda: aborted() == aborted0 + 2, 20)
    assert wait_for(lambda: _pages(triton_server)[0] == free0, 20), _pages(triton_server)
    assert metric(scrape_metrics(triton_server.metrics_url), "freetoken_generation_tokens_total") - gen0 < 300
    assert _post(f"http://{triton_server.http_url}/v2/models/ensemble/generate",
                 {"text_input": PROMPT, "max_tokens": 4})[0] == 200
    assert _pages(triton_server)[1] == total


@pytest.mark.parametrize("body, match", [
    ({"max_tokens": 8}, "text_input"),
    ({"text_input": PROMPT, "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"text_input": PROMPT, "max_tokens": -5}, "max_tokens must be >= 1"),
    ({"text_input": PROMPT, "max_tokens": 100000}, "exceeds the limit"),
    ({"text_input": "hello " * 1500, "max_tokens": 8}, "limit is"),
    ({"text_input": PROMPT, "max_tokens": 8, "top_p": 2.0}, "top_p"),
    ({"text_input": PROMPT, "sampling_parameters": "{max_tokens: 3"}, "not valid JSON"),
    ({"text_input": PROMPT, "max_tokens": "eight"}, ""),  # wrong type: refused by Triton itself
])
def test_bad_input_fails_alone(triton_server, body, match):
    base = f"http://{triton_server.http_url}/v2/models/ensemble/generate"
    status, text = _post(base, body)
    assert status >= 400, text
    assert match in json.loads(text)["error"], text
    status, text = _post(base, {"text_input": PROMPT, "max_tokens": 4})
    assert status == 200 and json.loads(text)["num_output_tokens"] == 4, text


def test_wrong_dtype_grpc_fails_alone(triton_server):
    st = Stream(triton_server.grpc_url)
    try:
        bad = [_input("text_input", PROMPT, "BYTES"), _input("max_tokens", 8.0, "FP32"), _input("stream", True, "BOOL")]
        st.client.async_stream_infer("ensemble", bad, request_id="bad")
        err = st.collect(1)["?"]["error"]
        assert "max_tokens" in err and "FP32" in err and "INT32" in err, err
        st.client.async_stream_infer("ensemble", ensemble_inputs(PROMPT, 4), request_id="ok")
        assert len(st.collect(1)["ok"]["tokens"]) == 4
    finally:
        st.close()


def test_metrics_after_traffic(triton_server):
    _post(f"http://{triton_server.http_url}/v2/models/ensemble/generate", {"text_input": PROMPT, "max_tokens": 8})
    time.sleep(0.3)
    m = scrape_metrics(triton_server.metrics_url)
    assert metric(m, "freetoken_time_to_first_token_seconds_count") >= 1
    assert 0 < metric(m, "freetoken_time_to_first_token_seconds_sum") / metric(m, "freetoken_time_to_first_token_seconds_count") < 60
    assert metric(m, "freetoken_time_per_output_token_seconds_count") >= 1
    assert metric(m, "freetoken_prompt_tokens_total") >= 5
    assert metric(m, "freetoken_generation_tokens_total") >= 8
    assert metric(m, "freetoken_num_requests_running") >= 0 and metric(m, "freetoken_num_requests_waiting") >= 0
    assert 0.0 <= metric(m, "freetoken_kv_cache_usage_ratio") <= 1.0
    assert metric(m, "freetoken_kv_cache_total_pages") > 0


def test_num_pages_option_and_total_pages_metric_agree(triton_server):
    from tests.serving.conftest import SERVER_PARAMS

    m = scrape_metrics(triton_server.metrics_url)
    assert metric(m, "freetoken_kv_cache_total_pages") == int(SERVER_PARAMS["num_pages"])
