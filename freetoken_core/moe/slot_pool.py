"""Offloaded experts: host banks (pinned) and a per-layer pool of device slots with an LRU policy.

Before a MoE layer runs, the experts its router chose are made resident (`ensure`): a miss takes a
free slot or evicts the least recently used expert the step does not need, and is copied host ->
device (from pinned memory, on a side stream on CUDA, the layer's kernels ordered after it). The
routing ids are then rewritten expert -> slot on the device (`slot_of[ids]`) and the same fused
kernels run over the pool's [S, ...] weights. A step that routes to more distinct experts than the
pool holds (a long prefill) streams them through the pool in groups of S, each group computing only
its own routes. `HybridExperts` instead keeps a fixed set resident and computes misses on the host.

The host side needs the step's distinct expert ids, so layers that use a pool read them back
(one small copy per layer); such engines decode without CUDA graphs. On CUDA `offload` normally runs
the same policy on the device instead (`device_cache.py`, inside the graphs); this pool is what it
falls back to when the startup self-check of the device copy fails, and what `moe_device_cache=off`
(and the default on CPU) uses.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from ..layers.moe import run_stacked_experts
from . import register_executor
from .cpu_executor import CpuExperts
from .stats import ExpertStats


def slots_like(bank: torch.Tensor, slots: int, device: torch.device) -> torch.Tensor:
    """Device slots [S, ...] for experts of a host bank [E, ...]; zeros, not empty: a padding row never meets NaN
    garbage in a slot not yet filled."""
    return torch.zeros((slots, *bank.shape[1:]), dtype=bank.dtype, device=device)


class ExpertSlotPool:
    """fp8: (scale_inv bank of w13, of w2, block) when the host banks hold block-FP8 values; the slots then hold
    values and scales, and a miss copies both (half the bytes of a bf16 expert)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, slots: int, device: torch.device,
                 fp8: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None) -> None:
        if not 1 <= slots <= w13.shape[0]:
            raise ValueError(f"an expert pool needs 1..{w13.shape[0]} slots, got {slots}")
        self.host_w13, self.host_w2 = w13, w2
        self.num_experts, self.num_slots, self.device = w13.shape[0], slots, device
        self.w13, self.w2 = slots_like(w13, slots, device), slots_like(w2, slots, device)
        self.host_fp8, self.fp8 = fp8, None
        if fp8 is not None:
            self.fp8 = (slots_like(fp8[0], slots, device), slots_like(fp8[1], slots, device), fp8[2])
        self.slot_of = torch.full((self.num_experts,), -1, dtype=torch.int64, device=device)
        self._slot_of: list[int] = [-1] * self.num_experts
        self._lru: OrderedDict[int, int] = OrderedDict()  # resident expert -> slot, least recent first
        self._free = list(range(slots - 1, -1, -1))
        self.bytes_per_expert = sum(t[0].numel() * t.element_size() for t in self._banks()[0])
        self.stats = ExpertStats()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def resident(self) -> list[int]:
        return list(self._lru)

    def _take_slot(self, needed: set[int]) -> int:
        if self._free:
            return self._free.pop()
        for e in self._lru:  # least recently used first
            if e not in needed:
                slot = self._lru.pop(e)
                self._slot_of[e] = -1
                return slot
        raise RuntimeError(f"{len(needed)} experts needed at once, the pool holds {self.num_slots}")

    def ensure(self, experts: list[int]) -> None:
        """Make these experts resident (at most num_slots of them) and update the device map."""
        needed = set(experts)
        if len(needed) > self.num_slots:
            raise RuntimeError(f"{len(needed)} experts needed at once, the pool holds {self.num_slots}")
        copies: list[tuple[int, int]] = []
        for e in experts:
            if self._slot_of[e] >= 0:
                self.stats.hits += 1
                self._lru.move_to_end(e)
                continue
            self.stats.misses += 1
            slot = self._take_slot(needed)
            self._slot_of[e], self._lru[e] = slot, slot
            copies.append((e, slot))
        if not copies:
            return
        if self._stream is not None:  # copy on a side stream; the layer's kernels wait for it
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._copy(copies)
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        else:
            self._copy(copies)

    def _banks(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(host banks, their device slots): the weights, then the FP8 scales when held."""
        host, dev = [self.host_w13, self.host_w2], [self.w13, self.w2]
        if self.fp8 is not None:
            host += self.host_fp8[:2]
            dev += self.fp8[:2]
        return host, dev

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        host, dev = self._banks()
        for e, slot in copies:
            for src, dst in zip(host, dev):
                dst[slot].copy_(src[e], non_blocking=True)
        self.stats.bytes_copied += len(copies) * self.bytes_per_expert
        self.slot_of.copy_(torch.tensor(self._slot_of, dtype=torch.int64), non_blocking=False)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        experts = torch.unique(topk_ids).tolist()  # the host needs them: one small read-back per layer
        self.stats.tokens += x.shape[0]
        out = None
        for start in range(0, len(experts), self.num_slots):  # one group unless a prefill routes to more
            group = experts[start:start + self.num_slots]
            self.ensure(group)
            slots = self.slot_of[topk_ids.to(torch.int64)]
            if len(group) == len(experts):
                weights = topk_weights
            else:  # only this group's routes count; the others run on any valid slot with weight 0
                mine = torch.isin(topk_ids, torch.tensor(group, device=topk_ids.device, dtype=topk_ids.dtype))
                weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
                slots = torch.where(mine, slots, torch.zeros_like(slots))
            y = run_stacked_experts(x, self.w13, self.w2, weights, slots.to(topk_ids.dtype), fp8=self.fp8)
            out = y if out is None else out + y
        return out if out is not None else torch.zeros_like(x)


class HybridExperts:
    """A fixed set of experts in device slots (the first S, or the most used by a profile); the
    routes to them run on the device, the rest on the host's cores, and the two are summed."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, slots: int, device: torch.device,
                 resident: list[int] | None = None, threads: int | None = None) -> None:
        self.pool = ExpertSlotPool(w13, w2, slots, device)
        self.pool.ensure(list(resident) if resident is not None else list(range(slots)))
        self.pool.stats = ExpertStats()  # the fill is not a miss
        self.cpu = CpuExperts(w13, w2, threads)
        self.stats = self.pool.stats
        self._on_device = torch.zeros(w13.shape[0], dtype=torch.bool, device=device)
        self._on_device[torch.tensor(self.pool.resident, dtype=torch.int64, device=device)] = True

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        ids = topk_ids.to(torch.int64)
        hit = self._on_device[ids]
        self.stats.tokens += x.shape[0]
        self.stats.hits += int(torch.unique(ids[hit]).numel())
        self.stats.misses += int(torch.unique(ids[~hit]).numel())
        slots = torch.where(hit, self.pool.slot_of[ids], torch.zeros_like(ids))
        on_dev = run_stacked_experts(x, self.pool.w13, self.pool.w2, torch.where(hit, topk_weights, 0.0),
                                     slots.to(topk_ids.dtype))
        if bool(hit.all()):
            return on_dev
        return on_dev + self.cpu.forward(x, topk_weights, topk_ids, only=~self._on_device)


@register_executor("offload")
def make_offload_executor(w13: torch.Tensor, w2: torch.Tensor, slots: int, device: torch.device,
                          fp8: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None,
                          **_: object) -> ExpertSlotPool:
    return ExpertSlotPool(w13, w2, slots, device, fp8)


@register_executor("hybrid")
def make_hybrid_executor(w13: torch.Tensor, w2: torch.Tensor, slots: int, device: torch.device,
                         threads: int | None = None, **_: object) -> HybridExperts:
    return HybridExperts(w13, w2, slots, device, threads=threads)
