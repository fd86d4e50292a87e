"""Expert placement on CPU, CPU tensors standing in for device memory: offload (slot pools with fewer
slots than experts: forced misses and evictions), cpu and hybrid give the resident engine's greedy
tokens (which equal transformers', tests/models), batched, with speculation on and off, for a tiny
Qwen3-MoE and a tiny Qwen3.5-MoE hybrid; plus the budget rules and the CPU executor."""

from __future__ import annotations

import pytest
import torch

from freetoken_core import LLM, SamplingParams
from freetoken_core.kernels.fused_moe_ref import fused_moe_ref
from freetoken_core.moe.budget import ExpertShape, check_rebuild, clamp_batch, slots_from_budget, split_budget, step_needs
from freetoken_core.moe.cpu_executor import CpuExperts
from freetoken_core.moe.slot_pool import ExpertSlotPool
from tests.models.hybrid_checkpoints import make_tiny_hybrid
from tests.models.moe_checkpoints import PROMPTS, hf_greedy, make_tiny_moe

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
STRATEGIES = [("offload", dict(moe_cache_slots=5)), ("offload", dict(moe_cache_rate=0.5)), ("cpu", {}),
              ("hybrid", dict(moe_cache_slots=3))]


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    path = make_tiny_moe(tmp_path_factory.mktemp("offload"), "per_expert", norm_topk_prob=True)
    return path, hf_greedy(path, PROMPTS, 10)


def run(path, speculative=None, **kw):
    llm = LLM(path, dtype="float32", page_size=4, num_pages=300, max_running_req=3, speculative=speculative,
              num_speculative_tokens=1, **kw)
    outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    cache = llm.scheduler.cache
    assert cache.num_free_pages == cache.num_total_pages
    return outs, llm


@pytest.mark.parametrize("strategy,budget", STRATEGIES, ids=[f"{s}-{'-'.join(map(str, b.values())) or 'all'}" for s, b in STRATEGIES])
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_placed_experts_give_the_resident_tokens(moe_model, strategy, budget, speculative):
    path, expected = moe_model
    outs, llm = run(path, speculative, moe_strategy=strategy, **budget)
    assert outs == expected
    stats = llm.scheduler.stats().extra["moe"]
    if strategy == "offload":
        assert stats["slot_hit_rate"] < 1.0 and min(stats["misses_per_layer"]) > 5  # misses and evictions
        assert stats["bytes_copied_per_token"] > 0
        # the clamp: 5 slots hold one step of 2 requests (x 1 row x top-2), or 1 with k = 1 (2 rows)
        assert llm.scheduler.engine.resolved.max_running_req == (1 if speculative else 2)
        assert llm.config.max_running_req == 3  # the caller's config keeps what it asked for
    if strategy == "hybrid":
        assert 0.0 < stats["slot_hit_rate"] < 1.0


def test_gdn_hybrid_with_offloaded_experts(tmp_path):
    path = make_tiny_hybrid(tmp_path, "qwen3_5_moe")
    want, _ = run(path)
    for speculative in (None, "ngram"):
        got, llm = run(path, speculative, moe_strategy="offload", moe_cache_slots=5)
        assert got == want
        assert llm.scheduler.stats().extra["moe"]["slot_hit_rate"] < 1.0
        assert llm.scheduler.cache.num_free_rows == llm.scheduler.engine.resolved.max_running_req


def test_a_budget_below_one_step_is_a_clear_error(moe_model):
    path, _ = moe_model
    with pytest.raises(ValueError, match="cannot hold one decode step"):
        LLM(path, dtype="float32", num_pages=64, moe_strategy="offload", moe_cache_slots=1)
    with pytest.raises(ValueError, match="need a budget"):
        LLM(path, dtype="float32", num_pages=64, moe_strategy="offload")
    with pytest.raises(ValueError, match="unknown moe_strategy"):
        LLM(path, dtype="float32", num_pages=64, moe_strategy="fused")


