"""Plain-torch block-FP8 weight format: the published layout of the FP8 checkpoints (quant_method "fp8",
weight_block_size [128, 128]) and the reference the FP8 kernels are compared against.

A weight W [..., out, in] is stored as `w_fp8` float8_e4m3fn [..., out, in] and `scale_inv` [..., ceil(out/bo),
ceil(in/bi)]; the real weight is `w_fp8 * scale_inv` per (bo, bi) block. Trailing partial blocks (a dimension that
is not a multiple of the block) share their block's scale. Leading dimensions (stacked experts [E, out, in]) are
carried through.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)


def block_scale_shape(weight_shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = DEFAULT_BLOCK
                      ) -> tuple[int, ...]:
    """The scale_inv shape of a weight of `weight_shape` (leading dims kept, last two ceil-divided by the block)."""
    *lead, rows, cols = weight_shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def expand_block_scale(scale_inv: torch.Tensor, rows: int, cols: int, block: tuple[int, int] = DEFAULT_BLOCK
                       ) -> torch.Tensor:
    """scale_inv [..., nbr, nbc] repeated to one value per element [..., rows, cols] (partial blocks cropped)."""
    expanded = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return expanded[..., :rows, :cols]


def quantize_block_fp8(w: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., out, in] (any float dtype) -> (w_fp8 float8_e4m3fn [..., out, in], scale_inv fp32 [..., ceil(out/bo),
    ceil(in/bi)]) with scale_inv = amax(|block|) / 448, so each block's largest value maps to the e4m3 maximum."""
    if w.dim() < 2:
        raise ValueError(f"quantize_block_fp8: weight must have at least 2 dims, got shape {tuple(w.shape)}")
    *lead, rows, cols = w.shape
    bo, bi = block
    nbr, nbc = -(-rows // bo), -(-cols // bi)
    w32 = w.float()
    # Zero padding to whole blocks: a zero never raises a block's amax, so partial blocks scale by their real values.
    padded = torch.nn.functional.pad(w32, (0, nbc * bi - cols, 0, nbr * bo - rows))
    blocks = padded.reshape(*lead, nbr, bo, nbc, bi)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nbr, nbc]
    # An all-zero block keeps scale 1 (any scale dequantizes zeros to zero) instead of dividing by zero.
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = w32 / expand_block_scale(scale_inv, rows, cols, block)
    w_fp8 = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return w_fp8, scale_inv


def dequantize_block_fp8(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The real weight w_fp8 * scale_inv per block, computed in fp32 and returned in `dtype`."""
    *lead, rows, cols = w_fp8.shape
    expected = block_scale_shape(w_fp8.shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"dequantize_block_fp8: scale_inv shape {tuple(scale_inv.shape)} does not match weight "
                         f"{tuple(w_fp8.shape)} with block {tuple(block)} (expected {expected})")
    w32 = w_fp8.float() * expand_block_scale(scale_inv.float(), rows, cols, block)
    return w32.to(dtype)
