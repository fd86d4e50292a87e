"""The device-side expert cache (moe/device_cache.py, executor `offload_device`) on CPU, its kernels
under Triton's interpreter on CPU tensors standing in for device memory: fewer slots than experts give
the resident engine's (= transformers') greedy tokens, batched, with n-gram speculation on and off,
for a tiny Qwen3-MoE and a tiny Qwen3.5-MoE hybrid; prefills that route to more experts than the pool
holds stream through it; the startup self-check and its fallback to the host-driven pool; capture-like
dummy steps leave the tables consistent and the counters untouched."""

from __future__ import annotations

import logging

import pytest
import torch

from freetoken_core import LLM
from freetoken_core.config import EngineConfig
from freetoken_core.kernels.fused_moe_ref import fused_moe_ref
from freetoken_core.moe import device_cache
from freetoken_core.moe.device_cache import DeviceExpertCache, copy_self_check, preserved_counters
from freetoken_core.moe.placement import graph_safe
from freetoken_core.moe.slot_pool import ExpertSlotPool
from freetoken_core.moe.stats import MoeStats, layer_stats
from tests.models.hybrid_checkpoints import make_tiny_hybrid
from tests.moe.test_offload import _routing, moe_model, run  # noqa: F401  (the module's fixture)

CPU = torch.device("cpu")
# Triton kernels on CPU tensors run under the interpreter, which is on only where CUDA is absent; on a
# GPU machine the needs_cuda tests below cover the same kernels on the device
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors: the interpreter (no CUDA)")


def check_cache(ex: DeviceExpertCache) -> None:
    """Tables are inverse maps and every resident expert's slot holds its host weights."""
    ex.tables.check()
    for s, e in enumerate(ex.tables.expert_of.tolist()):
        if e >= 0:
            assert torch.equal(ex.w13[s].cpu(), ex.host_w13[e]) and torch.equal(ex.w2[s].cpu(), ex.host_w2[e])


@pytest.mark.parametrize("budget,speculative", [(dict(moe_cache_slots=5), None), (dict(moe_cache_slots=5), "ngram"),
                                                (dict(moe_cache_rate=0.75), None)],
                         ids=["slots5", "slots5-ngram", "rate0.75"])
