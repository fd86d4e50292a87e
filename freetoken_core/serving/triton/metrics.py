"""Engine metrics on Triton's /metrics endpoint (pb_utils.MetricFamily), and a no-op default.

Every metric update is an IPC round trip from the Python stub to the server (~0.1-0.3 ms on the
H200 host), so none of them runs where a token waits: the engine loop pushes gauges and batched
counters (tokens, finished requests) on a timer, and the two histograms (one observation per request,
which cannot be batched) after the step's responses went to the sender (`after_step`), never between
a token's arrival and its response.
"""

from __future__ import annotations

import threading
from typing import Any

from freetoken_core.messages import EngineStats

TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    """No-op metrics (tests, offline). TritonMetrics sends the same calls to Triton."""

    def observe_ttft(self, seconds: float) -> None: ...
    def observe_tpot(self, seconds: float) -> None: ...
    def add_prompt_tokens(self, n: int) -> None: ...
    def add_generated_tokens(self, n: int) -> None: ...
    def count_finish(self, reason: str) -> None: ...
    def after_step(self) -> None:
        """Sends the histogram observations recorded since the last call (the loop calls it once a step's
        responses are with the sender)."""

    def set_engine_stats(self, stats: EngineStats) -> None: ...
    def clear_gauges(self) -> None:
        """The engine is gone (the model unloads): no gauge may keep its last value."""


