"""The device-side expert cache of offloaded MoE layers: two graph-safe Triton kernels per layer step.

Tables and semantics: `expert_cache_ref.py` (`CacheTables`, `assign_ref`, `copy_ref`).

- `assign_slots` (kernel A, one program): advances the layer's clock, stamps the routed experts in
  `last_need` (a scatter of the clock: duplicates store the same value), then, in registers, keeps
  the hits and gives each missing expert (lowest id first) the slot with the smallest key, where the
  key is -1 for a free slot, last_used for a slot whose expert the step does not need, and +inf for
  a slot the step needs (ties: the lowest slot, `tl.min`'s left tie-break). One round per miss, so a
  step without misses runs no rounds. It writes the tables, the miss list and the counters, and
  rewrites the routes expert -> slot. Routes are read in BLOCK_R chunks: any number of rows.
- `copy_missed` (kernel B, persistent): a fixed grid (one program per SM on CUDA) walks the
  (miss, chunk) work items of the miss list, copying each missed expert's w13 and w2 from the host
  banks into its slot. Programs past `miss_count * chunks` exit at once: a step with no misses costs
  one near-empty launch. On CUDA the banks are pinned host tensors read through their UVA pointers
  (Triton's launcher asks the driver for the device pointer of a pinned allocation), which the
  engine checks at startup (`moe/device_cache.py` `copy_self_check`).

Both take the sizes from shapes alone and never sync with the host, so both capture into CUDA graphs;
both launch with PDL where the decode chain does and wait before touching anything (the routes are
activations, and the slots the copy writes are read by the layer's expert GEMVs right after).
"""

from __future__ import annotations

import torch

from .expert_cache_ref import COUNTERS, CacheTables
from .pdl import pdl_launch

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .pdl_jit import pdl_wait_then_release  # noqa: E402

_BIG = tl.constexpr(1 << 62)  # the key of a slot the step needs: never a victim


@triton.jit
def _assign_kernel(ids_ptr, out_ptr, num_routes, slot_of_ptr, expert_of_ptr, last_used_ptr, last_need_ptr,
                   clock_ptr, counters_ptr, miss_expert_ptr, miss_slot_ptr, miss_count_ptr, E, S,
                   bytes_per_expert, tokens, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
                   BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the routes are activations; the tables were written by this layer's last step
        pdl_wait_then_release()
    clock = tl.load(clock_ptr) + 1
    tl.store(clock_ptr, clock)
    offs_r = tl.arange(0, BLOCK_R)
    # 1. mark this step's experts: last_need[e] = clock
    for start in range(0, num_routes, BLOCK_R):
        r = start + offs_r
        r_ok = r < num_routes
        e = tl.load(ids_ptr + r, mask=r_ok, other=0)
        tl.store(last_need_ptr + e, clock + tl.zeros_like(e).to(tl.int64), mask=r_ok)
    tl.debug_barrier()
    # 2. hits, misses, and each slot's eviction key
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    needed = tl.load(last_need_ptr + offs_e, mask=e_ok, other=0) == clock
    slot_of = tl.load(slot_of_ptr + offs_e, mask=e_ok, other=-1)
    hit = needed & (slot_of >= 0)
    miss = needed & (slot_of < 0)
    offs_s = tl.arange(0, BLOCK_S)
    s_ok = offs_s < S
    expert_of = tl.load(expert_of_ptr + offs_s, mask=s_ok, other=-1)
    last_used = tl.load(last_used_ptr + offs_s, mask=s_ok, other=0)
    holds = expert_of >= 0
    keep = holds & (tl.load(last_need_ptr + expert_of, mask=s_ok & holds, other=0) == clock)
    key = tl.where(holds, last_used, -1)
    key = tl.where(keep | (offs_s >= S), _BIG, key)
    used = keep.to(tl.int32)
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    missing = tl.where(miss, offs_e, BLOCK_E)
    n_done = n_miss * 0
    # 3. one round per miss: the lowest missing expert takes the smallest-key slot
    for j in range(n_miss):
        e = tl.min(missing, axis=0)
        missing = tl.where(offs_e == e, BLOCK_E, missing)
        kmin, s = tl.min(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
        ok = kmin < _BIG
        old = tl.sum(tl.where(offs_s == s, expert_of, 0), axis=0)
        slot_of = tl.where((offs_e == old) & ok, -1, slot_of)  # the evicted expert (old = -1: a free slot)
        slot_of = tl.where((offs_e == e) & ok, s, slot_of)
        expert_of = tl.where((offs_s == s) & ok, e, expert_of)
        key = tl.where(offs_s == s, _BIG, key)
        used = tl.where((offs_s == s) & ok, 1, used)
        tl.store(miss_expert_ptr + j, e, mask=ok)
        tl.store(miss_slot_ptr + j, s, mask=ok)
        n_done += ok.to(tl.int32)
    last_used = tl.where(used != 0, clock, last_used)
    tl.store(slot_of_ptr + offs_e, slot_of, mask=e_ok)
    tl.store(expert_of_ptr + offs_s, expert_of, mask=s_ok)
    tl.store(last_used_ptr + offs_s, last_used, mask=s_ok)
    tl.store(miss_count_ptr, n_done)
    done64 = n_done.to(tl.int64)
    tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + n_hit.to(tl.int64))
    tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + done64)
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + done64 * bytes_per_expert)
    tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + tokens)
    tl.store(counters_ptr + 4, tl.load(counters_ptr + 4) + (n_miss - n_done).to(tl.int64))
    tl.debug_barrier()
    # 4. routes expert -> slot (an unmapped expert, only on overflow, reads slot 0)
    for start in range(0, num_routes, BLOCK_R):
        r = start + offs_r
        r_ok = r < num_routes
        e = tl.load(ids_ptr + r, mask=r_ok, other=0)
        s = tl.load(slot_of_ptr + e, mask=r_ok, other=0)
        tl.store(out_ptr + r, tl.maximum(s, 0), mask=r_ok)


