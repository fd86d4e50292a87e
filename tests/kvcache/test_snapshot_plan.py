"""How a hybrid's memory budget splits between K/V pages and the prefix cache's linear-state snapshots
(kvcache/factory.py plan_snapshots)."""

from __future__ import annotations

import torch

from freetoken_core.config import EngineConfig
from freetoken_core.kvcache.factory import STATE_SHARE, plan_snapshots
from freetoken_core.kvcache.linear_state import LinearStatePool
from freetoken_core.kvcache.spec import LinearStateSpec

PAGE = 4096  # bytes per K/V page
SPECS = [LinearStateSpec(state_index=0, conv_dim=64, conv_kernel=4, num_v_heads=4, head_k_dim=16, head_v_dim=16)]
POOL = LinearStatePool(SPECS, 2, torch.float32, torch.float32, torch.device("cpu"))
SLOT = LinearStatePool.bytes_per_slot(SPECS, torch.float32, torch.float32)


def _plan(budget_bytes: int, max_pages: int, **config) -> tuple[int, int]:
    cfg = EngineConfig(model_path="unused", **({"max_running_req": 4} | config))
    return plan_snapshots(cfg, POOL, budget_bytes, max_pages, PAGE)


def test_uncapped_budget_splits_by_state_share():
    budget = 1000 * PAGE
    slots, pages = _plan(budget, max_pages=10_000)
    assert slots == int(STATE_SHARE * budget // SLOT)
    assert pages == (budget - slots * SLOT) // PAGE
    assert slots * SLOT + pages * PAGE <= budget


def test_bytes_the_pages_cannot_use_go_to_snapshots():
    """Every row at full length needs 100 pages: the rest of the budget is snapshots', not STATE_SHARE of 100 pages."""
    budget = 1000 * PAGE
    slots, pages = _plan(budget, max_pages=100)
    assert pages == 100
    assert slots == (budget - 100 * PAGE) // SLOT
    assert slots > STATE_SHARE * 100 * PAGE / SLOT


def test_explicit_pages_keep_their_count_and_snapshots_come_on_top():
    budget = 65 * PAGE  # num_pages=64, +1 dummy page
    slots, pages = _plan(budget, max_pages=10_000, num_pages=64)
    assert pages == 65
    assert slots == int(STATE_SHARE * budget // SLOT)


def test_explicit_state_gb_is_taken_out_of_the_budget():
    budget = 1000 * PAGE
    state_gb = 100 * SLOT / 2**30
    slots, pages = _plan(budget, max_pages=10_000, prefix_cache_state_gb=state_gb)
    assert slots == 100
    assert pages == (budget - 100 * SLOT) // PAGE