class TritonMetrics(EngineMetrics):
    def __init__(self, pb_utils: Any, labels: dict[str, str]) -> None:
        MF = pb_utils.MetricFamily

        def family(name: str, desc: str, kind: Any) -> Any:
            return MF(name=name, description=desc, kind=kind)

        self._families = [
            family("freetoken_time_to_first_token_seconds", "Time from request arrival to its first token", MF.HISTOGRAM),
            family("freetoken_time_per_output_token_seconds", "Mean time per output token after the first, per request", MF.HISTOGRAM),
            family("freetoken_prompt_tokens_total", "Prompt tokens admitted", MF.COUNTER),
            family("freetoken_generation_tokens_total", "Tokens generated", MF.COUNTER),
            family("freetoken_request_finished_total", "Finished requests by finish reason", MF.COUNTER),
            family("freetoken_num_requests_running", "Requests running in the engine", MF.GAUGE),
            family("freetoken_num_requests_waiting", "Requests waiting for admission", MF.GAUGE),
            family("freetoken_kv_cache_usage_ratio", "Fraction of KV cache pages in use", MF.GAUGE),
            family("freetoken_kv_cache_free_pages", "Free KV cache pages", MF.GAUGE),
            family("freetoken_kv_cache_total_pages", "Total KV cache pages", MF.GAUGE),
            # offloaded MoE experts (moe_strategy offload / hybrid / cpu; absent otherwise)
            family("freetoken_moe_slot_hit_ratio", "Routed experts found in a device slot", MF.GAUGE),
            family("freetoken_moe_bytes_copied_per_token", "Expert bytes copied host to device per token", MF.GAUGE),
            family("freetoken_moe_layer_misses", "Expert slot misses per MoE layer", MF.GAUGE),
            family("freetoken_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache", MF.COUNTER),
            family("freetoken_prefix_cache_hits_total", "Prompt tokens served from the prefix cache", MF.COUNTER),
            family("freetoken_prefix_cache_pages", "KV pages held by the prefix cache", MF.GAUGE),
            family("freetoken_prefix_cache_snapshot_slots", "Linear-state snapshot slots held by the prefix cache",
                   MF.GAUGE),
            family("freetoken_prefix_cache_snapshot_slots_total", "Linear-state snapshots the K/V pages can hold",
                   MF.GAUGE),
            family("freetoken_prefix_cache_snapshot_slots_free",
                   "Linear-state snapshot slots free or evictable (not taken by a running request)", MF.GAUGE),
        ]
        f = self._families
        self.ttft = f[0].Metric(labels=labels, buckets=TTFT_BUCKETS)
        self.tpot = f[1].Metric(labels=labels, buckets=TPOT_BUCKETS)
        self.prompt_tokens = f[2].Metric(labels=labels)
        self.generation_tokens = f[3].Metric(labels=labels)
        self.finished = {r: f[4].Metric(labels={**labels, "finish_reason": r}) for r in FINISH_REASONS}
        self.running = f[5].Metric(labels=labels)
        self.waiting = f[6].Metric(labels=labels)
        self.kv_usage = f[7].Metric(labels=labels)
        self.kv_free = f[8].Metric(labels=labels)
        self.kv_total = f[9].Metric(labels=labels)
        self.prefix_queries, self.prefix_hits = f[13].Metric(labels=labels), f[14].Metric(labels=labels)
        self.prefix_pages, self.prefix_snapshots = f[15].Metric(labels=labels), f[16].Metric(labels=labels)
        self.snapshot_slots_total, self.snapshot_slots_free = f[17].Metric(labels=labels), f[18].Metric(labels=labels)
        self._prefix_sent = (0, 0)  # the engine's totals already counted
        self._prefix_held: tuple[int, ...] | None = None
        self._labels = labels
        self._moe: tuple[Any, Any] | None = None  # made on the first MoE stats: dense models show none
        self._moe_layers: list[Any] = []
        self._pending_prompt = 0
        self._pending_generated = 0
        self._pending_finished: dict[str, int] = {}
        self._finished_lock = threading.Lock()  # count_finish also runs on execute()'s thread (a rejected request)
        self._pending_ttft: list[float] = []
        self._pending_tpot: list[float] = []
        self._last: tuple | None = None

    def observe_ttft(self, seconds: float) -> None:
        self._pending_ttft.append(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self._pending_tpot.append(seconds)

    def add_prompt_tokens(self, n: int) -> None:
        self._pending_prompt += n

    def add_generated_tokens(self, n: int) -> None:
        self._pending_generated += n

    def count_finish(self, reason: str) -> None:
        reason = reason if reason in self.finished else "error"
        with self._finished_lock:
            self._pending_finished[reason] = self._pending_finished.get(reason, 0) + 1

    def after_step(self) -> None:
        for histogram, pending in ((self.ttft, self._pending_ttft), (self.tpot, self._pending_tpot)):
            for seconds in pending:
                histogram.observe(seconds)
            pending.clear()

    def set_engine_stats(self, stats: EngineStats) -> None:
        # counters are flushed here, on the gauge timer, to keep IPC per step at zero
        self.after_step()  # normally nothing left: the loop calls it after each step
        with self._finished_lock:
            finished, self._pending_finished = self._pending_finished, {}
        for reason, n in finished.items():
            self.finished[reason].increment(n)
        if self._pending_prompt:
            self.prompt_tokens.increment(self._pending_prompt)
            self._pending_prompt = 0
        if self._pending_generated:
            self.generation_tokens.increment(self._pending_generated)
            self._pending_generated = 0
        moe = stats.extra.get("moe") if stats.extra else None
        if moe:
            self._set_moe(moe)
        self._set_prefix(stats)
        snap = (stats.num_running, stats.num_waiting, stats.num_free_pages, stats.num_total_pages)
        if snap == self._last:
            return
        self._last = snap
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        self.kv_free.set(stats.num_free_pages)
        self.kv_total.set(stats.num_total_pages)

    def clear_gauges(self) -> None:
        for gauge in (self.running, self.waiting, self.kv_usage, self.kv_free, self.kv_total, *self._moe_layers,
                      *(self._moe or ()), *self._prefix_gauges):
            gauge.set(0)
        self._last = None
        self._prefix_sent, self._prefix_held = (0, 0), None  # a new engine counts from zero

    def _set_prefix(self, stats: EngineStats) -> None:
        queries, hits = stats.prefix_query_tokens_total, stats.prefix_hit_tokens_total
        sent_q, sent_h = self._prefix_sent
        if queries > sent_q:
            self.prefix_queries.increment(queries - sent_q)
        if hits > sent_h:
            self.prefix_hits.increment(hits - sent_h)
        self._prefix_sent = (max(queries, sent_q), max(hits, sent_h))
        held = (stats.prefix_cached_pages, stats.prefix_cached_snapshots, stats.prefix_snapshot_slots_total,
                stats.prefix_snapshot_slots_free)
        if held != self._prefix_held:  # a gauge update is an IPC round trip: only on change
            for gauge, value, before in zip(self._prefix_gauges, held, self._prefix_held or (None,) * len(held)):
                if value != before:
                    gauge.set(value)
            self._prefix_held = held

    @property
    def _prefix_gauges(self) -> tuple:
        """In the order of `_set_prefix`'s `held`."""
        return self.prefix_pages, self.prefix_snapshots, self.snapshot_slots_total, self.snapshot_slots_free

    def _set_moe(self, moe: dict) -> None:
        f = self._families
        if self._moe is None:
            self._moe = (f[10].Metric(labels=self._labels), f[11].Metric(labels=self._labels))
        self._moe[0].set(moe["slot_hit_rate"])
        self._moe[1].set(moe["bytes_copied_per_token"])
        misses = moe["misses_per_layer"]
        while len(self._moe_layers) < len(misses):
            self._moe_layers.append(f[12].Metric(labels={**self._labels, "layer": str(len(self._moe_layers))}))
        for gauge, n in zip(self._moe_layers, misses):
            gauge.set(n)
