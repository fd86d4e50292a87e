"""Offloaded experts cached in device slots by device-side tables: the `offload_device` executor.

The same placement as `slot_pool.ExpertSlotPool` (host banks, S device slots per layer, LRU), with
the bookkeeping moved onto the device (`kernels/expert_cache.py`, tables in `expert_cache_ref.py`):
after the router, kernel A picks the slots and rewrites the routes expert -> slot, kernel B copies
the missed experts from the pinned host banks into their slots, and the fused expert kernels run
over the pool's [S, ...] weights. Nothing reads back to the host, so a decode or verify step runs
inside the engine's CUDA graphs (`graph_safe`); the decode-batch clamp (moe/budget.py) keeps every
graph step within S distinct experts per layer.

A step whose routes could name more than S experts (an eager prefill: T * top_k > S < E) reads its
distinct experts back (one small copy); more than S of them stream through the pool in groups of S
as ExpertSlotPool does, each group a normal kernel step (the device tables stay authoritative).

Counters (hits, misses, bytes copied, tokens) live on the device in one [layers, 5] tensor and are
read only when stats are asked for (`moe.stats.layer_stats`). Graph-captured steps count their
padded rows as tokens, and the padding rows' experts are cached like any other.

On CUDA the executor is used only after `copy_self_check` has copied an expert through kernel B,
eagerly and replayed from a CUDA graph, bit-identical to the host bank (`moe/placement.py`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..kernels.expert_cache_ref import COUNTERS, CacheTables
from ..layers.moe import run_stacked_experts
from . import register_executor
from .slot_pool import slots_like
from .stats import ExpertStats


class DeviceExpertCache:
    graph_safe = True  # no host sync on the decode path: engine.py keeps CUDA graphs on

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, slots: int, device: torch.device,
                 counters: tuple[torch.Tensor, int] | None = None,
                 fp8: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None) -> None:
        if not 1 <= slots <= w13.shape[0]:
            raise ValueError(f"an expert pool needs 1..{w13.shape[0]} slots, got {slots}")
        self.host_w13, self.host_w2 = w13.contiguous(), w2.contiguous()
        self.num_experts, self.num_slots, self.device = w13.shape[0], slots, device
        self.w13, self.w2 = slots_like(w13, slots, device), slots_like(w2, slots, device)
        # FP8 experts: the slots hold values and scales; kernel B copies each pair as bytes (copy_pairs)
        self.host_fp8, self.fp8 = fp8, None
        if fp8 is not None:
            self.fp8 = (slots_like(fp8[0], slots, device), slots_like(fp8[1], slots, device), fp8[2])
        if counters is None:
            counters = (torch.zeros(1, len(COUNTERS), dtype=torch.int64, device=device), 0)
        self.counters_source = counters  # (the [layers, 5] tensor shared by all layers, this layer's row)
        self.tables = CacheTables.create(self.num_experts, slots, device, counters[0][counters[1]])
        self.pairs = copy_pairs(self.host_w13, self.host_w2, self.w13, self.w2, fp8, self.fp8)
        self.bytes_per_expert = sum(src[0].numel() * src.element_size() for src, _ in self.pairs)
        self._plans: list[tuple[int, int, int]] | None = None

    # --- stats (read from the device only here) ---------------------------------------------------
    @property
    def stats(self) -> ExpertStats:
        return ExpertStats.from_counters(self.tables.counters.tolist())

    def reset_stats(self) -> None:
        self.tables.counters.zero_()

    @property
    def resident(self) -> list[int]:
        return [e for e in self.tables.expert_of.tolist() if e >= 0]

    # --- one step ----------------------------------------------------------------------------------
    def step(self, topk_ids: torch.Tensor, tokens: int) -> torch.Tensor:
        """Kernels A and B for these routes -> the routes rewritten expert -> slot (int32)."""
        from ..kernels import expert_cache  # first use: CPU users of other strategies never load Triton

        slots = expert_cache.assign_slots(topk_ids, self.tables, self.bytes_per_expert, tokens)
        if self._plans is None:
            self._plans = [expert_cache.copy_plan(d13[0].numel(), d2[0].numel(), self.num_slots, self.device)
                           for (_, d13), (_, d2) in zip(self.pairs[::2], self.pairs[1::2])]
        for (h13, d13), (h2, d2), plan in zip(self.pairs[::2], self.pairs[1::2], self._plans):
            expert_cache.copy_missed(self.tables, h13, h2, d13, d2, plan)
        return slots

    def fits_without_reading(self, num_routes: int) -> bool:
        """Whether any routing of this many (token, expert) pairs fits the pool: the graph-safe path."""
        return num_routes <= self.num_slots or self.num_slots >= self.num_experts

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        num_tokens = topk_ids.shape[0]
        if num_tokens == 0:
            return torch.zeros_like(x)
        if self.fits_without_reading(topk_ids.numel()):
            return run_stacked_experts(x, self.w13, self.w2, topk_weights, self.step(topk_ids, num_tokens), fp8=self.fp8)
        experts = torch.unique(topk_ids)  # eager (a prefill): one small read-back
        if experts.numel() <= self.num_slots:
            return run_stacked_experts(x, self.w13, self.w2, topk_weights, self.step(topk_ids, num_tokens), fp8=self.fp8)
        out = None
        for start in range(0, experts.numel(), self.num_slots):
            group = experts[start:start + self.num_slots]
            mine = torch.isin(topk_ids, group)  # this group's routes; the others name group[0] with weight 0
            ids = torch.where(mine, topk_ids, group[0].to(topk_ids.dtype))
            weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
            slots = self.step(ids, num_tokens if start == 0 else 0)
            y = run_stacked_experts(x, self.w13, self.w2, weights, slots, fp8=self.fp8)
            out = y if out is None else out + y
        return out


@contextlib.contextmanager
def preserved_counters(executors: list) -> Iterator[None]:
    """Graph capture runs the layers on dummy rows (its warm-ups are real launches): their experts stay
    cached, which keeps tables and slots consistent (evicting then restoring a table would not), but
    the counters are put back as they were, so the stats count served rows only."""
    caches = [ex for ex in executors if isinstance(ex, DeviceExpertCache)]
    saved = [ex.tables.counters.clone() for ex in caches]
    try:
        yield
    finally:
        for ex, snap in zip(caches, saved):
            ex.tables.counters.copy_(snap)


def copy_pairs(host_w13: torch.Tensor, host_w2: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
               host_fp8: tuple | None = None, fp8: tuple | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(host bank, device slots) pairs kernel B copies, two per launch: the weights, then the FP8 scales when held.
    FP8 values travel as their bytes (uint8 views): the copy moves bits, never converts."""
    pairs = [(host_w13, w13), (host_w2, w2)]
    if fp8 is not None:
        pairs += [(host_fp8[0].contiguous(), fp8[0]), (host_fp8[1].contiguous(), fp8[1])]
    return [(src.view(torch.uint8), dst.view(torch.uint8)) if src.element_size() == 1 else (src, dst)
            for src, dst in pairs]