SHAPE = ExpertShape(num_layers=48, num_experts=128, top_k=8, bytes_per_expert=3 * 2048 * 768 * 2)


@pytest.mark.parametrize("rows", [1, 5])
def test_decode_batch_clamp_follows_rows_per_req(rows):
    assert step_needs(4, rows, 8, 128) == min(128, 4 * rows * 8)
    plan = clamp_batch(64, rows, 8, 128, max_running_req=32)
    assert plan.max_running_req == 64 // (rows * 8) and plan.clamped
    assert plan.max_running_req * rows * 8 <= 64 < (plan.max_running_req + 1) * rows * 8
    assert not clamp_batch(128, rows, 8, 128, 32).clamped  # every expert fits: no clamp
    with pytest.raises(ValueError, match="cannot hold one decode step"):
        clamp_batch(rows * 8 - 1, rows, 8, 128, 32)


@pytest.mark.parametrize("rows", [1, 5])
def test_startup_split_and_rebuild_check(rows):
    gib = 1 << 30
    per_slot_all_layers = SHAPE.bytes_per_expert * SHAPE.num_layers
    slots = split_budget(20 * gib, kv_headroom_bytes=2 * gib, linear_state_bytes=1 * gib, shape=SHAPE,
                         min_slots=rows * 8)
    assert slots == (17 * gib) // per_slot_all_layers
    with pytest.raises(ValueError, match="one step needs"):
        split_budget(3 * gib, 2 * gib, 1 * gib, SHAPE, min_slots=rows * 8)
    plan = check_rebuild(64, rows, SHAPE, 32, free_bytes_after=30 * gib, kv_bytes=2 * gib)
    assert plan.max_running_req == 64 // (rows * 8)
    with pytest.raises(ValueError, match="GiB are available"):  # KV would not fit beside the new pools
        check_rebuild(100, rows, SHAPE, 32, free_bytes_after=16 * gib, kv_bytes=2 * gib)
    with pytest.raises(ValueError, match="cannot hold one decode step"):
        check_rebuild(rows * 8 - 1, rows, SHAPE, 32, free_bytes_after=30 * gib, kv_bytes=2 * gib)


def test_budget_forms():
    assert slots_from_budget(SHAPE, slots=40) == 40
    assert slots_from_budget(SHAPE, cache_rate=0.5) == 64
    assert slots_from_budget(SHAPE, cache_gb=SHAPE.bytes_per_expert * 48 * 10 / 2**30) == 10
    assert slots_from_budget(SHAPE, slots=1000) == 128
    with pytest.raises(ValueError, match="only one"):
        slots_from_budget(SHAPE, slots=4, cache_rate=0.5)


def _routing(t=9, e=8, k=2, h=16, i=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) * 0.3, torch.randn(e, h, i, generator=g) * 0.3
    logits = torch.randn(t, e, generator=g)
    w, ids = torch.softmax(logits, -1).topk(k, -1)
    return x, w13, w2, w, ids.to(torch.int32)


def test_cpu_executor_equals_the_reference_bitwise():
    x, w13, w2, w, ids = _routing()
    got = CpuExperts(w13, w2, threads=2).forward(x, w, ids)
    assert torch.equal(got, fused_moe_ref(x, w13, w2, w, ids))


def test_slot_pool_lru_evicts_the_least_recent_unneeded_expert():
    x, w13, w2, w, ids = _routing()
    pool = ExpertSlotPool(w13, w2, slots=3, device=torch.device("cpu"))
    pool.ensure([0, 1, 2])
    pool.ensure([0])  # 0 is now the most recent
    pool.ensure([3])  # evicts 1, the least recently used
    assert sorted(pool.resident) == [0, 2, 3] and pool.stats.misses == 4 and pool.stats.hits == 1
    assert torch.equal(pool.w13[pool.slot_of[3]], w13[3])
    torch.testing.assert_close(pool.forward(x, w, ids), fused_moe_ref(x, w13, w2, w, ids), atol=1e-5, rtol=1e-5)
