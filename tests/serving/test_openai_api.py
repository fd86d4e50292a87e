"""The OpenAI-compatible frontend against the real tritonserver and SmolLM2, with the official `openai` client.

One frontend process (module-scoped) in front of the session's server; the frontend process's own options, key and
lifetime are in test_openai_process.py."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from serving_helpers import metric, scrape_metrics, wait_for
from tests.serving.test_triton_server import _post

pytestmark = pytest.mark.serving

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def _frontend(triton_server, tmp_path: Path, grpc_url: str | None = None, **opts):
    from freetoken_core.serving.launch.server import free_ports
    from freetoken_core.serving.openai.process import FrontendOptions, start_frontend

    port = free_ports(1)[0]
    proc = start_frontend(grpc_url or triton_server.grpc_url, triton_server.repo_dir,
                          FrontendOptions(port=port, host="127.0.0.1", **opts), log_path=tmp_path / "frontend.log",
                          metrics_url=triton_server.metrics_url)
    return proc, port


@pytest.fixture(scope="module")
def frontend(triton_server, tmp_path_factory):
    from freetoken_core.serving.openai.process import stop_frontend

    proc, port = _frontend(triton_server, tmp_path_factory.mktemp("openai"))
    yield port
    stop_frontend(proc)


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{frontend}/v1", api_key="unused", max_retries=0, timeout=120)


def _ensemble_text(triton_server, **inputs) -> str:
    status, body = _post(f"http://{triton_server.http_url}/v2/models/ensemble/generate", inputs)
    assert status == 200, body
    return json.loads(body)["text_output"]


def _streamed_chat(client, **kw) -> tuple[str, str | None, object]:
    text, finish, usage = [], None, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


def test_models_health_and_metrics(client, frontend):
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _ = _get(f"http://127.0.0.1:{frontend}/health")
    assert status == 200
    status, text = _get(f"http://127.0.0.1:{frontend}/metrics")  # Triton's, passed through
    assert status == 200 and "freetoken_num_requests_running" in text


def test_no_engine_is_503(triton_server, tmp_path):
    """A frontend whose Triton server is not there: /health and requests answer 503, in OpenAI's error shape."""
    import urllib.error

    from freetoken_core.serving.launch.server import free_ports
    from freetoken_core.serving.openai.process import stop_frontend

    proc, port = _frontend(triton_server, tmp_path, grpc_url=f"127.0.0.1:{free_ports(1)[0]}")
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(f"http://127.0.0.1:{port}/health")
        assert e.value.code == 503
        dead = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            dead.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3)
        assert err.value.status_code == 503 and "not ready" in err.value.message
    finally:
        stop_frontend(proc)


def _get(url: str) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.read().decode()


def test_chat_streamed_equals_non_streamed_equals_ensemble(client, triton_server):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    streamed, finish, usage = _streamed_chat(client, messages=CHAT, max_tokens=24, temperature=0)
    assert text and streamed == text
    assert text == _ensemble_text(triton_server, messages=json.dumps(CHAT), max_tokens=24)
    assert finish == full.choices[0].finish_reason in ("stop", "length")
    # the same chat again: its streamed usage counts the prefix pages (16 tokens) the first request left cached
    cached = usage.prompt_tokens_details.cached_tokens
    details = {"prompt_tokens_details"}
    assert full.usage.model_dump(exclude=details) == usage.model_dump(exclude=details)
    assert full.usage.prompt_tokens // 16 * 16 - 16 <= cached < full.usage.prompt_tokens and cached > 0
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-") and full.model == MODEL


def test_completions_usage_counts_and_length(client, triton_server):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.choices[0].text == _ensemble_text(triton_server, text_input=PROMPT, max_tokens=12, ignore_eos=True)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == r.usage.model_dump()
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, echo=True,
                                       extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + r.choices[0].text


def test_unset_max_tokens_means_the_rest_of_the_context(client):
    # the server's limit is max_tokens_limit 512 (conftest): unset max_tokens asks for it, not for 16
    r = client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"min_tokens": 20})
    assert r.usage.completion_tokens > 16


