"""The device-side expert cache kernels (kernels/expert_cache.py) against their plain-torch references
(kernels/expert_cache_ref.py): the LRU step (eviction order, never evicting an expert the step
needs, free slots first, counters, overflow, routes longer than one block) and the copy (a step
without misses writes nothing). CPU: Triton's interpreter; on CUDA also from pinned host banks and
inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels.expert_cache import assign_slots, copy_missed, copy_plan
from freetoken_core.kernels.expert_cache_ref import CacheTables, assign_ref, copy_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BPE = 1000  # bytes per expert, for the counter


def same_tables(a: CacheTables, b: CacheTables) -> None:
    for name in ("slot_of", "expert_of", "last_used", "clock", "counters", "miss_count"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    n = int(a.miss_count)
    assert torch.equal(a.miss_expert[:n].cpu(), b.miss_expert[:n].cpu())
    assert torch.equal(a.miss_slot[:n].cpu(), b.miss_slot[:n].cpu())


def step_both(ids: list[list[int]], got: CacheTables, want: CacheTables, tokens: int | None = None) -> torch.Tensor:
    t = torch.tensor(ids, dtype=torch.int32, device=DEVICE)
    tokens = t.shape[0] if tokens is None else tokens
    slots = assign_slots(t, got, BPE, tokens)
    ref = assign_ref(t, want, BPE, tokens)
    assert torch.equal(slots.cpu(), ref.cpu())
    same_tables(got, want)
    got.check()
    return slots


def resident(t: CacheTables) -> dict[int, int]:
    return {e: s for s, e in enumerate(t.expert_of.tolist()) if e >= 0}


@pytest.mark.parametrize("experts,slots,top_k", [(8, 5, 2), (16, 16, 4), (64, 24, 8), (5, 1, 1)])
def test_assign_matches_the_reference_over_random_steps(experts, slots, top_k):
    got = CacheTables.create(experts, slots, DEVICE)
    want = CacheTables.create(experts, slots, DEVICE)
    g = torch.Generator().manual_seed(experts * 7 + slots)
    for _ in range(25):
        rows = int(torch.randint(1, max(2, slots // top_k) + 1, (1,), generator=g))
        rows = max(1, min(rows, slots // top_k)) if slots < experts else rows
        ids = [torch.randperm(experts, generator=g)[:top_k].tolist() for _ in range(rows)]
        slots_t = step_both(ids, got, want)
        # every route now points at a slot holding its expert
        expert_of = got.expert_of.cpu()
        assert torch.equal(expert_of[slots_t.cpu().long()], torch.tensor(ids, dtype=torch.int32))
    c = got.counters.tolist()
    assert c[0] + c[1] > 0 and c[2] == c[1] * BPE and c[4] == 0


def test_free_slots_first_then_least_recently_used():
    t, r = CacheTables.create(8, 3, DEVICE), CacheTables.create(8, 3, DEVICE)
    step_both([[5, 2]], t, r)  # two misses: expert 2 -> slot 0, expert 5 -> slot 1 (lowest expert, lowest slot)
    assert resident(t) == {2: 0, 5: 1}
    assert t.miss_count.item() == 2 and t.miss_expert[:2].tolist() == [2, 5] and t.miss_slot[:2].tolist() == [0, 1]
    step_both([[7, 5]], t, r)  # 5 hits; 7 takes the free slot 2 even though slot 0 is older
    assert resident(t) == {2: 0, 5: 1, 7: 2}
    step_both([[5, 7]], t, r)  # hits only: no miss, slot 0 (expert 2) is now the least recent
    assert t.miss_count.item() == 0
    step_both([[1, 7]], t, r)  # 1 evicts 2 (LRU), not 5
    assert resident(t) == {1: 0, 5: 1, 7: 2}
    assert t.counters.tolist() == [1 + 2 + 1, 2 + 1 + 1, 4 * BPE, 4, 0]


def test_an_expert_the_step_needs_is_never_evicted():
    t, r = CacheTables.create(8, 3, DEVICE), CacheTables.create(8, 3, DEVICE)
    step_both([[0, 1], [2, 0]], t, r)
    step_both([[1, 2]], t, r)  # 0 is now the least recent
    step_both([[0, 6]], t, r)  # 0 is needed (and the LRU): 6 must evict 1, the oldest unneeded
    assert resident(t) == {0: 0, 6: 1, 2: 2}
    step_both([[3, 4], [0, 3]], t, r)  # two misses, 0 kept: 3 (lowest) evicts 2 (older), then 4 evicts 6
    assert resident(t) == {0: 0, 4: 1, 3: 2}


def test_ties_break_to_the_lowest_slot():
    t, r = CacheTables.create(6, 4, DEVICE), CacheTables.create(6, 4, DEVICE)
    step_both([[3, 2, 1, 0]], t, r)  # one step fills every slot: all share one last_used
    step_both([[5]], t, r)
    assert resident(t)[5] == 0  # expert 0's slot 0: the lowest of the tied slots


def test_overflow_is_counted_and_reads_slot_zero():
    t, r = CacheTables.create(8, 2, DEVICE), CacheTables.create(8, 2, DEVICE)
    slots = step_both([[0, 1], [2, 3]], t, r)  # four experts, two slots
    assert t.counters.tolist()[4] == 2 and t.miss_count.item() == 2
    assert resident(t) == {0: 0, 1: 1} and slots.tolist() == [[0, 1], [0, 0]]


def test_long_routes_and_the_tokens_counter():
    experts, slots = 32, 32
    t, r = CacheTables.create(experts, slots, DEVICE), CacheTables.create(experts, slots, DEVICE)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, experts, (700, 2), generator=g).tolist()  # 1400 routes: two BLOCK_R chunks
    step_both(ids, t, r)
    step_both(ids[:3], t, r, tokens=0)
    assert t.counters.tolist()[3] == 700


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_matches_the_reference_and_skips_without_misses(dtype):
    experts, slots, inter, hidden = 8, 3, 24, 40  # odd sizes: the last chunk is partial
    g = torch.Generator().manual_seed(0)
    host13 = torch.randn(experts, 2 * inter, hidden, generator=g).to(dtype)
    host2 = torch.randn(experts, hidden, inter, generator=g).to(dtype)
    if DEVICE == "cuda":
        host13, host2 = host13.pin_memory(), host2.pin_memory()
    t = CacheTables.create(experts, slots, DEVICE)
    w13 = torch.zeros((slots, 2 * inter, hidden), dtype=dtype, device=DEVICE)
    w2 = torch.zeros((slots, hidden, inter), dtype=dtype, device=DEVICE)
    r13, r2 = w13.clone(), w2.clone()
    for ids in ([[6, 1]], [[1, 4]], [[0, 2], [3, 6]], [[6, 1]]):
        assign_slots(torch.tensor(ids, dtype=torch.int32, device=DEVICE), t, 1, 1)
        copy_missed(t, host13, host2, w13, w2)
        copy_ref(t, host13.to(DEVICE), host2.to(DEVICE), r13, r2)
        assert torch.equal(w13, r13) and torch.equal(w2, r2)
    for e, s in resident(t).items():
        assert torch.equal(w13[s].cpu(), host13[e]) and torch.equal(w2[s].cpu(), host2[e])
    # a step without misses: nothing is written (poison the slots and check they stay poisoned)
    assign_slots(torch.tensor([[6]], dtype=torch.int32, device=DEVICE), t, 1, 1)
    assert t.miss_count.item() == 0
    w13.fill_(7.0)
    copy_missed(t, host13, host2, w13, w2)
    assert bool((w13 == 7.0).all())


def test_copy_plan_is_a_persistent_grid():
    grid, chunk, block = copy_plan(3 * 2**20, 3 * 2**19, 64, torch.device("cpu"))
    assert chunk % block == 0 and grid == 2


@needs_cuda
def test_step_inside_a_cuda_graph_from_pinned_banks():
    experts, slots = 16, 8
    host13 = torch.randn(experts, 64, 32, dtype=torch.bfloat16).pin_memory()
    host2 = torch.randn(experts, 32, 32, dtype=torch.bfloat16).pin_memory()
    t, r = CacheTables.create(experts, slots, DEVICE), CacheTables.create(experts, slots, DEVICE)
    w13 = torch.zeros((slots, 64, 32), dtype=torch.bfloat16, device=DEVICE)
    w2 = torch.zeros((slots, 32, 32), dtype=torch.bfloat16, device=DEVICE)
    ids = torch.zeros((2, 2), dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(ids)

    def step():
        assign_slots(ids, t, 1, 2, out=out)
        copy_missed(t, host13, host2, w13, w2)

    step()  # compile outside the graph
    assign_ref(ids, r, 1, 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        ids.copy_(torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(2)]).to(torch.int32))
        graph.replay()
        want = assign_ref(ids, r, 1, 2)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), want.cpu())
        same_tables(t, r)
    for e, s in resident(t).items():
        assert torch.equal(w13[s].cpu(), host13[e]) and torch.equal(w2[s].cpu(), host2[e])
