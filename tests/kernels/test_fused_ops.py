"""Fused Triton small ops (RMSNorm and its zero-centred form, add+RMSNorm, SiLU-and-mul, rotary) vs
their plain-torch references.

CPU: the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py) in fp32 and fp16 only (the
interpreter's bf16 arithmetic is broken), at a few rows to keep the interpreter cheap. GPU (skipped
without CUDA): bf16 at real sizes, the layer dispatch, and a CUDA-graph replay.
"""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels import fused_ops as ops
from freetoken_core.layers.rotary import RotaryEmbedding

CPU_DTYPES = [torch.float32, torch.float16]
# The small cases run where the kernels can: the interpreter on CPU, compiled on a GPU host.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _tol(dtype: torch.dtype) -> dict:
    # fp32: reduction order / exp differ in the last bits; fp16/bf16: at most a last-place rounding flip
    return {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
            torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}[dtype]


def _randn(*shape: int, dtype: torch.dtype, device: str = DEV, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


def _assert_mostly_exact(got: torch.Tensor, ref: torch.Tensor, max_mismatch: float = 0.01) -> None:
    """Same rounding points as the reference: all but rare last-place flips are bit-identical."""
    torch.testing.assert_close(got, ref, **_tol(got.dtype))
    if got.dtype == torch.float32:  # no rounding step to hide fp32 reduction-order differences
        return
    mismatch = (got != ref).float().mean().item()
    assert mismatch <= max_mismatch, f"{mismatch:.2%} of elements differ from the reference"


# --------------------------------------------------------------------------------------- CPU (interpreter)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("n", [40, 64])  # 40: not a power of two (masked lanes)
def test_rmsnorm_matches_reference(dtype, n):
    x = _randn(3, n, dtype=dtype)
    w = (1 + 0.3 * _randn(n, dtype=torch.float32, seed=1)).to(dtype)
    _assert_mostly_exact(ops.rmsnorm(x, w, 1e-6), ops.rmsnorm_reference(x, w, 1e-6))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_fused_add_rmsnorm_matches_reference(dtype):
    x, res = _randn(3, 40, dtype=dtype), _randn(3, 40, dtype=dtype, seed=2)
    w = (1 + 0.3 * _randn(40, dtype=torch.float32, seed=1)).to(dtype)
    normed, new_res = ops.fused_add_rmsnorm(x, res, w, 1e-5)
    ref_normed, ref_res = ops.fused_add_rmsnorm_reference(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)  # one rounded add: exact
    _assert_mostly_exact(normed, ref_normed)
    # inputs untouched (the API returns new tensors)
    torch.testing.assert_close(x, _randn(3, 40, dtype=dtype), atol=0, rtol=0)


def test_rmsnorm_of_strided_head_view():
    """Qwen3's q/k norm: [T, H, D] heads sliced out of a fused qkv row, normed per head without a copy."""
    qkv = _randn(2, 3 * 24, dtype=torch.float32)
    q = qkv[:, :48].view(2, 2, 24)  # strides (72, 24, 1)
    w = 1 + 0.3 * _randn(24, dtype=torch.float32, seed=1)
    got = ops.rmsnorm(q, w, 1e-6)
    assert got.shape == q.shape and got.is_contiguous()
    _assert_mostly_exact(got, ops.rmsnorm_reference(q, w, 1e-6))


def test_zero_centered_reference_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    from freetoken_core.layers import ZeroCenteredRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        x, w = _randn(3, 40, dtype=dtype, device="cpu"), 0.3 * _randn(40, dtype=dtype, device="cpu", seed=1)
        hf = Qwen3NextRMSNorm(40, eps=1e-6).to(dtype)
        hf.weight.data.copy_(w)
        ours = ZeroCenteredRMSNorm(40, 1e-6, dtype)
        ours.weight.data.copy_(w)
        torch.testing.assert_close(ops.rmsnorm_reference(x, w, 1e-6, zero_centered=True), hf(x), atol=0, rtol=0)
        torch.testing.assert_close(ours(x), hf(x), atol=0, rtol=0)  # the layer's CPU path is the reference
        res = _randn(3, 40, dtype=dtype, device="cpu", seed=2)
        normed, new_res = ours(x, res)
        torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
        torch.testing.assert_close(normed, hf(x + res), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_zero_centered_rmsnorm_matches_reference(dtype, residual):
    x, res = _randn(3, 40, dtype=dtype), _randn(3, 40, dtype=dtype, seed=2)
    w = (0.3 * _randn(40, dtype=torch.float32, seed=1)).to(dtype)  # stored as w - 1
    if residual:
        normed, new_res = ops.fused_add_rmsnorm(x, res, w, 1e-6, zero_centered=True)
        ref_normed, ref_res = ops.fused_add_rmsnorm_reference(x, res, w, 1e-6, zero_centered=True)
        torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
        _assert_mostly_exact(normed, ref_normed)
    else:
        _assert_mostly_exact(ops.rmsnorm(x, w, 1e-6, zero_centered=True),
                             ops.rmsnorm_reference(x, w, 1e-6, zero_centered=True))
    q = _randn(2, 3 * 24, dtype=dtype)[:, 24:].view(2, 2, 24)  # a strided head view (the q/k norms)
    _assert_mostly_exact(ops.rmsnorm(q, w[:24], 1e-6, zero_centered=True),
                         ops.rmsnorm_reference(q, w[:24], 1e-6, zero_centered=True))


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_zero_centered_norm_gemv_matches_reference(dtype, residual):
    from freetoken_core.kernels import norm_gemv as gemv

    k, n = 200, 72
    x, r = _randn(1, k, dtype=dtype, seed=1), _randn(1, k, dtype=dtype, seed=6) if residual else None
    g = 0.1 * _randn(k, dtype=dtype, seed=7)
    w = _randn(n, k, dtype=dtype, seed=2) * 0.1
    got, h = gemv.norm_gemv(x, r, g, 1e-6, w, None, block_n=16, block_k=64, num_warps=4, num_stages=2,
                            zero_centered=True)
    want, want_h = gemv.norm_gemv_reference(x, r, g, 1e-6, w, None, zero_centered=True)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("inter", [24, 1100])  # 1100: two column blocks, the second partial
def test_silu_and_mul_matches_reference(dtype, inter):
    x = _randn(2, 2 * inter, dtype=dtype)
    _assert_mostly_exact(ops.silu_and_mul(x), ops.silu_and_mul_reference(x))


def _rotary_case(head_dim: int, rot_dim: int, num_q: int, num_kv: int, dtype: torch.dtype, device: str = DEV):
    params = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": rot_dim / head_dim}
    rope = RotaryEmbedding(head_dim, 600, params, dtype).to(device)
    assert rope.rot_dim == rot_dim
    t = 4
    qkv = _randn(t, (num_q + 2 * num_kv) * head_dim, dtype=dtype, device=device)
    q = qkv[:, : num_q * head_dim].view(t, num_q, head_dim)  # strided views, as the model passes them
    k = qkv[:, num_q * head_dim: (num_q + num_kv) * head_dim].view(t, num_kv, head_dim)
    positions = torch.tensor([0, 513, 7, 300], device=device)  # rows of several requests
    return rope, positions, q, k


@pytest.mark.parametrize("dtype", CPU_DTYPES)
@pytest.mark.parametrize("head_dim,rot_dim,num_q,num_kv", [
    (16, 16, 4, 2),  # full rotary, GQA
    (24, 16, 3, 1),  # partial rotary, head_dim not a power of two
    (32, 12, 2, 2),  # partial with a non-power-of-two half (6) and pass-through (20)
    (128, 128, 20, 4),  # more heads than one program takes: several q blocks
])
def test_rotary_matches_reference(dtype, head_dim, rot_dim, num_q, num_kv):
    rope, positions, q, k = _rotary_case(head_dim, rot_dim, num_q, num_kv, dtype)
    q_in, k_in = q.clone(), k.clone()
    got_q, got_k = ops.rotary(positions, q, k, rope.cos_sin_cache, rot_dim)
    ref_q, ref_k = ops.rotary_reference(positions, q, k, rope.cos_sin_cache, rot_dim)
    # each product and the sum rounded like the reference (no FMA contraction): bit-identical
    torch.testing.assert_close(got_q, ref_q, atol=0, rtol=0)
    torch.testing.assert_close(got_k, ref_k, atol=0, rtol=0)
    torch.testing.assert_close(q, q_in, atol=0, rtol=0)
    torch.testing.assert_close(k, k_in, atol=0, rtol=0)


def test_rotary_reference_is_the_layer_cpu_path():
    rope, positions, q, k = _rotary_case(24, 16, 3, 1, torch.float32, "cpu")
    for got, ref in zip(rope(positions, q, k), ops.rotary_reference(positions, q, k, rope.cos_sin_cache, 16)):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_zero_rows_launch_nothing():
    w = torch.ones(8, device=DEV)
    e = dict(device=DEV)
    assert ops.rmsnorm(torch.empty(0, 8, **e), w, 1e-6).shape == (0, 8)
    assert ops.fused_add_rmsnorm(torch.empty(0, 8, **e), torch.empty(0, 8, **e), w, 1e-6)[1].shape == (0, 8)
    assert ops.silu_and_mul(torch.empty(0, 8, **e)).shape == (0, 4)
    rq, rk = ops.rotary(torch.empty(0, dtype=torch.long, **e), torch.empty(0, 2, 8, **e), torch.empty(0, 1, 8, **e),
                        torch.ones(4, 8, **e), 8)
    assert rq.shape == (0, 2, 8) and rk.shape == (0, 1, 8)


# ---------------------------------------------------------------------------------------------- GPU


@needs_cuda
@pytest.mark.parametrize("t", [1, 7, 256])
@pytest.mark.parametrize("n", [2048, 4096, 2880])
def test_gpu_norms_bf16(t, n):
    x, res = _randn(t, n, dtype=torch.bfloat16, device="cuda"), _randn(t, n, dtype=torch.bfloat16, device="cuda", seed=2)
    w = (1 + 0.3 * _randn(n, dtype=torch.float32, seed=1)).to("cuda", torch.bfloat16)
    _assert_mostly_exact(ops.rmsnorm(x, w, 1e-5), ops.rmsnorm_reference(x, w, 1e-5))
    normed, new_res = ops.fused_add_rmsnorm(x, res, w, 1e-5)
    ref_normed, ref_res = ops.fused_add_rmsnorm_reference(x, res, w, 1e-5)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    _assert_mostly_exact(normed, ref_normed)


@needs_cuda
@pytest.mark.parametrize("t", [1, 7, 256])
def test_gpu_zero_centered_norms_bf16(t):
    n = 2048  # Qwen3.6's hidden size
    x = _randn(t, n, dtype=torch.bfloat16, device="cuda")
    res = _randn(t, n, dtype=torch.bfloat16, device="cuda", seed=2)
    w = (0.3 * _randn(n, dtype=torch.float32, seed=1)).to("cuda", torch.bfloat16)
    _assert_mostly_exact(ops.rmsnorm(x, w, 1e-6, True), ops.rmsnorm_reference(x, w, 1e-6, True))
    normed, new_res = ops.fused_add_rmsnorm(x, res, w, 1e-6, True)
    ref_normed, ref_res = ops.fused_add_rmsnorm_reference(x, res, w, 1e-6, True)
    torch.testing.assert_close(new_res, ref_res, atol=0, rtol=0)
    _assert_mostly_exact(normed, ref_normed)


@needs_cuda
def test_gpu_zero_centered_layers_dispatch():
    """ZeroCenteredRMSNorm takes the fused kernel on CUDA, and norm_linear the fused norm + GEMV."""
    from freetoken_core.kernels import norm_gemv
    from freetoken_core.layers import Linear, ZeroCenteredRMSNorm
    from freetoken_core.layers.norm_linear import norm_linear

    norm = ZeroCenteredRMSNorm(2048, 1e-6, torch.bfloat16).cuda()
    norm.weight.data.normal_(0, 0.3)
    x = _randn(1, 2048, dtype=torch.bfloat16, device="cuda")
    res = _randn(1, 2048, dtype=torch.bfloat16, device="cuda", seed=2)
    _assert_mostly_exact(norm(x), ops.rmsnorm_reference(x, norm.weight, 1e-6, True))
    lin = Linear(2048, 9216, bias=False, dtype=torch.bfloat16).cuda()  # Qwen3.6's gated-attention qkv
    lin.weight.data.normal_(0, 0.02)
    y, h = norm_linear(norm, lin, x, res)
    want, want_h = norm_gemv.norm_gemv_reference(x, res, norm.weight, 1e-6, lin.weight, None, zero_centered=True)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    torch.testing.assert_close(y, want, atol=5e-2, rtol=2e-2)


@needs_cuda
@pytest.mark.parametrize("t", [1, 7, 256])
@pytest.mark.parametrize("inter", [8192, 14336, 5000])
def test_gpu_silu_and_mul_bf16(t, inter):
    x = _randn(t, 2 * inter, dtype=torch.bfloat16, device="cuda")
    _assert_mostly_exact(ops.silu_and_mul(x), ops.silu_and_mul_reference(x))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim,rot_dim,num_q,num_kv", [(64, 64, 32, 8), (128, 128, 32, 8), (128, 64, 40, 8),
                                                           (80, 40, 16, 16)])
