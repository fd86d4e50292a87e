"""The CPU MoE executor: routed experts computed on the host's cores from the host bank.

Rows move to the host, the (token, route) pairs are grouped by expert, and a thread pool computes
the experts (torch's CPU matmuls release the GIL; bf16 weights accumulate in fp32 inside oneDNN).
Partial outputs are summed in expert order with the same `index_add_` sequence as the reference
(`kernels/fused_moe_ref.py`), so in fp32 the result is bit-identical to it. The rows go back to the
device they came from.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

from . import register_executor
from .stats import ExpertStats


def expert_rows(topk_ids: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, token indices, route positions) for every expert hit, in increasing expert order."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    k = topk_ids.shape[1]
    order = torch.argsort(flat, stable=True)
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    out, start = [], 0
    for e, n in zip(experts.tolist(), counts.tolist()):
        idx = order[start:start + n]
        out.append((int(e), idx // k, idx % k))
        start += n
    return out


class CpuExperts:
    """Host-resident experts: w13 [E, 2I, H], w2 [E, H, I] on the CPU (pinned where CUDA exists)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, threads: int | None = None) -> None:
        self.w13, self.w2 = w13, w2
        self.num_experts, self.inter = w13.shape[0], w13.shape[1] // 2
        self.pool = ThreadPoolExecutor(max_workers=threads or max(1, (torch.get_num_threads() + 1) // 2))
        self.stats = ExpertStats()

    def _one(self, e: int, x: torch.Tensor, tok: torch.Tensor, route: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
        xe = x[tok]
        h = F.linear(xe, self.w13[e])
        act = F.silu(h[:, : self.inter]) * h[:, self.inter:]
        y = F.linear(act, self.w2[e])
        return y * weights[tok, route, None].to(x.dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                only: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] (any device) -> [T, H] on x's device. `only` [E] bool: compute just those experts
        (the misses of the hybrid executor); the rest contribute nothing."""
        dev = x.device
        xh, wh, ih = x.to("cpu"), topk_weights.to("cpu"), topk_ids.to("cpu")
        if xh.dtype != self.w13.dtype:
            xh = xh.to(self.w13.dtype)
        groups = expert_rows(ih, self.num_experts)
        if only is not None:
            keep = only.to("cpu")
            groups = [g for g in groups if bool(keep[g[0]])]
        futures = [self.pool.submit(self._one, e, xh, tok, route, wh) for e, tok, route in groups]
        out = torch.zeros_like(xh)
        for (e, tok, _), fut in zip(groups, futures):  # expert order: the reference's summation order
            out.index_add_(0, tok, fut.result())
        self.stats.misses += len(groups)
        self.stats.tokens += x.shape[0]
        return out.to(device=dev, dtype=x.dtype)


@register_executor("cpu")
def make_cpu_executor(w13: torch.Tensor, w2: torch.Tensor, threads: int | None = None, **_: object) -> CpuExperts:
    return CpuExperts(w13, w2, threads)
