"""EngineLoop without a server: a transport that records what Triton's response sender would get.
A slow transport makes streaming messages pile up; they must merge into fewer responses whose
tokens, order, stateless-detokenized text and single FINAL flag are exactly right."""

from __future__ import annotations

import threading
import time

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.serving.engine_proc.engine_loop import EngineLoop, LoopOptions
from freetoken_core.serving.triton.request import ParsedRequest
from freetoken_core.serving.triton.response import read_ensemble_meta
from freetoken_core.serving.triton.text_models import detokenize_response


def tokens_of(out: dict):
    """A response's new tokens: the full response's next_tokens, or those packed in the slim one's meta."""
    return out["next_tokens"] if "next_tokens" in out else read_ensemble_meta(out["meta"]).next_tokens


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


def assert_streams_exact(transport: "RecordingTransport", expected, tokenizer) -> None:
    """Each stream h{i} got exactly expected[i]'s tokens in order, its text exact, one FINAL flag, on its last response."""
    for i, exp in enumerate(expected):
        responses = transport.sent[f"h{i}"]
        assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
        assert [int(t) for out, _, _ in responses for t in tokens_of(out)] == exp.token_ids
        text = "".join(
            detokenize_response(tokenizer, out)["text_output"][0].decode("utf-8") for out, _, _ in responses
        )
        assert text == exp.text


def stream_through_loop(llm, prompts, params, transport: RecordingTransport, options: LoopOptions) -> RecordingTransport:
    """Stream every prompt through an EngineLoop on llm's scheduler; returns the transport."""
    transport.expected = len(prompts)
    loop = EngineLoop(llm.scheduler, transport, options, owns_scheduler=False)
    loop.start()
    try:
        for i, p in enumerate(prompts):
            loop.submit(f"h{i}", ParsedRequest(input_ids=llm.encode(p), params=params, stream=True))
        assert transport.done.wait(120)
    finally:
        loop.stop()
    return transport


