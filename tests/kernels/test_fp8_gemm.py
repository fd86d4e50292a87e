"""Block-FP8 GEMMs (kernels/fp8_gemm.py) vs their plain-torch references: the per-token-group activation
quantization (bit-exact with torch's rounding), the w8a8 GEMM and the weight-only GEMM. CPU: under
TRITON_INTERPRET=1 in fp32 and fp16 with partial scale blocks in N and K and rows that leave a partial M tile.
GPU (skipped without CUDA): bf16 prefill shapes."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels import fp8_gemm
from freetoken_core.kernels.fp8_gemm import (
    fp8_gemm_w8a8, fp8_gemm_weight_only, fp8_gemv_reference, fp8_linear, per_token_group_quant_fp8,
    per_token_group_quant_fp8_reference, w8a8_gemm_reference,
)
from freetoken_core.kernels.fp8_gemm_ref import dequantize_tokens_fp8
from tests.kernels.test_fp8_gemv import DEV, TOL, _randn, fp8_weight, needs_cuda


def w8a8_tol(want: torch.Tensor, dtype: torch.dtype) -> dict:
    """fp32 on the GPU: Hopper's FP8 MMA keeps only ~14 mantissa bits while it sums one K step (DeepSeek-V3's
    "limited accumulation precision"), so there the w8a8 product is held to 2e-3 of the output's scale (~20 of
    those ulps) instead of fp32's 1e-4; the interpreter's fp32 dot is exact."""
    if DEV != "cuda" or dtype != torch.float32:
        return TOL[dtype]
    return dict(atol=2e-3 * want.abs().max().item(), rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_group_quant_is_exact(dtype):
    x = _randn(7, 300, dtype=dtype, seed=1) * torch.logspace(-3, 3, 300, device=DEV).to(dtype)
    x[2] = 0  # an all-zero row: the eps floor, no 0 / 0
    x[3, :128] = 1.9979  # rounds up to 2.0: the mantissa carry the interpreter's own fp8 cast loses
    q, s = per_token_group_quant_fp8(x)
    want_q, want_s = per_token_group_quant_fp8_reference(x)
    assert q.shape == (7, 300) and s.shape == (7, 3)
    torch.testing.assert_close(s, want_s, atol=0, rtol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(dequantize_tokens_fp8(q, s), x.float(), atol=1e-6, rtol=0.07)  # e4m3: 3 bits


def test_per_token_group_quant_rounds_every_e4m3_tie_to_even():
    # every value halfway between two neighbouring e4m3 numbers (subnormals included), scaled so each group's
    # amax maps to exactly 448 and its scale is 1
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mids = (grid[:-1] + grid[1:]) / 2
    x = torch.cat([mids, -mids, torch.tensor([448.0])])
    x = torch.nn.functional.pad(x, (0, 256 - x.numel())).view(2, 128).to(DEV)
    x[:, -1] = 448.0
    q, s = per_token_group_quant_fp8(x)
    want_q, want_s = per_token_group_quant_fp8_reference(x)
    assert torch.equal(s, want_s) and torch.all(s == 1.0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(20, 200, 300), (33, 72, 128)])
def test_fp8_gemm_w8a8_matches_reference(dtype, m, n, k):
    q, s = fp8_weight(n, k)
    x = _randn(m, k, dtype=dtype, seed=1)
    b = _randn(n, dtype=dtype, seed=3)
    got = fp8_gemm_w8a8(x, q, s, b)
    want = w8a8_gemm_reference(x, q, s, b)
    torch.testing.assert_close(got, want, **w8a8_tol(want, dtype))
    # and near the unquantized activations' product (the activation rounding is all that differs)
    near = fp8_gemv_reference(x.float(), q, s, b.float())
    assert (got.float() - near).norm() < 0.05 * near.norm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,n,k", [(20, 200, 300), (33, 72, 128)])
def test_fp8_gemm_weight_only_matches_reference(dtype, m, n, k):
    q, s = fp8_weight(n, k)
    x = _randn(m, k, dtype=dtype, seed=1)
    got = fp8_gemm_weight_only(x, q, s)
    torch.testing.assert_close(got, fp8_gemv_reference(x, q, s), **TOL[dtype])


def test_fp8_gemm_blocks_other_than_128_and_no_rows():
    block = (32, 64)
    q, s = fp8_weight(80, 160, block=block)
    x = _randn(18, 160, seed=1)
    torch.testing.assert_close(fp8_gemm_weight_only(x, q, s, block=block), fp8_gemv_reference(x, q, s, block=block),
                               **TOL[torch.float32])
    want = w8a8_gemm_reference(x, q, s, block=block)
    torch.testing.assert_close(fp8_gemm_w8a8(x, q, s, block=block), want, **w8a8_tol(want, torch.float32))
    assert fp8_gemm_w8a8(x[:0], q, s, block=block).shape == (0, 80)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 7, 17, 40])
def test_fp8_linear_picks_a_kernel_by_rows_and_dtype(m, dtype):
    # up to 16 rows the weight-only GEMVs; past them w8a8 for 16-bit activations, weight-only for fp32 ones
    q, s = fp8_weight(48, 160)
    x = _randn(m, 160, dtype=dtype, seed=m)
    b = _randn(48, dtype=dtype, seed=3)
    w8a8 = m > 16 and dtype != torch.float32
    want = (w8a8_gemm_reference if w8a8 else fp8_gemv_reference)(x, q, s, b)
    torch.testing.assert_close(fp8_linear(x, q, s, b), want, **(w8a8_tol(want, dtype) if w8a8 else TOL[dtype]))


@needs_cuda
@pytest.mark.parametrize("m", [64, 1000])
def test_fp8_gemms_bf16_on_gpu(m):
    q, s = fp8_weight(4096, 2048)
    x = _randn(m, 2048, dtype=torch.bfloat16, seed=1)
    torch.testing.assert_close(fp8_gemm_weight_only(x, q, s), fp8_gemv_reference(x, q, s), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fp8_gemm_w8a8(x, q, s), w8a8_gemm_reference(x, q, s), atol=3e-2, rtol=2e-2)
    qx, sx = per_token_group_quant_fp8(x)
    want_q, want_s = per_token_group_quant_fp8_reference(x)
    assert torch.equal(sx, want_s) and torch.equal(qx.view(torch.uint8), want_q.view(torch.uint8))


@needs_cuda
@pytest.mark.parametrize("m,k", [(1000, 2048), (258, 768)])
def test_block_scaled_mm_matches_the_w8a8_reference(m, k):
    # torch's block-scaled GEMM (prefill sizes on Hopper): rows padded to 4, K blocks (768 / 128 = 6) padded to 4
    q, s = fp8_weight(512, k)
    x = _randn(m, k, dtype=torch.bfloat16, seed=2)
    b = _randn(512, dtype=torch.bfloat16, seed=3)
    if not fp8_gemm.block_scaled_mm_supported(x, q, (128, 128)):
        pytest.skip("torch's block-scaled GEMM needs an sm_90 GPU and a torch with F.scaled_mm")
    want = w8a8_gemm_reference(x, q, s, b)
    torch.testing.assert_close(fp8_gemm.fp8_block_scaled_mm(x, q, s, b), want, atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(fp8_linear(x, q, s, b), want, atol=3e-2, rtol=2e-2)
