"""Linear layers whose weights load from Hugging Face checkpoints, including fused ones.

q/k/v and gate/up are stored as one weight each, so a layer runs one matmul instead of three (or
two). The checkpoint still names them separately: `weight_loader(param, tensor, shard)` copies a
checkpoint tensor into its rows of the fused weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _param(shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
    # torch.empty: every value is overwritten by the loader (which checks that nothing is missed).
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). W is [out, in] like the checkpoint."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features), dtype)
        self.bias = _param((out_features,), dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_rows(self, shard: str | int) -> tuple[int, int]:
        """(offset, size) of a checkpoint shard in the output rows; plain layers have one shard."""
        return 0, self.out_features

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: str | int | None = None) -> None:
        if shard is None:
            dst = param.data
        else:
            off, size = self.shard_rows(shard)
            dst = param.data.narrow(0, off, size)
        if dst.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(loaded)  # converts dtype and device in one copy


class QKVLinear(Linear):
    """q, k and v projections fused: output rows are [q (H*D) | k (Hkv*D) | v (Hkv*D)]."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, dtype: torch.dtype | None = None):
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, self.q_size + 2 * self.kv_size, bias, dtype)

    def shard_rows(self, shard: str | int) -> tuple[int, int]:
        return {"q": (0, self.q_size), "k": (self.q_size, self.kv_size),
                "v": (self.q_size + self.kv_size, self.kv_size)}[shard]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views (no copies) of the fused output."""
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class MergedLinear(Linear):
    """Several projections of the same input fused along the output rows (gate/up: shards 0, 1)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False, dtype: torch.dtype | None = None):
        self.out_sizes = list(out_sizes)
        super().__init__(in_features, sum(out_sizes), bias, dtype)

    def shard_rows(self, shard: str | int) -> tuple[int, int]:
        i = int(shard)
        return sum(self.out_sizes[:i]), self.out_sizes[i]