def copy_self_check(host_w13: torch.Tensor, host_w2: torch.Tensor, device: torch.device) -> str | None:
    """None when kernel B copies an expert of these host banks into a device slot bit for bit, eagerly
    and (on CUDA) replayed from a CUDA graph; else the reason it cannot be used."""
    try:
        from ..kernels.expert_cache import copy_missed, copy_plan

        num_experts = host_w13.shape[0]
        tables = CacheTables.create(num_experts, 1, device)
        (host_w13, w13), (host_w2, w2) = copy_pairs(host_w13, host_w2, slots_like(host_w13, 1, device),
                                                    slots_like(host_w2, 1, device))
        plan = copy_plan(w13[0].numel(), w2[0].numel(), 1, device)

        def same(e: int) -> bool:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return all(torch.equal(dev[0].cpu().view(torch.uint8), host[e].contiguous().view(torch.uint8))
                       for dev, host in ((w13, host_w13), (w2, host_w2)))

        tables.miss_expert.fill_(0)
        tables.miss_count.fill_(1)
        copy_missed(tables, host_w13, host_w2, w13, w2, plan)
        if not same(0):
            return "kernel B's copy of expert 0 differs from the host bank"
        if device.type == "cuda":
            last = num_experts - 1
            tables.miss_expert.fill_(last)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                copy_missed(tables, host_w13, host_w2, w13, w2, plan)
            w13.zero_()
            w2.zero_()
            graph.replay()
            if not same(last):
                return f"kernel B replayed from a CUDA graph: its copy of expert {last} differs from the host bank"
        return None
    except Exception as exc:  # a driver that will not map the pinned bank, a Triton that rejects it, ...
        return f"{type(exc).__name__}: {exc}"


@register_executor("offload_device")
def make_device_cache_executor(w13: torch.Tensor, w2: torch.Tensor, slots: int, device: torch.device,
                               counters: tuple[torch.Tensor, int] | None = None,
                               fp8: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None,
                               **_: object) -> DeviceExpertCache:
    return DeviceExpertCache(w13, w2, slots, device, counters, fp8)
