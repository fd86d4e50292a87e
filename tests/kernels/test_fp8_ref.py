"""Block-FP8 reference (kernels/fp8_ref.py): the quantize/dequantize pair the loader and the FP8 kernels use."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels.fp8_ref import FP8_MAX, block_scale_shape, dequantize_block_fp8, quantize_block_fp8


@pytest.mark.parametrize("shape", [(256, 128), (192, 320), (3, 200, 130), (5, 7)])
def test_round_trip_is_within_e4m3_error(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
    w_fp8, scale_inv = quantize_block_fp8(w)
    assert w_fp8.dtype == torch.float8_e4m3fn and w_fp8.shape == w.shape
    assert tuple(scale_inv.shape) == block_scale_shape(w.shape) and scale_inv.dtype == torch.float32
    back = dequantize_block_fp8(w_fp8, scale_inv, dtype=torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error at most 2^-4 of the element, plus the block's subnormal step.
    step = scale_inv.amax() * 2.0 ** -9
    assert torch.all((back - w).abs() <= w.abs() * 2.0 ** -4 + step)


def test_each_block_uses_its_own_amax_and_partial_blocks_keep_theirs():
    w = torch.zeros(192, 130)
    w[0, 0] = 3.0          # block (0, 0)
    w[130, 129] = -0.5     # partial block (1, 1): a 64 x 2 block
    w_fp8, scale_inv = quantize_block_fp8(w)
    assert torch.equal(scale_inv, torch.tensor([[3.0 / FP8_MAX, 1.0], [1.0, 0.5 / FP8_MAX]]))
    assert w_fp8[0, 0].float() == FP8_MAX and w_fp8[130, 129].float() == -FP8_MAX
    assert torch.equal(dequantize_block_fp8(w_fp8, scale_inv), w)


def test_bf16_scales_and_output_dtype():
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(1))
    w_fp8, scale_inv = quantize_block_fp8(w)
    out = dequantize_block_fp8(w_fp8, scale_inv.to(torch.bfloat16), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), w, rtol=0.1, atol=1e-2)


def test_mismatched_scale_shape_is_refused():
    w_fp8, scale_inv = quantize_block_fp8(torch.randn(256, 256))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_block_fp8(w_fp8, scale_inv[:1])
