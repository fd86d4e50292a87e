"""Prefix caching of a gated-delta-net hybrid (tiny random Qwen3-Next) through the real tritonserver (issue 55):
chats sharing a 64-token prefix, sent to the `freetoken` model as token ids, one request cancelled mid-stream.
The snapshot pool shows on /metrics: a running request's snapshot is taken from the free count, and once idle
every slot is free or evictable (free == total), with prefix hits, and the cached turns answer as an engine
without the cache does."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest

from freetoken_core import SamplingParams
from serving_helpers import metric, scrape_metrics, serve_checkpoint, wait_for
from tests.benchmark_scripts import load_benchmark
from tests.models.hybrid_checkpoints import make_tiny_hybrid
from tests.serving.conftest import SERVER_PARAMS

pytestmark = pytest.mark.serving

grpcclient = pytest.importorskip("tritonclient.grpc")

PAGE = 16  # SERVER_PARAMS' page_size
PREFIX = 64
STATE_GB = "0.0005"  # a few dozen snapshots of this tiny model reserved beside the 512 pages, not half of them


@pytest.fixture(scope="module")
def hybrid_server(smollm2_path, tmp_path_factory):
    path = make_tiny_hybrid(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next", vocab_size=49152)
    params = {**SERVER_PARAMS, "prefix_cache_state_gb": STATE_GB}
    handle = serve_checkpoint(path, smollm2_path, tmp_path_factory.mktemp("triton-hybrid"), params)
    yield path, handle
    handle.stop()


def _gauges(server) -> dict[str, float]:
    m = scrape_metrics(server.metrics_url)
    names = ("prefix_cache_snapshot_slots_total", "prefix_cache_snapshot_slots_free", "prefix_cache_snapshot_slots",
             "prefix_cache_hits_total", "num_requests_running", "num_requests_waiting", "kv_cache_free_pages",
             "kv_cache_total_pages")
    try:
        return {name: metric(m, f"freetoken_{name}") for name in names}
    except KeyError:  # not pushed yet
        return {}


def _idle(server) -> dict[str, float] | None:
    g = _gauges(server)
    done = g and not g["num_requests_running"] and not g["num_requests_waiting"] and (
        g["kv_cache_free_pages"] == g["kv_cache_total_pages"])
    return g if done else None


def _cancel_mid_stream(server, ids: list[int]) -> None:
    """Streams `ids` with room for 400 tokens; once it runs with a snapshot taken (free < total on /metrics),
    cancels it and waits until the engine is idle again."""
    c = grpcclient.InferenceServerClient(server.grpc_url)
    first = threading.Event()
    c.start_stream(callback=lambda result, error: first.set())
    inputs = []
    for name, value, dtype in (("input_ids", ids, "INT32"), ("max_tokens", [400], "INT32"), ("stream", [True], "BOOL"),
                               ("ignore_eos", [True], "BOOL")):
        t = grpcclient.InferInput(name, [len(value)], dtype)
        t.set_data_from_numpy(np.array(value, dtype=np.int32 if dtype == "INT32" else bool))
        inputs.append(t)
    c.async_stream_infer("freetoken", inputs)
    try:
        assert first.wait(60)
        taken = wait_for(lambda: (g := _gauges(server)) and g["prefix_cache_snapshot_slots_free"]
                         < g["prefix_cache_snapshot_slots_total"], 10)
        assert taken, _gauges(server)
    finally:
        c.stop_stream(cancel_requests=True)
        c.close()
    # aborted: its snapshot went to the cache, where it counts as free again (evictable)
    back = wait_for(lambda: (g := _idle(server)) and g["prefix_cache_snapshot_slots_free"]
                    == g["prefix_cache_snapshot_slots_total"], 20)
    assert back, _gauges(server)


def test_snapshot_slots_all_back_once_idle(hybrid_server):
    path, server = hybrid_server
    chat = load_benchmark("bench_prefix_chat")
    rng = random.Random(55)

    def words(n: int) -> list[int]:  # random ids: nothing else shares them
        return [rng.randrange(100, 49152) for _ in range(n)]

    prefix = words(PREFIX)
    users = [prefix + words(6) for _ in range(3)]
    assert wait_for(lambda: _idle(server), 30)
    before = _gauges(server)
    assert before["prefix_cache_snapshot_slots_total"] > 0, before  # the pool exists (and is empty: nothing ran)
    assert before["prefix_cache_snapshot_slots_free"] == before["prefix_cache_snapshot_slots_total"]

    client = chat.TurnClient(server.grpc_url)
    try:
        out_a, cached_a, _ = client.generate(users[0], 8)  # cached: its pages and its end state
        # the prefix's pages are cached but no state at its end: this request's prefill stops at 64 tokens for a
        # snapshot, which it holds while it runs (taken from the free count) and gives to the cache when cancelled
        _cancel_mid_stream(server, prefix + words(10))
        turns = [(users[1], 8), (users[2], 8)]
        outs = [client.generate(ids, n) for ids, n in turns]
        second = users[0] + out_a + words(5)
        outs.append(client.generate(second, 8))
        turns.append((second, 8))
    finally:
        client.close()
    assert cached_a == 0
    assert [cached for _, cached, _ in outs[:2]] == [PREFIX, PREFIX]  # the divergence point's snapshot
    assert outs[2][1] >= len(users[0]) // PAGE * PAGE  # the first turn (pages and its tail state)

    hits = 2 * PREFIX + outs[2][1]

    def idle_after_all() -> dict[str, float] | None:  # an idle push from between two requests is not enough
        g = _idle(server)
        return g if g and g["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= hits else None

    idle = wait_for(idle_after_all, 20)
    assert idle, _gauges(server)
    # the whole accounting: every slot free or holding an evictable cached snapshot, none held or lost
    total = idle["prefix_cache_snapshot_slots_total"]
    assert idle["prefix_cache_snapshot_slots_free"] == total == before["prefix_cache_snapshot_slots_total"] > 0
    assert 0 < idle["prefix_cache_snapshot_slots"] <= total

    from freetoken_core.llm import LLM

    with LLM(str(path), dtype="float32", device="cpu", max_running_req=16, page_size=PAGE, num_pages=512,
             max_seq_len=1024, enable_prefix_caching=False) as llm:
        refs = llm.generate([ids for ids, _ in turns], SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o for o, _, _ in outs] == [r.token_ids for r in refs]