def assign_slots(topk_ids: torch.Tensor, tables: CacheTables, bytes_per_expert: int, tokens: int,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel A: one LRU step of a layer's tables for routes `topk_ids` [T, k] (any int dtype) ->
    topk_slot int32 [T, k]. `tokens` is what the step adds to the tokens counter."""
    assert len(COUNTERS) == tables.counters.shape[0]
    ids = topk_ids.contiguous()
    if out is None:
        out = torch.empty(ids.shape, dtype=torch.int32, device=ids.device)
    n = ids.numel()
    E, S = tables.num_experts, tables.num_slots
    _assign_kernel[(1,)](
        ids, out, n, tables.slot_of, tables.expert_of, tables.last_used, tables.last_need, tables.clock,
        tables.counters, tables.miss_expert, tables.miss_slot, tables.miss_count, E, S, bytes_per_expert, tokens,
        BLOCK_E=triton.next_power_of_2(E), BLOCK_S=triton.next_power_of_2(S),
        BLOCK_R=min(1024, triton.next_power_of_2(max(n, 1))), num_warps=4, **pdl_launch(ids),
    )
    return out


@triton.jit
def _copy_chunk(src, dst, start, N, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    for off in range(0, CHUNK, BLOCK):
        o = start + off + tl.arange(0, BLOCK)
        m = o < N
        tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


@triton.jit
def _copy_kernel(src13, src2, dst13, dst2, miss_expert_ptr, miss_slot_ptr, miss_count_ptr, N13, N2,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:  # the miss list comes from kernel A; the slots are read by the kernels after this one
        pdl_wait_then_release()
    c13 = tl.cdiv(N13, CHUNK)
    per = c13 + tl.cdiv(N2, CHUNK)
    total = tl.load(miss_count_ptr) * per
    for item in range(tl.program_id(0), total, tl.num_programs(0)):
        j = item // per
        c = item % per
        e = tl.load(miss_expert_ptr + j).to(tl.int64)
        s = tl.load(miss_slot_ptr + j).to(tl.int64)
        if c < c13:
            _copy_chunk(src13 + e * N13, dst13 + s * N13, c * CHUNK, N13, CHUNK, BLOCK)
        else:
            _copy_chunk(src2 + e * N2, dst2 + s * N2, (c - c13) * CHUNK, N2, CHUNK, BLOCK)


def copy_plan(n13: int, n2: int, num_slots: int, device: torch.device) -> tuple[int, int, int]:
    """(grid, CHUNK, BLOCK) of the copy for experts of n13 + n2 elements: static per layer shape."""
    block = min(4096, triton.next_power_of_2(max(n13, n2)))
    chunk = block * min(16, triton.cdiv(max(n13, n2), block))
    items = num_slots * (triton.cdiv(n13, chunk) + triton.cdiv(n2, chunk))
    if device.type == "cuda":
        programs = torch.cuda.get_device_properties(device).multi_processor_count
    else:  # the interpreter runs programs one after another
        programs = 2
    return min(programs, items), chunk, block


def copy_missed(tables: CacheTables, host_w13: torch.Tensor, host_w2: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, plan: tuple[int, int, int] | None = None) -> None:
    """Kernel B: copy the last assign's missed experts from the host banks [E, ...] (pinned host
    memory on CUDA) into their slots of w13 / w2 [S, ...]. All four must be contiguous."""
    for t in (host_w13, host_w2, w13, w2):
        assert t.is_contiguous(), "the expert banks and slots must be contiguous"
    n13, n2 = w13[0].numel(), w2[0].numel()
    grid, chunk, block = plan or copy_plan(n13, n2, tables.num_slots, w13.device)
    _copy_kernel[(grid,)](
        host_w13, host_w2, w13, w2, tables.miss_expert, tables.miss_slot, tables.miss_count, n13, n2,
        CHUNK=chunk, BLOCK=block, num_warps=8 if w13.is_cuda else 1, **pdl_launch(w13),
    )