def test_gpu_rotary(dtype, head_dim, rot_dim, num_q, num_kv):
    rope, positions, q, k = _rotary_case(head_dim, rot_dim, num_q, num_kv, dtype, "cuda")
    got = ops.rotary(positions, q, k, rope.cos_sin_cache, rot_dim)
    ref = ops.rotary_reference(positions, q, k, rope.cos_sin_cache, rot_dim)
    for g, r in zip(got, ref):  # products of two half-precision values are exact in fp32: bit-identical
        torch.testing.assert_close(g, r, atol=0, rtol=0)


@needs_cuda
def test_gpu_layers_dispatch_to_fused_kernels():
    from freetoken_core.layers import RMSNorm, silu_and_mul
    from freetoken_core.kernels.fused_ops_ref import silu_and_mul_torch
    from freetoken_core.kernels.fused_ops_ref import rms_norm_torch

    assert ops.use_fused(torch.empty(1, device="cuda"))
    norm = RMSNorm(2048, 1e-5, torch.bfloat16).cuda()
    x, res = _randn(5, 2048, dtype=torch.bfloat16, device="cuda"), _randn(5, 2048, dtype=torch.bfloat16, device="cuda")
    _assert_mostly_exact(norm(x), rms_norm_torch(x, norm.weight, 1e-5))
    normed, new_res = norm(x, res)
    torch.testing.assert_close(new_res, x + res, atol=0, rtol=0)
    _assert_mostly_exact(normed, rms_norm_torch(x + res, norm.weight, 1e-5))
    h = _randn(5, 2 * 1000, dtype=torch.bfloat16, device="cuda")
    _assert_mostly_exact(silu_and_mul(h), silu_and_mul_torch(h))


