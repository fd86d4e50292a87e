"""The block-FP8 weight format of the layers (checkpoints with quant_method "fp8", weight_block_size [128, 128]).

A quantized projection is a weight format of the same layers, not another layer class: a checkpoint's
`X.weight` (float8_e4m3fn) and `X.weight_scale_inv` travel together as one `Fp8BlockWeight` from the checkpoint
reader (models/quant.py) through the layers' weight loaders, which slice it like a tensor (a fused projection's
segment, a tensor-parallel shard: `narrow` takes the scale blocks along and refuses a cut inside a block), to the
copy into the parameter. Where that copy lands is the layer's format, chosen at load (models/quant.py
`hold_fp8_weights`): a layer that holds FP8 (`Fp8Held`: Linear and its fused q/k/v and gate/up forms, the stacked
experts; on CUDA, or everywhere with FREETOKEN_FP8_KEEP=1) takes the e4m3 values and their scale blocks as they are
(`copy_fp8_rows`) and runs the kernels/fp8_*.py kernels; every other parameter is in the compute dtype and takes the
weight dequantized (`dense_weight`, called by `copy_checked`): the CPU and reference path.
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


def copy_fp8_rows(weight: torch.Tensor, scale_inv: torch.Tensor, loaded: Fp8BlockWeight, start: int,
                  length: int) -> None:
    """Rows [start, start + length) (dimension -2) of an FP8-held weight and their scale rows take a checkpoint
    weight's e4m3 values and scales as they are (a fused projection's segment starts on a scale block)."""
    b = loaded.block[0]
    if start % b:
        raise ValueError(f"an FP8 segment at row {start} does not start on a {b}-row scale block")
    rows = weight.narrow(-2, start, length)
    scales = scale_inv.narrow(-2, start // b, -(-length // b))
    if rows.shape != loaded.weight.shape or scales.shape != loaded.scale_inv.shape:
        raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} does not fit {tuple(rows.shape)}")
    rows.copy_(loaded.weight)
    scales.copy_(loaded.scale_inv)


def empty_fp8_like(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised e4m3 storage of `weight`'s shape and device, and its scale grid (fp32 ones: an unloaded block
    stays finite)."""
    return (torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device),
            torch.ones(block_scale_shape(weight.shape, block), dtype=torch.float32, device=weight.device))


class Fp8Held:
    """Mixin of the layers that can hold block-FP8 weights: `fp8_block` is None (the compute dtype) or the block of
    the FP8 weights named by `fp8_names` (each `<name>` an e4m3 parameter with a `<name>_scale_inv` fp32 buffer)."""

    fp8_block: tuple[int, int] | None = None
    fp8_names: tuple[str, ...] = ()
    compute_dtype: torch.dtype | None = None

    def hold_fp8(self, block: tuple[int, int]) -> bool:
        """Switch the weights to FP8 storage before loading; False where this layer cannot (it stays dense)."""
        if self.fp8_refusal(block) is not None:
            return False
        for name in self.fp8_names:
            param = getattr(self, name)
            self.compute_dtype = param.dtype
            values, scale = empty_fp8_like(param, block)
            param.data = values  # the same Parameter object: the loader's name -> parameter map stays valid
            self.register_buffer(name + "_scale_inv", scale)
        self.fp8_block = block
        return True

    def fp8_refusal(self, block: tuple[int, int]) -> str | None:
        """Why this layer cannot hold FP8 weights of `block` (None: it can)."""
        return None

    def drop_fp8(self) -> None:
        """Back to the compute dtype (a checkpoint tensor arrived plain: `modules_to_not_convert`), what was loaded
        so far dequantized."""
        if self.fp8_block is None:
            return
        for name in self.fp8_names:
            param, scale = getattr(self, name), getattr(self, name + "_scale_inv")
            param.data = dequantize_block_fp8(param.data, scale, self.fp8_block, self.compute_dtype)
            delattr(self, name + "_scale_inv")
        self.fp8_block = None

    def fp8_dense_tensors(self) -> list[torch.Tensor]:
        """Weights an FP8-held layer keeps in the compute dtype beside its FP8 ones (none by default)."""
        return []

    def fp8_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(values, scale_inv) of each FP8-held weight (none when dense)."""
        if self.fp8_block is None:
            return []
        return [(getattr(self, n), getattr(self, n + "_scale_inv")) for n in self.fp8_names]

    def copy_weight_rows(self, name: str, dst_index: int | None, start: int, length: int,
                         loaded: torch.Tensor | Fp8BlockWeight) -> None:
        """Rows [start, start + length) of weight `name` (of expert `dst_index` of a stack) from a checkpoint tensor,
        in the format the layer holds; a plain tensor turns an FP8-held layer dense first."""
        if self.fp8_block is not None and not (isinstance(loaded, Fp8BlockWeight) and loaded.block == self.fp8_block):
            self.drop_fp8()
        param = getattr(self, name).data
        if self.fp8_block is not None:
            scale = getattr(self, name + "_scale_inv")
            if dst_index is not None:
                param, scale = param[dst_index], scale[dst_index]
            copy_fp8_rows(param, scale, loaded, start, length)
            return
        dst = param if dst_index is None else param[dst_index]
        if (start, length) != (0, dst.shape[-2]):
            dst = dst.narrow(-2, start, length)
        if dst.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor shape {tuple(loaded.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(dense_weight(loaded, dst))


def fill_fp8_normal_(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], std: float,
                     generator: torch.Generator, chunk_elements: int = 1 << 26) -> None:
    """Random FP8 weights as a quantized N(0, std) weight has them (load_format="dummy" with FP8): values drawn in
    fp32 on the weight's device and quantized block-wise, a chunk of leading indices (experts) at a time."""
    rows, cols = weight.shape[-2:]
    flat_w, flat_s = weight.reshape(-1, rows, cols), scale_inv.reshape(-1, *scale_inv.shape[-2:])
    step = max(1, chunk_elements // (rows * cols))
    for i in range(0, flat_w.shape[0], step):
        n = min(step, flat_w.shape[0] - i)
        w = torch.empty((n, rows, cols), dtype=torch.float32, device=weight.device).normal_(0.0, std,
                                                                                        generator=generator)
        values, scales = quantize_block_fp8(w, block)
        flat_w[i:i + n].copy_(values)
        flat_s[i:i + n].copy_(scales)


def dense_weight(loaded: torch.Tensor | Fp8BlockWeight, like: torch.Tensor) -> torch.Tensor:
    """A checkpoint weight as a compute-dtype parameter `like` holds it: a block-FP8 weight dequantized on the
    parameter's device (an FP8-held layer copies it as it is instead: `Fp8Held.copy_weight_rows`)."""
    if isinstance(loaded, Fp8BlockWeight):
        return loaded.dequantize(like.dtype, like.device)
    return loaded