# 0.2 s per send: longer than an engine step even on a loaded 2-core CI box (at 0.05 s a slow run sent every
# token alone and the merge the test is about never happened)
@pytest.mark.parametrize("delay_s", [0.0, 0.2])
def test_streaming_responses_merge_exactly(llm, delay_s):
    prompts = ["Write one sentence about cats.", "Dis bonjour en français, s'il te plaît.", "数到五"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = stream_through_loop(llm, prompts, params, RecordingTransport(delay_s), LoopOptions())
    for i, exp in enumerate(expected):
        responses = transport.sent[f"h{i}"]
        assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
        tokens = [int(t) for out, _, _ in responses for t in tokens_of(out)]
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
        sizes = [len(tokens_of(out)) for out, _, _ in responses]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 23
        assert len(responses) <= 1 + 22 // 4 + 1
        assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
        assert [int(t) for out, _, _ in responses for t in tokens_of(out)] == exp.token_ids
        text = "".join(
            detokenize_response(llm.tokenizer, out)["text_output"][0].decode("utf-8") for out, _, _ in responses
        )
        assert text == exp.text


def test_nonstream_probes_go_only_to_ensemble_requests_and_end_with_one_final(llm):
    """Probes: internal, non-final, only for non-streaming requests that carry a cancel key (from the
    ensemble); the real response is the last one, with the only FINAL flag."""
    transport = RecordingTransport(0.0)
    transport.expected = 2
    loop = EngineLoop(llm.scheduler, transport, LoopOptions(nonstream_probe_interval_s=0.01),
                      owns_scheduler=False)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ids = llm.encode("Write one sentence about cats.")
    loop.start()
    try:
        loop.submit("ens", ParsedRequest(input_ids=ids, params=params, from_ensemble=True))
        loop.submit("direct", ParsedRequest(input_ids=ids, params=params))
        assert transport.done.wait(120)
    finally:
        loop.stop()
    ens, direct = transport.sent["ens"], transport.sent["direct"]
    assert [f for _, _, f in ens].count(True) == 1 and ens[-1][2] and len(ens) > 1
    probes = [out for out, _, _ in ens[:-1]]
    assert all(out["probe"][0] and tokens_of(out).size == 0 and out["cancel_key"][0] for out in probes)
    assert "probe" not in ens[-1][0] and tokens_of(ens[-1][0]).size == 24
    assert len(direct) == 1 and "probe" not in direct[0][0] and "cancel_key" not in direct[0][0]


def run_acked_streams(llm, prompts, params, transport: RecordingTransport, options: LoopOptions,
                      before_stop=None, together: bool = False) -> None:
    """Stream every prompt as the ensemble's tokenizer step would send it (cancel key, acks asked for).
    together: every request is in the loop's inbox before its engine thread starts, so all are admitted in one
    step and are in flight at once from the first step to the last (else a busy host may admit the first alone)."""
    transport.expected = len(prompts)
    loop = EngineLoop(llm.scheduler, transport, options, owns_scheduler=False)
    if not together:
        loop.start()
    try:
        for i, p in enumerate(prompts):
            loop.submit(f"h{i}", ParsedRequest(input_ids=llm.encode(p), params=params, stream=True,
                                               from_ensemble=True, detok_acks=True))
        if together:
            loop.start()
        assert transport.done.wait(120)
        if before_stop is not None:
            before_stop(loop)
    finally:
        loop.stop()


class AckingTransport(RecordingTransport):
    """The ensemble's detokenizer as the engine sees it: acks each streamed response `ack_delay_s`
    after its send (serving/stream/cancel.py AckSender), and records the most responses a request ever had
    sent but not acked."""

    def __init__(self, ack_delay_s: float) -> None:
        super().__init__(0.0)
        from freetoken_core.serving.stream.cancel import AckSender

        self.ack_delay_s = ack_delay_s
        self.acks = AckSender()
        self.unacked: dict[str, int] = {}
        self.most_unacked = 0

    def send(self, handle, outputs, error, final) -> None:
        super().send(handle, outputs, error, final)
        meta = None if outputs is None else outputs.get("meta")
        ack_ids = None if meta is None else read_ensemble_meta(meta).ack
        if ack_ids is None:
            return
        counted = not final  # a last response (acked only with send_order) never counts in the window
        with self.lock:
            if counted:
                self.unacked[handle] = self.unacked.get(handle, 0) + 1
                self.most_unacked = max(self.most_unacked, self.unacked[handle])

        def ack() -> None:
            with self.lock:
                if counted:
                    self.unacked[handle] -= 1
                self.acks.add(*ack_ids)
                self.acks.flush()

        threading.Timer(self.next_delay(), ack).start()

    def next_delay(self) -> float:
        return self.ack_delay_s


class SlowAfterFirstAck(AckingTransport):
    """The first response is acked at once (so the loop knows acks arrive), every later one late."""

    def __init__(self, late_s: float) -> None:
        super().__init__(late_s)
        self.first = True

    def next_delay(self) -> float:
        first, self.first = self.first, False
        return 0.0 if first else self.ack_delay_s


@pytest.mark.parametrize("ack_delay_s", [0.0, 0.6])
def test_flow_control_merges_only_while_the_detokenizer_is_behind(llm, ack_delay_s):
    """Ensemble streams with one response in flight: acks that come at once leave every step its own
    response; late acks make tokens wait and merge (never two unacked at once); tokens, text and the
    single FINAL flag stay exact either way."""
    prompts = ["Write one sentence about cats.", "数到五"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = AckingTransport(ack_delay_s)
    run_acked_streams(llm, prompts, params, transport, LoopOptions(max_inflight=1))
    assert transport.most_unacked == 1
    for i, exp in enumerate(expected):
        responses = transport.sent[f"h{i}"]
        assert [final for _, _, final in responses].count(True) == 1 and responses[-1][2]
        sizes = [tokens_of(out).size for out, _, _ in responses]
        assert sizes[0] == 1  # the first token never waits
        assert [int(t) for out, _, _ in responses for t in tokens_of(out)] == exp.token_ids
        text = "".join(
            detokenize_response(llm.tokenizer, out)["text_output"][0].decode("utf-8") for out, _, _ in responses
        )
        assert text == exp.text
        if ack_delay_s:
            assert len(responses) < len(exp.token_ids)  # merged while acks were late
        else:
            assert len(responses) >= len(exp.token_ids) - 2  # one step, one response (a race or two aside)


def test_a_late_ack_is_waited_for_once_acks_are_known_to_arrive(llm):
    """Acks later than ack_timeout_s (the "no acks at all" probe) but sooner than ack_lost_s: the stream
    keeps one response in flight (what keeps it in order across detokenizer instances) and merges."""
    params = SamplingParams(max_tokens=48, ignore_eos=True)  # generation outlasts ack_timeout_s
    expected = llm.generate(["Hi"], params)[0]
    transport = SlowAfterFirstAck(late_s=1.5)
    transport.expected = 1
    loop = EngineLoop(llm.scheduler, transport, LoopOptions(max_inflight=1, ack_timeout_s=0.5, ack_lost_s=30.0),
                      owns_scheduler=False)
    loop.start()
    try:
        loop.submit("h0", ParsedRequest(input_ids=llm.encode("Hi"), params=params, stream=True,
                                        from_ensemble=True, detok_acks=True))
        assert transport.done.wait(60)
    finally:
        loop.stop()
    assert transport.most_unacked == 1
    responses = transport.sent["h0"]
    assert [int(t) for out, _, _ in responses for t in tokens_of(out)] == expected.token_ids
    assert len(responses) < len(expected.token_ids)  # merged while waiting


def test_streams_without_detok_acks_are_not_paced(llm):
    """A request that asks for a cancel key but not for pacing (a client emulating the tokenizer step
    without a detokenizer that acks) is never held back waiting for acks."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    transport = RecordingTransport(0.0)  # acks nothing
    transport.expected = 1
    loop = EngineLoop(llm.scheduler, transport, LoopOptions(max_inflight=1, ack_timeout_s=30.0),
                      owns_scheduler=False)
    loop.start()
    try:
        loop.submit("h0", ParsedRequest(input_ids=llm.encode("Hi"), params=params, stream=True,
                                        from_ensemble=True))
        assert transport.done.wait(20)  # paced, it would wait 30 s for the first ack that never comes
    finally:
        loop.stop()
    responses = transport.sent["h0"]
    assert sum(tokens_of(out).size for out, _, _ in responses) == 12
    # no ack ids asked for
    assert all(read_ensemble_meta(out["meta"]).ack is None for out, _, _ in responses if "meta" in out)


class ConcurrentTransport(RecordingTransport):
    """Sends from several threads at once, each taking a different time: a stream whose responses
    reached two workers, or one worker that overtook its own queue, would show out of order."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.in_flight = 0
        self.most_in_flight = 0
        self.threads: set[str] = set()

    def send(self, handle, outputs, error, final) -> None:
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.threads.add(threading.current_thread().name)
            n = len(self.sent.get(handle, []))
        time.sleep(0.002 * ((hash(handle) + n) % 5))
        with self.lock:
            self.in_flight -= 1
        super().send(handle, outputs, error, final)


def test_send_workers_keep_each_stream_in_order_with_one_final(llm):
    """sender_threads=4: eight streams spread over four send workers that send concurrently; each stream
    still gets exactly its own tokens, in order, its text exact, one FINAL last."""
    prompts = [f"Count to {n} in words:" for n in range(3, 11)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = stream_through_loop(llm, prompts, params, ConcurrentTransport(), LoopOptions(sender_threads=4))
    assert transport.most_in_flight > 1 and len(transport.threads) > 1  # the workers did overlap
    assert_streams_exact(transport, expected, llm.tokenizer)


def test_send_workers_stand_aside_for_a_lone_stream(llm):
    """sender_threads=2 with one stream: each response is the only one due, so the thread that builds it sends it
    (no hand-off to a worker, whose wake-up would delay every token); the stream stays exact with one FINAL."""
    prompts = ["Count to 7 in words:"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = stream_through_loop(llm, prompts, params, ConcurrentTransport(), LoopOptions(sender_threads=2))
    assert not any(name.startswith("freetoken-send-") for name in transport.threads), transport.threads
    assert_streams_exact(transport, expected, llm.tokenizer)


def test_send_workers_send_when_several_streams_run(llm):
    """sender_threads=2 with several streams: their responses go through the workers (a send on the sender thread
    would hold back the other streams' responses that come due meanwhile)."""
    prompts = [f"Count to {n} in words:" for n in range(3, 7)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = llm.generate(prompts, params)
    transport = stream_through_loop(llm, prompts, params, ConcurrentTransport(), LoopOptions(sender_threads=2))
    assert any(name.startswith("freetoken-send-") for name in transport.threads), transport.threads
    assert_streams_exact(transport, expected, llm.tokenizer)


def test_max_queued_requests_refuses_at_once_and_frees_as_requests_start(llm):
    """Requests not yet generating count against max_queued_requests; one past it gets one error response (FINAL)
    naming the limit; the others run; once they started, new requests are taken again."""
    transport = RecordingTransport(0.0)
    transport.expected = 3
    loop = EngineLoop(llm.scheduler, transport, LoopOptions(max_queued_requests=2), owns_scheduler=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(3):  # the engine thread is not running yet: none of them can start
        loop.submit(f"h{i}", ParsedRequest(input_ids=llm.encode("Hello"), params=params, stream=True))
    loop.start()
    try:
        assert transport.done.wait(120)
        (outputs, error, final), = transport.sent["h2"]
        assert outputs is None and final and "max_queued_requests=2" in error
        assert all(r[-1][2] and r[-1][1] is None for r in (transport.sent["h0"], transport.sent["h1"]))
        transport.done.clear()
        transport.expected = 4
        loop.submit("h3", ParsedRequest(input_ids=llm.encode("Hello"), params=params, stream=True))
        assert transport.done.wait(120)
        assert transport.sent["h3"][-1][1] is None
    finally:
        loop.stop()