def test_stop_strings(client, triton_server):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, stop=["."])
    assert r.choices[0].finish_reason == "stop" and "." not in r.choices[0].text
    assert r.choices[0].text == _ensemble_text(triton_server, text_input=PROMPT, max_tokens=20, stop_words=["."])


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_penalties_change_output_as_the_ensemble_does(client, triton_server):
    """vLLM's penalties reach the sampler: they change a greedy answer, and the OpenAI text equals the ensemble's
    with the same penalty inputs."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    for penalties in ({"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.5}):
        text = client.completions.create(**{**kw, "extra_body": {**kw["extra_body"], **penalties}}).choices[0].text
        assert text != plain, penalties
        assert text == _ensemble_text(triton_server, text_input=PROMPT, max_tokens=24, ignore_eos=True, **penalties)


def test_token_prompt_equals_its_text(client, smollm2_path):
    """A completions prompt of token ids (the ensemble's input_ids) answers as the text they encode does."""
    from freetoken_core.tokenizer.tokenize import load_tokenizer

    ids = load_tokenizer(smollm2_path).encode(PROMPT)
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    by_text = client.completions.create(prompt=PROMPT, **kw)
    by_ids = client.completions.create(prompt=ids, **kw)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    echoed = client.completions.create(prompt=[ids], echo=True, **kw)
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text


def test_top_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, logprobs=True, top_logprobs=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    for e in r.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.top_logprobs) == 4 and all(len(d) <= 2 for d in lp.top_logprobs)  # two tokens may share a text
    assert all(tok in d for tok, d in zip(lp.tokens, lp.top_logprobs))


def test_logprobs_one_per_token(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, logprobs=True,
                                       extra_body={"ignore_eos": True})
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens == 8
    assert all(e.logprob <= 0 for e in entries)
    # tokens are the raw ones (a special token too: ignore_eos goes past <|im_end|>); the content skips specials
    assert "".join(e.token for e in entries).startswith(r.choices[0].message.content)
    c = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=0, extra_body={"ignore_eos": True})
    assert len(c.choices[0].logprobs.token_logprobs) == 6


