"""The block-FP8 weight format of the layers (checkpoints with quant_method "fp8", weight_block_size [128, 128]).

A quantized projection is a weight format of the same layers, not another layer class: a checkpoint's
`X.weight` (float8_e4m3fn) and `X.weight_scale_inv` travel together as one `Fp8BlockWeight` from the checkpoint
reader (models/quant.py) through the layers' weight loaders, which slice it like a tensor (a fused projection's
segment, a tensor-parallel shard: `narrow` takes the scale blocks along and refuses a cut inside a block), to the
copy into the parameter. That copy (`dense_weight`, called by `copy_checked`) is the one switch point of the
format: today every parameter is in the compute dtype and takes the weight dequantized, on every device (the CPU
and reference path; CUDA until the kernels/fp8_*.py kernels are wired into Linear and StackedExperts, whose FP8
parameters would then take the e4m3 values and their scales as they are).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.fp8_ref import DEFAULT_BLOCK, FP8_DTYPE, block_scale_shape, dequantize_block_fp8, quantize_block_fp8


@dataclass(frozen=True)
class Fp8BlockFormat:
    """How a model's FP8 weights are laid out: `block` (rows, cols) elements share one scale_inv."""

    block: tuple[int, int] = DEFAULT_BLOCK


@dataclass(frozen=True)
class Fp8BlockWeight:
    """One checkpoint weight in block FP8: e4m3 values [..., out, in] and scale_inv [..., ceil(out/bo), ceil(in/bi)]
    (leading dims: a fused expert stack [E, ...])."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int] = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE:
            raise ValueError(f"block-FP8 weight must be float8_e4m3fn, got {self.weight.dtype}")
        expected = block_scale_shape(self.weight.shape, self.block)
        if tuple(self.scale_inv.shape) != expected:
            raise ValueError(f"weight_scale_inv shape {tuple(self.scale_inv.shape)} does not match weight "
                             f"{tuple(self.weight.shape)} in blocks of {list(self.block)} (expected {list(expected)})")

    @classmethod
    def quantize(cls, w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> "Fp8BlockWeight":
        """A full-precision weight quantized block-wise (EngineConfig.quantization="fp8")."""
        return cls(*quantize_block_fp8(w, block), block=block)

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dim(self) -> int:
        return self.weight.dim()

    def dequantize(self, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """The real weight in `dtype`, computed on `device` (the parameter's: a GPU dequantizes far faster)."""
        return dequantize_block_fp8(self.weight.to(device), self.scale_inv.to(device), self.block, dtype)

    def narrow(self, dim: int, start: int, length: int) -> "Fp8BlockWeight":
        """Rows or columns [start, start + length) with their scale blocks: a tensor-parallel shard or a fused
        projection's segment. A slice that cuts a block would leave its scale shared by two owners: refused."""
        dim = dim % self.weight.dim()
        lead = self.weight.dim() - 2
        if dim < lead:
            return Fp8BlockWeight(self.weight.narrow(dim, start, length), self.scale_inv.narrow(dim, start, length),
                                  self.block)
        b = self.block[dim - lead]
        end, size = start + length, self.weight.shape[dim]
        if start % b or (end % b and end != size):
            raise ValueError(f"a slice [{start}, {end}) of dimension {dim} (size {size}) cuts a {b}-element FP8 scale "
                             f"block: a tensor-parallel shard or fused segment of a block-FP8 weight must start and "
                             f"end on multiples of {b}")
        nb = -(-end // b) - start // b
        return Fp8BlockWeight(self.weight.narrow(dim, start, length), self.scale_inv.narrow(dim, start // b, nb),
                              self.block)

    @staticmethod
    def cat(parts: list["Fp8BlockWeight"], dim: int) -> "Fp8BlockWeight":
        """Block-aligned pieces (from `narrow`) joined along `dim`, their scale blocks with them."""
        return Fp8BlockWeight(torch.cat([p.weight for p in parts], dim), torch.cat([p.scale_inv for p in parts], dim),
                              parts[0].block)


def dense_weight(loaded: torch.Tensor | Fp8BlockWeight, like: torch.Tensor) -> torch.Tensor:
    """The switch point of the format (see the module): a checkpoint weight as the parameter `like` holds it. Today
    every parameter holds the compute dtype, so a block-FP8 weight is dequantized here, on the parameter's device; a
    layer that holds FP8 takes `loaded.weight` and `loaded.scale_inv` into its FP8 weight and scale parameters
    instead (scale blocks already sliced along with any tensor-parallel shard by `narrow`)."""
    if isinstance(loaded, Fp8BlockWeight):
        return loaded.dequantize(like.dtype, like.device)
    return loaded