@needs_cuda
def test_gpu_kernels_replay_in_a_cuda_graph():
    """Static shapes, no host syncs: captured once, replayed on new inputs and positions."""
    dtype, n, inter = torch.bfloat16, 2048, 4096
    rope, positions, q, k = _rotary_case(64, 64, 32, 8, dtype, "cuda")
    q, k = q.contiguous(), k.contiguous()
    x = _randn(4, n, dtype=dtype, device="cuda")
    res = _randn(4, n, dtype=dtype, device="cuda", seed=3)
    h = _randn(4, 2 * inter, dtype=dtype, device="cuda", seed=4)
    w = torch.ones(n, dtype=dtype, device="cuda")

    def step():
        return (*ops.fused_add_rmsnorm(x, res, w, 1e-5), ops.silu_and_mul(h),
                *ops.rotary(positions, q, k, rope.cos_sin_cache, 64))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in (10, 20):
        x.copy_(_randn(4, n, dtype=dtype, device="cuda", seed=seed))
        h.copy_(_randn(4, 2 * inter, dtype=dtype, device="cuda", seed=seed + 1))
        q.copy_(_randn(*q.shape, dtype=dtype, device="cuda", seed=seed + 2))
        positions.copy_(torch.tensor([seed, 1, 599, 3], device="cuda"))
        graph.replay()
        expected = step()
        for got, ref in zip(outs, expected):
            torch.testing.assert_close(got, ref, atol=0, rtol=0)
