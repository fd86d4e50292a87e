"""The requests of benchmarks/soak.py: templates of good requests, the bad requests mixed in, and one client
per transport (gRPC streaming and not, HTTP generate_stream (SSE), HTTP generate), each able to cancel mid-way."""

from __future__ import annotations

import http.client
import json
import queue
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

KINDS = ("grpc_stream", "sse", "http_generate", "grpc_nonstream")
STREAMING = {"grpc_stream": True, "sse": True, "http_generate": False, "grpc_nonstream": False}


@dataclass(frozen=True)
class Template:
    """One distinct request (its solo run is the reference for every copy of it)."""

    name: str
    inputs: dict[str, Any]  # ensemble inputs other than stream (JSON-able: HTTP bodies and gRPC alike)
    grpc_types: dict[str, str] = field(default_factory=dict)  # gRPC datatypes beyond _GRPC_TYPES (bad requests)


def make_templates(max_tokens: int) -> list[Template]:
    chat = json.dumps([{"role": "system", "content": "Answer in one short sentence."},
                       {"role": "user", "content": "Why is the sky blue?"}])
    t = []
    for i, prompt in enumerate(["The capital of France is", "Write one sentence about the sea.",
                                "List three colours:", "数到五", "def fib(n):"]):
        n = max(4, max_tokens - 3 * i)
        t.append(Template(f"greedy{i}", {"text_input": prompt, "max_tokens": n}))
    t.append(Template("seeded", {"text_input": "Tell me a short story.", "max_tokens": max_tokens,
                                 "temperature": 0.8, "top_p": 0.95, "seed": 1234}))
    t.append(Template("seeded2", {"text_input": "Name a fruit.", "max_tokens": max(4, max_tokens // 2),
                                  "temperature": 1.0, "top_k": 20, "seed": 7}))
    t.append(Template("stop", {"text_input": "Count: one, two, three, four,", "max_tokens": max_tokens,
                               "stop_words": [" six", "\n"]}))
    t.append(Template("chat", {"messages": chat, "max_tokens": max_tokens}))
    t.append(Template("chat_template", {"text_input": "Say hello in French.", "apply_chat_template": True,
                                        "max_tokens": max_tokens, "ignore_eos": True}))
    return t


# Short common words, about a token each: a shared prefix of N words is about N tokens long.
_PREFIX_WORDS = ("the sea is calm and the light on the hill is on all night so that the boats can see the rocks "
                 "near the coast when the wind is high and the rain is cold").split()
_SHARED_QUESTIONS = (" What colour is the sea?", " Who keeps the light?", " Why is the wind high?",
                     " Name a boat.")


def shared_prefix_templates(max_tokens: int, prefix_words: int) -> list[Template]:
    """Greedy requests that open with one shared prefix of `prefix_words` words (a system prompt every chat
    repeats): after the first, each finds the prefix's pages in the cache."""
    prefix = " ".join(_PREFIX_WORDS[i % len(_PREFIX_WORDS)] for i in range(prefix_words))
    return [Template(f"shared{i}", {"text_input": prefix + q, "max_tokens": max_tokens})
            for i, q in enumerate(_SHARED_QUESTIONS)]


def next_turn(tpl: Template, reply: str) -> Template:
    """A chat's second turn: the first turn's prompt, its reply and a new question (its prefix is cached)."""
    return Template(f"{tpl.name}/turn2", {**tpl.inputs, "text_input": tpl.inputs["text_input"] + reply + " Say more."})


@dataclass(frozen=True)
class BadCase:
    """A request the server must refuse with an error that names `field`, leaving every other request alone."""

    template: Template
    field: str  # the error must contain this
    kinds: tuple[str, ...] = ("grpc_stream", "http_generate")  # the transports it is sent over, in turn


def _bad(name: str, field_name: str, extra: dict[str, Any], kinds: tuple[str, ...] = ("grpc_stream", "http_generate"),
         grpc_types: dict[str, str] | None = None) -> BadCase:
    inputs = {"text_input": "The capital of France is", "max_tokens": 8, **extra}
    return BadCase(Template(f"bad:{name}", inputs, grpc_types or {}), field_name, kinds)


def _sampling(**params: Any) -> dict[str, str]:
    return {"sampling_parameters": json.dumps(params)}


# Each must be refused with an error naming its field, without touching the requests beside it (issue 52).
BAD_CASES = (
    _bad("negative_temperature", "temperature", {"temperature": -1.0}),
    _bad("zero_max_tokens", "max_tokens", {"max_tokens": 0}),
    _bad("top_p_above_1", "top_p", {"top_p": 1.5}),
    _bad("negative_top_k", "top_k", _sampling(top_k=-5)),
    _bad("unknown_sampling_key", "max_tokenz", _sampling(max_tokenz=8)),
    _bad("sampling_not_json", "sampling_parameters", {"sampling_parameters": "{max_tokens: 8"}),
    _bad("unknown_input", "max_token", {"max_token": 100}, ("grpc_stream",), {"max_token": "INT32"}),
    _bad("stop_words_not_text", "stop_words", {"stop_words": [5]}, ("grpc_stream",), {"stop_words": "INT32"}),
    # values that once overflowed the engine's step (and failed the requests sharing it) or were taken as nonsense
    _bad("huge_top_k", "top_k", _sampling(top_k=10**23)),
    _bad("huge_seed", "seed", _sampling(seed=2**70)),
    _bad("stop_not_text", "stop", _sampling(stop={"a": 1})),
    _bad("stop_token_ids_not_int", "stop_token_ids", _sampling(stop_token_ids=[1.7])),
    _bad("ignore_eos_not_bool", "ignore_eos", _sampling(ignore_eos=2)),
    _bad("unknown_http_key", "max_token", {"max_token": 100}, ("http_generate",)),
)


_GRPC_TYPES = {"text_input": "BYTES", "messages": "BYTES", "max_tokens": "INT32", "temperature": "FP32",
               "top_p": "FP32", "top_k": "INT32", "seed": "INT64", "stop_words": "BYTES", "stream": "BOOL",
               "apply_chat_template": "BOOL", "ignore_eos": "BOOL", "sampling_parameters": "BYTES"}


def grpc_inputs(grpcclient: Any, inputs: dict[str, Any], types: dict[str, str] | None = None) -> list[Any]:
    out = []
    for name, value in inputs.items():
        dtype = (types or {}).get(name) or _GRPC_TYPES[name]
        values = value if isinstance(value, list) else [value]
        if dtype == "BYTES":
            arr = np.array([v.encode() for v in values], dtype=object)
        else:
            arr = np.array(values, dtype={"INT32": np.int32, "INT64": np.int64, "FP32": np.float32, "BOOL": bool}[dtype])
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


@dataclass
class Outcome:
    template: str
    kind: str
    cancelled: bool
    text: str = ""
    finals: int = 0  # FINAL flags seen (gRPC); 1 for an HTTP reply that ended properly
    error: str | None = None
    latency_s: float = 0.0


# --- one request of each kind ---------------------------------------------------------------------
def run_grpc(url: str, tpl: Template, stream: bool, cancel_after: int | float | None) -> Outcome:
    """cancel_after: responses (streaming) or seconds (non-streaming) before stop_stream(cancel_requests=True)."""
    import tritonclient.grpc as grpcclient

    out = Outcome(tpl.name, "grpc_stream" if stream else "grpc_nonstream", cancel_after is not None)
    client = grpcclient.InferenceServerClient(url)
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    t0 = time.perf_counter()
    parts: list[str] = []
    try:
        client.async_stream_infer("ensemble", grpc_inputs(grpcclient, {**tpl.inputs, "stream": stream}, tpl.grpc_types),
                                  request_id="s", enable_empty_final_response=True)
        deadline = t0 + (cancel_after if (cancel_after is not None and not stream) else 600)
        n = 0
        while True:
            try:
                result, error = q.get(timeout=max(0.01, deadline - time.perf_counter()))
            except queue.Empty:
                break  # the non-streaming cancel point
            if error is not None:
                out.error = str(error)
                out.finals += 1
                break
            resp = result.get_response()
            if resp.outputs:
                parts.append(b"".join(result.as_numpy("text_output").reshape(-1)).decode("utf-8", "replace"))
                n += 1
            if resp.parameters["triton_final_response"].bool_param:
                out.finals += 1
                break
            if stream and cancel_after is not None and n >= cancel_after:
                break
        if not out.cancelled:
            time.sleep(0.05)  # a duplicate FINAL would show up here
            while not q.empty():
                result, error = q.get()
                if error is not None or result.get_response().parameters["triton_final_response"].bool_param:
                    out.finals += 1
    finally:
        client.stop_stream(cancel_requests=out.cancelled)
        client.close()
    out.text, out.latency_s = "".join(parts), time.perf_counter() - t0
    return out


def _http_body(tpl: Template, stream: bool) -> bytes:
    return json.dumps({**tpl.inputs, "stream": stream}).encode()


def run_sse(host: str, port: int, tpl: Template, cancel_after: int | None) -> Outcome:
    out = Outcome(tpl.name, "sse", cancel_after is not None)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v2/models/ensemble/generate_stream", _http_body(tpl, True),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        parts, n = [], 0
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out.error = event["error"]
                break
            parts.append(event.get("text_output", ""))
            n += 1
            if cancel_after is not None and n >= cancel_after:
                break  # the socket closes below, mid-stream
        else:
            out.finals = 1  # the chunked stream ended: the server sent its FINAL
        out.text = "".join(parts)
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    out.latency_s = time.perf_counter() - t0
    return out


def run_http_generate(host: str, port: int, tpl: Template, cancel_after_s: float | None) -> Outcome:
    out = Outcome(tpl.name, "http_generate", cancel_after_s is not None)
    t0 = time.perf_counter()
    if cancel_after_s is not None:  # send, wait, hang up before the reply: the disconnect Triton never reports
        body = _http_body(tpl, False)
        with socket.create_connection((host, port), timeout=30) as s:
            s.sendall(b"POST /v2/models/ensemble/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            time.sleep(cancel_after_s)
        out.latency_s = time.perf_counter() - t0
        return out
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v2/models/ensemble/generate", _http_body(tpl, False), {"Content-Type": "application/json"})
        reply = json.loads(conn.getresponse().read())
        if "error" in reply:
            out.error = reply["error"]
        else:
            out.text, out.finals = reply.get("text_output", ""), 1
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    out.latency_s = time.perf_counter() - t0
    return out


def execute(kind: str, tpl: Template, cancel: Any, grpc_url: str, http_host: str, http_port: int) -> Outcome:
    if kind in ("grpc_stream", "grpc_nonstream"):
        return run_grpc(grpc_url, tpl, kind == "grpc_stream", cancel)
    if kind == "sse":
        return run_sse(http_host, http_port, tpl, cancel)
    return run_http_generate(http_host, http_port, tpl, cancel)
