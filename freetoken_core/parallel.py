"""This process's tensor-parallel rank, set once when the process starts (rank 0: the engine process;
ranks 1..n-1: distributed/worker.py), and the collectives the sharded layers call.

Layers read `tp_info()` when they are built (their shard's shapes) and call `all_reduce` /
`all_gather` in forward; with one rank both are no-ops, so the single-GPU path is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    world_size: int = 1
    group: Any = None  # the torch.distributed process group (None: the default group)

    def shard(self, size: int, what: str) -> int:
        """size / world_size, or a clear error naming what does not split."""
        if size % self.world_size:
            raise ValueError(f"{what}={size} does not split over tensor_parallel_size={self.world_size}")
        return size // self.world_size


_TP = TPInfo()


def tp_info() -> TPInfo:
    return _TP


def set_tp_info(info: TPInfo) -> None:
    """Once per process, before the model is built (Engine / the worker's main)."""
    global _TP
    _TP = info


def _host_staged(x: torch.Tensor) -> bool:
    """gloo on CUDA tensors (tensor_parallel_backend='gloo', a one-GPU check): collectives go through
    host copies, since gloo's CUDA support does not cover every collective."""
    import torch.distributed as dist

    return x.is_cuda and dist.get_backend(_TP.group) == "gloo"


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    tp = _TP
    if tp.world_size == 1:
        return x
    import torch.distributed as dist

    if _host_staged(x):
        host = x.cpu()
        dist.all_reduce(host, group=tp.group)
        x.copy_(host)
        return x
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """[..., n] on every rank -> [..., n * world] in rank order, on every rank."""
    tp = _TP
    if tp.world_size == 1:
        return x
    import torch.distributed as dist

    if _host_staged(x):
        host = x.contiguous().cpu()
        parts = [torch.empty_like(host) for _ in range(tp.world_size)]
        dist.all_gather(parts, host, group=tp.group)
        return torch.cat(parts, dim=-1).to(x.device)
    parts = [torch.empty_like(x) for _ in range(tp.world_size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)
