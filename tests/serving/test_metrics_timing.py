"""Engine metrics never sit between a token and its response: every Triton metric update is an IPC round trip
from the stub, so the loop sends histogram observations after the step's responses went to the sender, and
finished-request counts with the other counters on the metrics timer (serving/triton/metrics.py)."""

from __future__ import annotations

import threading
import time

import pytest

from freetoken_core import LLM, SamplingParams
from freetoken_core.messages import EngineStats
from freetoken_core.serving.engine_proc.engine_loop import EngineLoop, LoopOptions
from freetoken_core.serving.triton.metrics import TritonMetrics
from freetoken_core.serving.triton.request import ParsedRequest


class FakePbUtils:
    """pb_utils.MetricFamily's surface; every update is logged in order (each one an IPC in Triton)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        fake = self

        class Metric:
            def __init__(self, family: str, labels: dict) -> None:
                self.family, self.labels = family, labels

            def _record(self, op: str, value: float) -> None:
                with fake.lock:
                    fake.log.append((op, self.family, self.labels.get("finish_reason"), value))

            def observe(self, value: float) -> None:
                self._record("observe", value)

            def increment(self, value: float) -> None:
                self._record("increment", value)

            def set(self, value: float) -> None:
                self._record("set", value)

        class MetricFamily:
            HISTOGRAM, COUNTER, GAUGE = "histogram", "counter", "gauge"

            def __init__(self, name: str, description: str, kind: str) -> None:
                self.name = name

            def Metric(self, labels: dict, buckets: list | None = None) -> Metric:  # noqa: N802 (pb_utils' name)
                return Metric(self.name, labels)

        self.MetricFamily = MetricFamily

    def events(self) -> list[tuple]:
        with self.lock:
            return list(self.log)


def stats() -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, num_free_pages=10, num_total_pages=10, page_size=16)


def test_updates_wait_for_their_flush_and_finishes_add_up():
    pb = FakePbUtils()
    m = TritonMetrics(pb, {"model": "freetoken"})
    m.observe_ttft(0.01)
    m.observe_tpot(0.002)
    for reason in ("length", "length", "stop", "no-such-reason"):
        m.count_finish(reason)
    assert pb.events() == []  # recording costs no IPC
    m.after_step()
    assert [(op, fam) for op, fam, _, _ in pb.events()] == [
        ("observe", "freetoken_time_to_first_token_seconds"), ("observe", "freetoken_time_per_output_token_seconds")]
    m.after_step()
    assert len(pb.events()) == 2  # each observation is sent once
    m.set_engine_stats(stats())
    finished = {reason: value for op, fam, reason, value in pb.events() if fam == "freetoken_request_finished_total"}
    assert finished == {"length": 2, "stop": 1, "error": 1}  # one increment a reason, an unknown reason is an error
    m.count_finish("stop")
    m.set_engine_stats(stats())
    assert [v for op, fam, r, v in pb.events() if fam == "freetoken_request_finished_total" and r == "stop"] == [1, 1]


def test_prefix_cache_counters_send_deltas_and_gauges_only_on_change():
    pb = FakePbUtils()
    m = TritonMetrics(pb, {"model": "freetoken"})

    def prefix_events() -> list[tuple]:
        return [(op, fam, v) for op, fam, _, v in pb.events() if "prefix_cache" in fam]

    def with_prefix(q: int, h: int, pages: int, slots: int = 0, free_slots: int = 0) -> EngineStats:
        return EngineStats(0, 0, 10, 10, 16, prefix_query_tokens_total=q, prefix_hit_tokens_total=h,
                           prefix_cached_pages=pages, prefix_snapshot_slots_total=slots,
                           prefix_snapshot_slots_free=free_slots)

    total, free = "freetoken_prefix_cache_snapshot_slots_total", "freetoken_prefix_cache_snapshot_slots_free"
    m.set_engine_stats(with_prefix(100, 60, 4))
    m.set_engine_stats(with_prefix(100, 60, 4))  # nothing new: no IPC
    m.set_engine_stats(with_prefix(130, 60, 5))
    assert prefix_events() == [
        ("increment", "freetoken_prefix_cache_queries_total", 100), ("increment", "freetoken_prefix_cache_hits_total", 60),
        ("set", "freetoken_prefix_cache_pages", 4), ("set", "freetoken_prefix_cache_snapshot_slots", 0),
        ("set", total, 0), ("set", free, 0),
        ("increment", "freetoken_prefix_cache_queries_total", 30), ("set", "freetoken_prefix_cache_pages", 5)]


def test_snapshot_slot_gauges_follow_the_pool_and_clear():
    """A hybrid's snapshot pool: total and free-or-evictable slots, each sent when it changes; zero on unload."""
    pb = FakePbUtils()
    m = TritonMetrics(pb, {"model": "freetoken"})

    def slot_events() -> list[tuple]:
        return [(op, fam, v) for op, fam, _, v in pb.events() if "snapshot_slots_" in fam]

    for n in (8, 6, 6, 8):  # idle, two taken by a running request, the same again, idle
        m.set_engine_stats(EngineStats(0, 0, 10, 10, 16, prefix_snapshot_slots_total=8, prefix_snapshot_slots_free=n))
    m.clear_gauges()
    total, free = "freetoken_prefix_cache_snapshot_slots_total", "freetoken_prefix_cache_snapshot_slots_free"
    assert slot_events() == [("set", total, 8), ("set", free, 8), ("set", free, 6), ("set", free, 8),
                             ("set", total, 0), ("set", free, 0)]


class RecordingTransport:
    def __init__(self) -> None:
        self.done = threading.Event()

    def send(self, handle, outputs, error, final) -> None:
        if final:
            self.done.set()

    def is_cancelled(self, handle) -> bool:
        return False


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", max_running_req=2)


def test_no_metric_update_between_a_token_and_its_response(llm):
    pb = FakePbUtils()
    transport = RecordingTransport()
    loop = EngineLoop(llm.scheduler, transport, LoopOptions(metrics_interval_s=60.0, idle_wait_s=0.05),
                      TritonMetrics(pb, {"model": "freetoken"}), owns_scheduler=False)
    post = loop.sender.post

    def logged_post(items):  # what the engine thread hands the sender, in the same log as the metric updates
        for item in items or []:
            msg = item[1] if len(item) == 2 else None
            if msg is not None and msg.next_tokens and msg.num_output_tokens == len(msg.next_tokens):
                pb.log.append(("post", "first token", None, 0))
            if msg is not None and msg.finished:
                pb.log.append(("post", "last token", None, 0))
        post(items)

    loop.sender.post = logged_post
    loop.start()
    try:
        loop.submit("h0", ParsedRequest(input_ids=llm.encode("Count to five."),
                                        params=SamplingParams(max_tokens=6, ignore_eos=True), stream=True))
        assert transport.done.wait(120)
        deadline = time.monotonic() + 10  # idle for idle_wait_s: the counters and gauges go out
        while not any(fam == "freetoken_request_finished_total" for _, fam, _, _ in pb.events()):
            assert time.monotonic() < deadline, pb.events()
            time.sleep(0.01)
    finally:
        loop.stop()
    names = [f"{op} {fam}" for op, fam, _, _ in pb.events()]
    assert names.index("post first token") < names.index("observe freetoken_time_to_first_token_seconds")
    last = names.index("post last token")
    assert last < names.index("observe freetoken_time_per_output_token_seconds")
    assert last < names.index("increment freetoken_request_finished_total")
