"""How many of a hybrid's K/V pages are reserved for linear-state snapshots (kvcache/factory.py plan_snapshots), and
the snapshots' round trip through borrowed pages (kvcache/snapshots.py)."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.config import EngineConfig
from freetoken_core.kvcache.factory import RESERVE_MAX_GB, RESERVE_SHARE, plan_snapshots
from freetoken_core.kvcache.linear_state import LinearStatePool
from freetoken_core.kvcache.pool import KVCache, KVCacheShape
from freetoken_core.kvcache.snapshots import SnapshotPool, pages_per_snapshot, snapshot_bytes
from freetoken_core.kvcache.spec import LinearStateSpec

PAGE = 4096  # bytes per K/V page
SPECS = [LinearStateSpec(state_index=0, conv_dim=64, conv_kernel=4, num_v_heads=4, head_k_dim=16, head_v_dim=16)]
POOL = LinearStatePool(SPECS, 2, torch.float32, torch.float32, torch.device("cpu"))
PER = pages_per_snapshot(POOL, PAGE)  # 768 + 4096 bytes: 2 pages


def _plan(budget_bytes: int, **config) -> tuple[int, int]:
    cfg = EngineConfig(model_path="unused", **({"max_running_req": 4} | config))
    return plan_snapshots(cfg, POOL, budget_bytes, PAGE)


def test_all_the_budget_is_pages_and_half_is_reserved_for_snapshots():
    slots, pages = _plan(1000 * PAGE)
    assert PER == 2
    assert pages == 1000 - PER  # one snapshot's staging buffer
    assert slots == int(RESERVE_SHARE * pages) // PER


def test_a_tiny_budget_reserves_one_snapshot_if_requests_keep_a_page():
    assert _plan(6 * PAGE) == (1, 4)  # the dummy page, a snapshot's two, one for requests
    assert _plan(5 * PAGE) == (0, 3)


def test_the_default_reserve_stops_at_4_gib():
    slots, pages = _plan(10 * 2**30)
    assert slots == int(RESERVE_MAX_GB * 2**30 / (PER * PAGE))


def test_explicit_pages_stay_the_requests_and_the_reserve_comes_on_top():
    slots, pages = _plan(65 * PAGE, num_pages=64)
    assert slots == int(RESERVE_SHARE * 65) // PER
    assert pages == 65 + slots * PER


def test_explicit_state_gb_is_the_reserve():
    slots, pages = _plan(1000 * PAGE, prefix_cache_state_gb=20.5 * PER * PAGE / 2**30)
    assert (slots, pages) == (20, 1000 - PER)


@pytest.mark.parametrize("kv_dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
def test_a_snapshot_round_trips_through_borrowed_pages(kv_dtype, state_dtype):
    """States packed into pages and back are bit-identical; only the snapshot's own pages change."""
    specs = SPECS + [LinearStateSpec(state_index=1, conv_dim=24, conv_kernel=3, num_v_heads=2, head_k_dim=8,
                                     head_v_dim=4)]
    live = LinearStatePool(specs, 3, state_dtype, state_dtype, torch.device("cpu"))
    for t in live.conv + live.recurrent:
        t.normal_()
    kv = KVCache(KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=8, page_size=2, dtype=kv_dtype), 80,
                 torch.device("cpu"))
    for t in kv.k + kv.v:
        t.normal_()
    per = pages_per_snapshot(live, kv.shape.bytes_per_page())
    store = SnapshotPool(live, kv, num_pages=2 * per)
    assert store.pages_per_snapshot == per == -(-snapshot_bytes(live) // kv.shape.bytes_per_page()) and per > 1
    before = [t.clone() for t in kv.k + kv.v]
    pages = list(range(79, 79 - per, -1))  # any pages, in any order
    want = [t[1].clone() for t in live.conv + live.recurrent]
    slot = store.take(1, pages)
    assert store.pages_in_use == per and store.num_free == 1
    for old, new in zip(before, kv.k + kv.v):
        others = [p for p in range(80) if p not in pages]
        assert torch.equal(old[others], new[others])
    for t in live.conv + live.recurrent:
        t[2].zero_()
    store.restore(slot, 2)
    for w, t in zip(want, live.conv + live.recurrent):
        assert torch.equal(t[2], w)
    assert store.give_back([slot]) == pages and store.pages_in_use == 0