def test_device_cache_gives_the_resident_tokens(moe_model, budget, speculative):
    path, expected = moe_model
    outs, llm = run(path, speculative, moe_strategy="offload", moe_device_cache="on", **budget)
    assert outs == expected
    engine = llm.scheduler.engine
    assert all(isinstance(ex, DeviceExpertCache) for ex in engine.moe_executors) and graph_safe(engine.moe_executors)
    for ex in engine.moe_executors:
        assert ex.num_slots < ex.num_experts
        check_cache(ex)
    layers = layer_stats(engine.moe_executors)
    assert all(s.overflow == 0 for s in layers)
    stats = llm.scheduler.stats().extra["moe"]
    assert stats == MoeStats(layers).summary()
    assert stats["slot_hit_rate"] < 1.0 and min(stats["misses_per_layer"]) > 5  # misses and evictions
    assert stats["bytes_copied_per_token"] > 0
    slots = engine.moe_executors[0].num_slots
    assert engine.resolved.max_running_req == min(3, slots // (engine.resolved.decode_rows_per_req * 2))


def test_device_cache_with_a_gdn_hybrid(tmp_path):
    path = make_tiny_hybrid(tmp_path, "qwen3_5_moe")
    want, _ = run(path)
    for speculative in (None, "ngram"):
        got, llm = run(path, speculative, moe_strategy="offload", moe_cache_slots=5, moe_device_cache="on")
        assert got == want
        executors = llm.scheduler.engine.moe_executors
        assert all(isinstance(ex, DeviceExpertCache) for ex in executors)
        assert llm.scheduler.stats().extra["moe"]["slot_hit_rate"] < 1.0
        for ex in executors:
            check_cache(ex)


def test_failed_self_check_falls_back_to_the_host_driven_pool(moe_model, monkeypatch, caplog):
    path, expected = moe_model
    monkeypatch.setattr(device_cache, "copy_self_check", lambda *a: "forced failure")
    with caplog.at_level(logging.WARNING, logger="freetoken_core.moe.placement"):
        outs, llm = run(path, moe_strategy="offload", moe_cache_slots=5, moe_device_cache="on")
    assert outs == expected
    executors = llm.scheduler.engine.moe_executors
    assert all(isinstance(ex, ExpertSlotPool) for ex in executors) and not graph_safe(executors)
    assert "forced failure" in caplog.text and "host-driven" in caplog.text


@cpu_only
def test_self_check_reports_why(monkeypatch):
    _, w13, w2, _, _ = _routing()
    assert copy_self_check(w13, w2, CPU) is None
    assert "AssertionError" in copy_self_check(w13.transpose(1, 2), w2, CPU)  # not contiguous: refused

    from freetoken_core.kernels import expert_cache

    monkeypatch.setattr(expert_cache, "copy_missed", lambda *a, **k: None)  # a copy that does nothing
    assert "differs from the host bank" in copy_self_check(w13, w2, CPU)


@cpu_only
def test_default_on_cpu_is_the_host_pool_and_the_switch_is_checked(moe_model):
    path, _ = moe_model
    _, llm = run(path, moe_strategy="offload", moe_cache_slots=5)
    assert all(isinstance(ex, ExpertSlotPool) for ex in llm.scheduler.engine.moe_executors)
    with pytest.raises(ValueError, match="moe_device_cache"):
        EngineConfig(model_path=str(path), moe_device_cache="maybe").validate()


@cpu_only
def test_executor_streams_groups_and_matches_the_reference():
    x, w13, w2, w, ids = _routing(t=9, e=8, k=2)
    ex = DeviceExpertCache(w13, w2, slots=3, device=CPU)
    want = fused_moe_ref(x, w13, w2, w, ids)
    torch.testing.assert_close(ex.forward(x, w, ids), want, atol=1e-5, rtol=1e-5)  # 18 routes > 3 slots: groups
    s = ex.stats
    assert s.tokens == 9 and s.overflow == 0 and s.misses >= len(torch.unique(ids)) and s.bytes_copied > 0
    check_cache(ex)
    one = ids[:1]  # a decode row: 2 routes fit 3 slots, no read-back
    assert ex.fits_without_reading(one.numel())
    torch.testing.assert_close(ex.forward(x[:1], w[:1], one), fused_moe_ref(x[:1], w13, w2, w[:1], one),
                               atol=1e-5, rtol=1e-5)
    check_cache(ex)


@cpu_only
def test_capture_like_dummy_steps_keep_tables_consistent_and_counters():
    x, w13, w2, w, ids = _routing(t=1, e=8, k=2)
    shared = torch.zeros(2, 5, dtype=torch.int64)
    executors = [DeviceExpertCache(w13, w2, slots=4, device=CPU, counters=(shared, i)) for i in range(2)]
    for ex in executors:
        ex.forward(x, w, ids)
    before = shared.clone()
    dummy = torch.zeros_like(ids) + torch.tensor([[6, 7]], dtype=ids.dtype)
    with preserved_counters(executors):  # what engine.py wraps around graph capture
        for ex in executors:
            for _ in range(2):
                ex.forward(torch.zeros_like(x), w, dummy)
    assert torch.equal(shared, before)
    for ex in executors:
        check_cache(ex)
        assert {6, 7} <= set(ex.resident)  # the dummy rows' experts simply stay cached
        torch.testing.assert_close(ex.forward(x, w, ids), fused_moe_ref(x, w13, w2, w, ids), atol=1e-5, rtol=1e-5)
    assert [s.tokens for s in layer_stats(executors)] == [2, 2]


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def run_cuda(path, speculative=None, **kw):
    llm = LLM(path, dtype="float32", device="cuda", page_size=4, num_pages=300, max_running_req=3,
              speculative=speculative, num_speculative_tokens=1, **kw)
    from tests.moe.test_offload import PARAMS, PROMPTS

    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS)], llm


@needs_cuda
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_cuda_offload_decodes_in_graphs_with_the_resident_tokens(moe_model, speculative):
    path, _ = moe_model
    want, _ = run_cuda(path, speculative)
    got, llm = run_cuda(path, speculative, moe_strategy="offload", moe_cache_slots=5)  # auto: self-check, device cache
    engine = llm.scheduler.engine
    assert all(isinstance(ex, DeviceExpertCache) for ex in engine.moe_executors)
    assert engine.graph_runner is not None  # graphs stay on
    assert got == want
    for ex in engine.moe_executors:
        check_cache(ex)
    stats = llm.scheduler.stats().extra["moe"]
    assert 0.0 < stats["slot_hit_rate"] < 1.0 and stats["bytes_copied_per_token"] > 0


@needs_cuda
def test_cuda_self_check_passes_on_pinned_banks_and_its_failure_turns_graphs_off(moe_model, monkeypatch):
    _, w13, w2, _, _ = _routing()
    assert copy_self_check(w13.pin_memory(), w2.pin_memory(), torch.device("cuda")) is None
    path, _ = moe_model
    want, _ = run_cuda(path)
    monkeypatch.setattr(device_cache, "copy_self_check", lambda *a: "forced failure")
    got, llm = run_cuda(path, moe_strategy="offload", moe_cache_slots=5)
    assert got == want
    assert llm.scheduler.engine.graph_runner is None
    assert all(isinstance(ex, ExpertSlotPool) for ex in llm.scheduler.engine.moe_executors)
