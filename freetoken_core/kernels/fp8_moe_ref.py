"""Plain-torch references of the block-FP8 expert kernels (`fp8_moe.py`): the expert stacks dequantized block-wise
(fp8_ref.py) and run through `fused_moe_ref`; for the w8a8 grouped GEMM, the activations quantized per token and
K-block group before each of the two GEMMs, as that kernel does. No Triton import."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8_gemm_ref import dequantize_tokens_fp8, per_token_group_quant_fp8_reference
from .fp8_ref import DEFAULT_BLOCK, dequantize_block_fp8
from .fused_moe_ref import fused_moe_ref


def fp8_fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                            s2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """x [T, H], w13 FP8 [E, 2I, H] with s13 [E, ceil(2I/GN), ceil(H/GK)], w2 FP8 [E, H, I] with s2 [E, ceil(H/GN),
    ceil(I/GK)], routing [T, k] -> [T, H]: `fused_moe_ref` on the dequantized experts (weight-only kernels)."""
    return fused_moe_ref(x, dequantize_block_fp8(w13, s13, block, x.dtype), dequantize_block_fp8(w2, s2, block, x.dtype),
                         topk_weights, topk_ids)


def _quantized(a: torch.Tensor, group: int) -> torch.Tensor:
    return dequantize_tokens_fp8(*per_token_group_quant_fp8_reference(a, group), group)


def fp8_fused_moe_w8a8_reference(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                                 s2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                                 block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """As `fp8_fused_moe_reference` with x and each route's SiLU-and-mul output quantized per token and K-block
    group (the w8a8 grouped GEMM); products in fp32, rounded to x's dtype where `fused_moe_ref` rounds."""
    inter = w2.shape[2]
    w13d, w2d = dequantize_block_fp8(w13, s13, block), dequantize_block_fp8(w2, s2, block)
    xq = _quantized(x, block[1])
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    ids_t = topk_ids.t()
    for e in torch.unique(topk_ids).tolist():
        route, token = torch.where(ids_t == e)
        h = (xq[token] @ w13d[e].t()).to(x.dtype)
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = (_quantized(act, block[1]) @ w2d[e].t()).to(x.dtype) * weights[token, route, None]
        out.index_add_(0, token, y)
    return out
