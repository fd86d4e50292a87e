"""Prefix caching through the real tritonserver (issue 55): a chat's second turn, sent to the `freetoken` model as
token ids, is served from the first turn's cached pages, answers exactly as an engine without the cache does, and
shows in /metrics; once idle every page is accounted for. And benchmarks/bench_prefix_chat.py's served mode."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

import pytest

from serving_helpers import metric, scrape_metrics, wait_for
from tests.benchmark_scripts import BENCHMARKS, load_benchmark

pytestmark = pytest.mark.serving

pytest.importorskip("tritonclient.grpc")

PAGE = 16  # the test server's page_size (conftest.SERVER_PARAMS)


@pytest.fixture(scope="module")
def llm_without_cache(smollm2_path: str):
    """The test server's engine settings with enable_prefix_caching off: the reference of every cached turn."""
    from freetoken_core.llm import LLM

    llm = LLM(smollm2_path, dtype="float32", device="cpu", max_running_req=16, page_size=16, num_pages=512,
              max_seq_len=1024, enable_prefix_caching=False)
    yield llm
    llm.close()


def _prefix_metrics(server) -> dict[str, float]:
    m = scrape_metrics(server.metrics_url)
    return {name: metric(m, f"freetoken_{name}") for name in (
        "prefix_cache_queries_total", "prefix_cache_hits_total", "prefix_cache_pages", "num_requests_running",
        "num_requests_waiting", "kv_cache_free_pages", "kv_cache_total_pages")}


def test_second_turn_is_served_from_the_cache(triton_server, llm_without_cache):
    from freetoken_core import SamplingParams

    chat = load_benchmark("bench_prefix_chat")
    rng = random.Random(55)
    turn1 = [rng.randrange(100, 49152) for _ in range(70)]  # random ids: nothing else on the server shares them
    before = _prefix_metrics(triton_server)
    client = chat.TurnClient(triton_server.grpc_url)
    try:
        out1, cached1, _ = client.generate(turn1, 8)
        turn2 = turn1 + out1 + [rng.randrange(100, 49152) for _ in range(6)]
        out2, cached2, _ = client.generate(turn2, 8)
    finally:
        client.close()
    assert cached1 == 0
    assert len(turn1) // PAGE * PAGE <= cached2 < len(turn2), (cached2, len(turn1), len(turn2))
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ref1, ref2 = llm_without_cache.generate([turn1, turn2], params)
    assert out1 == ref1.token_ids and out2 == ref2.token_ids
    assert ref2.num_cached_tokens == 0  # the reference really prefilled everything

    def idle_with_hits():
        m = _prefix_metrics(triton_server)
        done = (m["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] >= cached2
                and not m["num_requests_running"] and not m["num_requests_waiting"])
        return m if done else None

    m = wait_for(idle_with_hits, 10)
    assert m, _prefix_metrics(triton_server)
    assert m["prefix_cache_queries_total"] - before["prefix_cache_queries_total"] >= len(turn1) + len(turn2)
    # both turns' pages stay cached while nothing runs (the pool of 512 pages is far from full)
    assert m["prefix_cache_pages"] >= len(turn2) // PAGE
    # once idle every page is free or cached; the free-pages gauge counts cached pages no request holds
    # (evictable on demand), so free == total is the whole accounting, and no cached page is still locked
    assert m["kv_cache_free_pages"] == m["kv_cache_total_pages"] == 512
    assert m["prefix_cache_pages"] <= m["kv_cache_free_pages"]


def _tiny_chat(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"conversations": 2, "turns": 2, "system_len": 40, "user_len": 6,
                                 "max_tokens": 4, "seed": 3, **kw})


def test_served_chat_benchmark_matches_the_engine(triton_server, llm_without_cache):
    """The served closed loop (2 conversations x 2 turns) gives the offline run's tokens, with turn 2 cached."""
    chat = load_benchmark("bench_prefix_chat")
    args = _tiny_chat()
    served = chat.run_served(triton_server.grpc_url, args, 49152)
    offline = chat.run(llm_without_cache, args)
    assert served["tokens"] == offline["tokens"] and len(served["tokens"]) == 4
    # each turn 2 finds at least its own turn 1's prompt (46 tokens: 2 pages) cached
    assert served["cached_prompt_tokens"] >= 2 * (46 // PAGE * PAGE) and offline["cached_prompt_tokens"] == 0
    assert served["prompt_tokens"] == offline["prompt_tokens"] == 2 * (46 + 56)
    assert served["ttft_p50_ms_turns_2plus"] > 0 and served["total_tok_s"] > 0


def test_served_chat_benchmark_command_line(triton_server):
    r = subprocess.run([sys.executable, str(BENCHMARKS / "bench_prefix_chat.py"), "--served", triton_server.grpc_url,
                        "--conversations", "2", "--turns", "2", "--system-len", "40", "--user-len", "6",
                        "--max-tokens", "4"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(BENCHMARKS.parent)})
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["prompt_tokens"] == 2 * (46 + 56) and report["cached_prompt_tokens"] >= 64, report


def test_served_compare_reports_the_server_s_memory_plan(tmp_path):
    """--compare keeps what explains a run's numbers from each server's log: its page / snapshot split and how often
    it retracted a request."""
    chat = load_benchmark("bench_prefix_chat")
    log = tmp_path / "server.log"
    log.write_text(
        "I1207 model.py:1] engine ready: /m; 3 pages of 16 tokens\n"
        "W1207 factory.py:57] prefix cache: 17 linear-state snapshot slots for max_running_req=64: ...\n"
        "I1207 factory.py:60] prefix cache: 17 linear-state snapshot slots of 61.50 MiB (1.02 GiB) beside 90 K/V pages\n"
        "I1207 scheduler.py:430] retracting request 7 (2100 tokens) to free KV pages\n"
        "I1207 scheduler.py:430] retracting request 9 (2300 tokens) to free KV pages\n"
        "I1207 other.py:1] unrelated\n")
    server = chat.server_plan(log)
    assert server["retractions"] == 2
    assert server["plan"][0] == "engine ready: /m; 3 pages of 16 tokens"
    assert len(server["plan"]) == 3 and all(line.startswith("prefix cache: 17") for line in server["plan"][1:])
    assert chat.server_plan(tmp_path / "missing.log") == {"plan": [], "retractions": 0}
