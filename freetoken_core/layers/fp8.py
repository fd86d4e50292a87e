"""The block-FP8 weight format of the layers (checkpoints with quant_method "fp8", weight_block_size [128, 128]).

A quantized projection is a weight format of the same layers, not another layer class: a checkpoint's
`X.weight` (float8_e4m3fn) and `X.weight_scale_inv` travel together as one `Fp8BlockWeight` from the checkpoint
reader (models/quant.py) to the parameter they fill. There, `load_into_param` is the one switch point of the
format: a parameter held in FP8 (a layer built for the FP8 kernels) takes the FP8 values and their scales; any
other parameter (the CPU, the reference path, and CUDA until the kernels/fp8_*.py kernels are wired into the
layers) takes the weight dequantized to its own dtype, on its own device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.fp8_ref import DEFAULT_BLOCK, FP8_DTYPE, block_scale_shape, dequantize_block_fp8, quantize_block_fp8

# Device types whose layers hold block-FP8 weights as FP8 (weight + scale_inv parameters) and run the FP8 kernels.
# Empty until kernels/fp8_*.py are wired into Linear and StackedExperts (then {"cuda"}): until then every device
# dequantizes at load, and the memory accounting (`weight_bytes`) counts the dequantized weights.
FP8_RESIDENT_DEVICES: frozenset[str] = frozenset()


def keeps_fp8(device: torch.device | str) -> bool:
    return torch.device(device).type in FP8_RESIDENT_DEVICES


@dataclass(frozen=True)
class Fp8BlockFormat:
    """How a model's FP8 weights are laid out: `block` (rows, cols) elements share one scale_inv."""

    block: tuple[int, int] = DEFAULT_BLOCK

    def stored_bytes(self, shape: tuple[int, ...], scale_dtype: torch.dtype = torch.float32) -> int:
        """Bytes of one weight of `shape` held in FP8: one byte an element plus its block scales."""
        scale_size = torch.empty((), dtype=scale_dtype).element_size()
        return math.prod(shape) + math.prod(block_scale_shape(tuple(shape), self.block)) * scale_size


def weight_bytes(shape: tuple[int, ...], dtype: torch.dtype, fmt: Fp8BlockFormat | None,
                 device: torch.device | str) -> int:
    """Real bytes of one quantizable weight of `shape` once loaded on `device`: FP8 + scales where the layers keep
    FP8 there, else `dtype` elements (dequantized at load, or a plain checkpoint)."""
    if fmt is not None and keeps_fp8(device):
        return fmt.stored_bytes(shape)
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


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


def load_into_param(param: torch.Tensor, loaded: torch.Tensor | Fp8BlockWeight) -> torch.Tensor | Fp8BlockWeight:
    """What a layer's weight_loader receives for `param`: the FP8 weight itself where the parameter is held in FP8,
    else (the switch point of the format, see the module) the weight dequantized to the parameter's dtype."""
    if not isinstance(loaded, Fp8BlockWeight) or param.dtype == FP8_DTYPE:
        return loaded
    return loaded.dequantize(param.dtype, param.device)
