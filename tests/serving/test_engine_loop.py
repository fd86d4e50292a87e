"""EngineLoop without a server: a transport that records what Triton's response sender would get.
A slow transport makes streaming messages pile up; they must merge into fewer responses whose
tokens, order, stateless-detokenized text and single FINAL flag are exactly right."""

from __future__ import annotations

import threading
import time

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.serving.engine_loop import EngineLoop, LoopOptions
from freetoken_core.serving.request import ParsedRequest
from freetoken_core.serving.text_models import detokenize_response


class RecordingTransport:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.sent: dict[str, list[tuple[dict | None, str | None, bool]]] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.expected = 0

    def send(self, handle, outputs, error, final) -> None:
        time.sleep(self.delay_s)  # a slow IPC send: messages queue up behind it
        with self.lock:
            self.sent.setdefault(handle, []).append((outputs, error, final))
            if final and sum(1 for r in self.sent.values() if r[-1][2]) == self.expected:
                self.done.set()

    def is_cancelled(self, handle) -> bool:
        return False


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", max_running_req=8)


def stream_through_loop(llm, prompts, params, transport: RecordingTransport, options: LoopOptions) -> RecordingTransport:
    """Stream every prompt through an EngineLoop on llm's scheduler; returns the transport."""
    transport.expected = len(prompts)
    loop = EngineLoop(llm.scheduler, transport, options)
    loop.start()
    try:
        for i, p in enumerate(prompts):
            loop.submit(f"h{i}", ParsedRequest(input_ids=llm.encode(p), params=params, stream=True))
        assert transport.done.wait(120)
    finally:
        loop.stop()
    return transport


@pytest.mark.parametrize("delay_s", [0.0, 0.05])
def test_streaming_responses_merge_exactly(llm, delay_s):
    prompts = ["Write one sentence about cats.", "Dis bonjour en français, s'il te plaît.", "数到五"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = stream_through_loop(llm, prompts, params, RecordingTransport(delay_s), LoopOptions())
    for i, exp in enumerate(expected):
        responses = transport.sent[f"h{i}"]
        assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
        tokens = [int(t) for out, _, _ in responses for t in out["next_tokens"]]
        assert tokens == exp.token_ids
        text = "".join(
            detokenize_response(llm.tokenizer, out)["text_output"][0].decode("utf-8") for out, _, _ in responses
        )
        assert text == exp.text
        if delay_s:
            assert len(responses) < len(tokens)  # merged while the transport was busy


def test_stream_interval_holds_tokens_but_not_the_first(llm):
    """stream_interval=4: the first token goes out alone, then responses of at least 4 tokens, the
    last one whatever is left; tokens, text and the single FINAL flag stay exact."""
    prompts = ["Write one sentence about cats.", "数到五"]
    params = SamplingParams(max_tokens=23, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = stream_through_loop(llm, prompts, params, RecordingTransport(0.0), LoopOptions(stream_interval=4))
    for i, exp in enumerate(expected):
        responses = transport.sent[f"h{i}"]
        sizes = [len(out["next_tokens"]) for out, _, _ in responses]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 23
        assert len(responses) <= 1 + 22 // 4 + 1
        assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
        assert [int(t) for out, _, _ in responses for t in out["next_tokens"]] == exp.token_ids
        text = "".join(
            detokenize_response(llm.tokenizer, out)["text_output"][0].decode("utf-8") for out, _, _ in responses
        )
        assert text == exp.text


def test_nonstream_probes_go_only_to_ensemble_requests_and_end_with_one_final(llm):
    """Probes: internal, non-final, only for non-streaming requests that carry a cancel key (from the
    ensemble); the real response is the last one, with the only FINAL flag."""
    transport = RecordingTransport(0.0)
    transport.expected = 2
    loop = EngineLoop(llm.scheduler, transport, LoopOptions(nonstream_probe_interval_s=0.01))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = llm.encode("Write one sentence about cats.")
    loop.start()
    try:
        loop.submit("ens", ParsedRequest(input_ids=ids, params=params, return_cancel_key=True))
        loop.submit("direct", ParsedRequest(input_ids=ids, params=params))
        assert transport.done.wait(120)
    finally:
        loop.stop()
    ens, direct = transport.sent["ens"], transport.sent["direct"]
    assert [f for _, _, f in ens].count(True) == 1 and ens[-1][2] and len(ens) > 1
    probes = [out for out, _, _ in ens[:-1]]
    assert all(out["probe"][0] and out["next_tokens"].size == 0 and out["cancel_key"][0] for out in probes)
    assert "probe" not in ens[-1][0] and ens[-1][0]["next_tokens"].size == 24
    assert len(direct) == 1 and "probe" not in direct[0][0] and "cancel_key" not in direct[0][0]
