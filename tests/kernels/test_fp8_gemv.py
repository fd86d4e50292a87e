"""Block-FP8 GEMVs (kernels/fp8_gemv.py) vs their plain-torch references: one row, 2..16 rows, the RMSNorm-fused
and gated variants. CPU: under TRITON_INTERPRET=1 in fp32 and fp16, partial scale blocks (N, K not multiples of
128) and several scale columns a step. GPU (skipped without CUDA): bf16 on a real projection shape."""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels.fp8_gemv import (
    fp8_gemv, fp8_gemv_reference, fp8_norm_gemv, fp8_norm_gemv_reference, fp8_rows_gemm,
)
from freetoken_core.kernels.fp8_gdn_out_gemv import fp8_gdn_out_norm_gemv
from freetoken_core.kernels.fp8_ref import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from freetoken_core.kernels.gdn_ref import gdn_out_norm_gemv_ref
from freetoken_core.kernels.gemv_ref import gemv_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEV, dtype=dtype)


def fp8_weight(n: int, k: int, seed: int = 0, block: tuple[int, int] = (128, 128)):
    """A block-quantized random weight whose blocks have very different magnitudes (so a scale applied to the wrong
    block shows), on DEV."""
    w = _randn(n, k, seed=seed, scale=0.1).cpu()
    w *= torch.logspace(-2, 2, steps=n).view(n, 1) ** 0.5 * torch.logspace(1, -1, steps=k).view(1, k) ** 0.5
    q, s = quantize_block_fp8(w, block)
    return q.to(DEV), s.to(DEV)


TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=1e-2)}