@pytest.mark.parametrize("field, extra", [
    ("n", {"n": 2}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("frequency_penalty", {"frequency_penalty": -2.01}),
    ("repetition_penalty", {"repetition_penalty": 0}),
    ("logit_bias", {"logit_bias": {"42": 5}}),
    ("top_logprobs", {"top_logprobs": 2}),  # without logprobs
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("tools", {"tools": [{"type": "function", "function": {"parameters": {}}}]}),  # no name
    ("tool_choice", {"tool_choice": {"type": "function", "function": {"name": "g"}},
                     "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("tool_choice", {"tool_choice": "required"}),  # no tools
    ("parallel_tool_calls", {"parallel_tool_calls": False,
                             "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("chat_template_kwargs", {"chat_template_kwargs": {"tokenize": True}}),
    ("temperature", {"temperature": -1}),
    ("top_p", {"top_p": 0}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 100000}),
    ("messages", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("not_a_field", {"not_a_field": 1}),
    ("stream_options", {"stream_options": {"include_usage": True}}),
])
def test_bad_chat_fields_are_400_naming_the_field(client, field, extra):
    body = {"messages": CHAT, "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, **{k: v for k, v in body.items() if k in _CHAT_KWARGS},
                                       extra_body={k: v for k, v in body.items() if k not in _CHAT_KWARGS})
    assert e.value.status_code == 400 and field in e.value.message, e.value.message
    assert e.value.body["param"] == field or field in str(e.value.body["message"])


_CHAT_KWARGS = {"messages", "max_tokens", "n", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                "top_logprobs", "response_format", "tools", "temperature", "top_p", "stream_options"}


@pytest.mark.parametrize("field, extra", [
    ("prompt", {"prompt": [1, 2, 10**9]}),
    ("prompt", {"prompt": [[1, 2], [3]]}),
    ("prompt", {"prompt": ["a", "b"]}),
    ("suffix", {"suffix": "x"}),
    ("best_of", {"best_of": 2}),
    ("logprobs", {"logprobs": 6}),
])
def test_bad_completion_fields_are_400_naming_the_field(client, field, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, **{"prompt": PROMPT, "max_tokens": 4, **extra})
    assert field in e.value.message, e.value.message


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    assert e.value.body["param"] == "model"


def _status_and_error(url: str, data: bytes | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_malformed_bodies_and_wrong_methods_are_openai_errors(frontend):
    base = f"http://127.0.0.1:{frontend}/v1"
    status, body = _status_and_error(f"{base}/chat/completions", b'{"model": "x", "messages": [')
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and "JSON" in body["error"]["message"]
    status, body = _status_and_error(f"{base}/completions", b'[1, 2]')
    assert status == 400 and body["error"]["message"], body
    status, body = _status_and_error(f"{base}/completions")  # a GET
    assert status == 405 and "POST" in body["error"]["message"]


def test_a_body_over_the_limit_is_413_before_it_is_read(frontend):
    from freetoken_core.serving.openai.post_endpoint import MAX_BODY_BYTES

    with socket.create_connection(("127.0.0.1", frontend), timeout=30) as s:  # says 1 GiB is coming, sends 10 bytes
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {2**30}\r\n\r\n{{\"model\": ".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or b"}}" not in answer:  # the head and the body may come in two reads
            chunk = s.recv(65536)
            assert chunk, answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413") and str(MAX_BODY_BYTES).encode() in answer, answer


def test_two_concurrent_streams_each_get_their_own_text(client):
    prompts = [[{"role": "user", "content": "Name a fruit."}], [{"role": "user", "content": "Count to five."}]]
    expected = [client.chat.completions.create(model=MODEL, messages=m, max_tokens=24).choices[0].message.content
                for m in prompts]
    got: list[str | None] = [None, None]

    def run(i: int) -> None:
        got[i] = _streamed_chat(client, messages=prompts[i], max_tokens=24)[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == expected and expected[0] != expected[1]


def _counts(triton_server) -> tuple[float, float]:
    m = scrape_metrics(triton_server.metrics_url)
    return (metric(m, "freetoken_request_finished_total", finish_reason="abort"),
            metric(m, "freetoken_num_requests_running"))


def _raw_post(port: int, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_the_engine_request(triton_server, frontend, stream):
    assert wait_for(lambda: _counts(triton_server)[1] == 0, 30)  # nothing else runs
    aborted0, _ = _counts(triton_server)
    s = _raw_post(frontend, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 500,
                                                "ignore_eos": True, "stream": stream})
    try:
        if stream:  # the stream is under way: its first event came
            received = b""
            while b"data:" not in received:
                chunk = s.recv(4096)
                assert chunk, received
                received += chunk
        assert wait_for(lambda: _counts(triton_server)[1] == 1, 30)  # the engine runs it
    finally:
        s.close()
    t0 = time.monotonic()
    assert wait_for(lambda: _counts(triton_server) == (aborted0 + 1, 0), 20), _counts(triton_server)
    assert time.monotonic() - t0 < 10


def test_prompt_counts_match_the_engine_for_the_default_max_tokens(client, triton_server):
    """Unset max_tokens is the rest of the context, counted with the ensemble's own tokenizer and chat parsing."""
    from freetoken_core.serving.openai.served_model import load_served_model

    model = load_served_model(triton_server.repo_dir)
    assert model.name == MODEL and model.max_tokens_limit == 512 and model.context_limit == 1024
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert model.chat_prompt_tokens(CHAT) == chat.usage.prompt_tokens
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert model.text_prompt_tokens(PROMPT) == text.usage.prompt_tokens
    assert model.default_max_tokens(1000) == 24 and model.default_max_tokens(10) == 512
    assert model.tool_format is None and model.starts_in_reasoning is None  # SmolLM2's template has neither


def test_cached_tokens_of_a_shared_prefix(client):
    """usage.prompt_tokens_details.cached_tokens: 0 for a prompt the cache has never seen, and at least the full
    pages (16 tokens, conftest) of the prefix a second prompt shares with it, non-streamed and in the usage chunk."""
    import uuid

    # a prefix no other test sends (the cache lives as long as the server), long enough for several full pages
    shared = f"Notes {uuid.uuid4().hex}: " + " ".join(f"item {i} is a small red box." for i in range(12))
    first = client.completions.create(model=MODEL, prompt=shared + " The first", max_tokens=2)
    assert first.usage.prompt_tokens >= 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=shared + " The second", max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens // 16 * 16 - 16 <= cached < second.usage.prompt_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=shared + " The third", max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached


def test_bench_openai_drives_both_sides(triton_server, frontend, tmp_path):
    """benchmarks/bench_openai.py against the served SmolLM2: each side, at each concurrency, generates exactly
    requests x output tokens (ignore_eos), and both report a first-token time; at 2 streams the clients run in
    2 processes."""
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_openai.py"),
                          "--openai-url", f"http://127.0.0.1:{frontend}/v1", "--grpc-url", triton_server.grpc_url,
                          "--concurrency", "1,2", "--requests", "4", "--warmup", "1", "--prompt-tokens", "24",
                          "--output-tokens", "3", "--client-procs", "2", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    results = json.loads(out.read_text())
    assert sorted((r["side"], r["concurrency"]) for r in results) == [("grpc", 1), ("grpc", 2), ("openai", 1),
                                                                     ("openai", 2)]
    assert all(r["requests"] == 4 and r["output_tokens"] == 12 and r["tok_s"] > 0 for r in results), results
    assert all(0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] for r in results), results
    assert "| 2 |" in run.stdout and "OpenAI / gRPC" in run.stdout
    assert run.stdout.count("2 client processes") == 2, run.stdout