def test_the_reference_is_the_dequantized_product():
    q, s = fp8_weight(200, 300)
    x = _randn(3, 300, seed=1)
    want = x @ dequantize_block_fp8(q, s).t()
    torch.testing.assert_close(fp8_gemv_reference(x, q, s), want, atol=1e-5, rtol=1e-5)
    assert q.dtype == FP8_DTYPE and s.shape == (2, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,block_k", [(200, 300, 64), (136, 256, 256), (72, 200, 512)])
def test_fp8_gemv_matches_reference(dtype, n, k, block_k):
    # block_k 64: two steps a scale block; 256 / 512: several scale columns a step (partial K in the last)
    q, s = fp8_weight(n, k)
    x = _randn(1, k, dtype=dtype, seed=1)
    b = _randn(n, dtype=dtype, seed=3)
    got = fp8_gemv(x, q, s, b, block_n=16, block_k=block_k, num_warps=4, num_stages=2)
    torch.testing.assert_close(got, fp8_gemv_reference(x, q, s, b), **TOL[dtype])


def test_fp8_gemv_gated_input():
    q, s = fp8_weight(64, 256)
    x = _randn(1, 256, seed=1)
    gate = _randn(1, 4, 128, seed=2)[:, :, :64]  # [1, H, D] with a head stride of 128, as the QKV output's slice
    got = fp8_gemv(x, q, s, gate=gate, block_n=16, block_k=64)
    torch.testing.assert_close(got, fp8_gemv_reference(x, q, s, gate=gate.reshape(1, -1)), **TOL[torch.float32])


def test_fp8_gemv_blocks_other_than_128():
    block = (32, 64)
    q, s = fp8_weight(100, 160, block=block)
    x = _randn(1, 160, seed=1)
    got = fp8_gemv(x, q, s, block=block, block_n=64, block_k=128)  # BLOCK_N shrinks to the 32 rows of a block
    torch.testing.assert_close(got, fp8_gemv_reference(x, q, s, block=block), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_fp8_rows_gemm_matches_reference(dtype, m):
    q, s = fp8_weight(150, 200)
    x = _randn(m, 200, dtype=dtype, seed=m)
    b = _randn(150, dtype=dtype, seed=3)
    got = fp8_rows_gemm(x, q, s, b, block_n=32, block_k=64)
    torch.testing.assert_close(got, fp8_gemv_reference(x, q, s, b), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated,n", [(False, 136), (True, 96)])  # gated: the up rows start inside a scale block
@pytest.mark.parametrize("residual", [False, True])
def test_fp8_norm_gemv_matches_reference(dtype, gated, n, residual):
    k = 200
    q, s = fp8_weight(2 * n if gated else n, k)
    x = _randn(1, k, dtype=dtype, seed=1)
    r = _randn(1, k, dtype=dtype, seed=2) if residual else None
    g = (1.0 + 0.3 * _randn(k, seed=4)).to(dtype)
    got, h = fp8_norm_gemv(x, r, g, 1e-6, q, s, gated=gated, block_n=16, block_k=64)
    want, want_h = fp8_norm_gemv_reference(x, r, g, 1e-6, q, s, gated=gated)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,n_tail", [(256, 8), (136, 40)])  # body ending on a block; a partial last body block
def test_fp8_norm_gemv_with_a_dense_tail(dtype, n, n_tail):
    """Rows after the FP8 body from a dense weight in the same launch (the GDN in_proj's full-precision b and a)."""
    k = 200
    q, s = fp8_weight(n, k)
    tail = _randn(n_tail, k, dtype=dtype, seed=5) * 0.05
    x = _randn(1, k, dtype=dtype, seed=1)
    r = _randn(1, k, dtype=dtype, seed=2)
    g = (1.0 + 0.3 * _randn(k, seed=4)).to(dtype)
    got, h = fp8_norm_gemv(x, r, g, 1e-6, q, s, block_n=16, block_k=64, tail=tail)
    want, want_h = fp8_norm_gemv_reference(x, r, g, 1e-6, q, s, tail=tail)
    assert got.shape == (1, n + n_tail)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)


def test_fp8_norm_gemv_zero_centered_with_bias():
    q, s = fp8_weight(64, 256)
    x = _randn(1, 256, seed=1)
    g = 0.3 * _randn(256, seed=4)
    b = _randn(64, seed=3)
    got, _ = fp8_norm_gemv(x, None, g, 1e-6, q, s, b, zero_centered=True, block_n=16, block_k=256)
    want, _ = fp8_norm_gemv_reference(x, None, g, 1e-6, q, s, b, zero_centered=True)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [2, 8])  # 64 columns a step (two a scale block), 256 (a partial last step)
def test_fp8_gdn_out_norm_gemv_matches_reference(dtype, heads):
    num_heads, dv, n = 5, 32, 40  # K = 160: a partial scale block
    o = _randn(1, num_heads * dv, dtype=dtype, seed=1)
    z = _randn(1, num_heads, 2 * dv, dtype=dtype, seed=2)[..., :dv]  # strided: a view of in_proj's row
    nw = (1 + 0.3 * _randn(dv, seed=4)).to(dtype)
    q, s = fp8_weight(n, num_heads * dv)
    b = _randn(n, dtype=dtype, seed=3)
    got = fp8_gdn_out_norm_gemv(o, z, nw, 1e-6, q, s, b, block_n=16, heads=heads)
    want = gdn_out_norm_gemv_ref(o, z, nw, 1e-6, dequantize_block_fp8(q, s), b)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_bad_scales_are_refused():
    q, s = fp8_weight(200, 300)
    with pytest.raises(ValueError, match="does not fit weight"):
        fp8_gemv(_randn(1, 300), q, s[:1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv(_randn(1, 300), q.float(), s)


@needs_cuda
@pytest.mark.parametrize("rows", [1, 9])
def test_fp8_gemv_bf16_on_gpu(rows):
    q, s = fp8_weight(5120, 2048)
    x = _randn(rows, 2048, dtype=torch.bfloat16, seed=1)
    got = fp8_gemv(x, q, s) if rows == 1 else fp8_rows_gemm(x, q, s)
    want = gemv_reference(x, dequantize_block_fp8(q, s))
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
