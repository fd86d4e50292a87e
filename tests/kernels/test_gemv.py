"""One-row GEMV kernel (kernels/gemv.py) vs its plain-torch reference, and the Linear dispatch.

CPU: under TRITON_INTERPRET=1 in fp32 and fp16 with small ragged shapes. GPU (skipped without
CUDA): bf16 on Llama-3-8B projection shapes, and a Linear layer taking the kernel inside a CUDA graph.
"""

from __future__ import annotations

import pytest
import torch

from freetoken_core.kernels import gemv as triton_gemv
from freetoken_core.kernels import norm_gemv as triton_norm_gemv
from freetoken_core.layers.linear import GEMV_MIN_ELEMENTS, Linear, use_gemv_for_all_sizes
from freetoken_core.kernels.gemv import gemv, gemv_reference, rows_gemm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _randn(*shape: int, dtype: torch.dtype, device: str = DEV, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("k", [200, 256])  # K not / a multiple of block_k
def test_gemv_matches_reference(dtype, bias, k):
    n = 72  # not a multiple of block_n
    x = _randn(1, k, dtype=dtype, seed=1)
    w = _randn(n, k, dtype=dtype, seed=2) * 0.1
    b = _randn(n, dtype=dtype, seed=3) if bias else None
    got = gemv(x, w, b, block_n=16, block_k=64, num_warps=4, num_stages=2)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, gemv_reference(x, w, b), **tol)


def test_gemv_takes_one_row_only():
    with pytest.raises(AssertionError, match="one row"):
        gemv(torch.zeros(2, 32, device=DEV), torch.zeros(16, 32, device=DEV), block_n=16, block_k=32)


def test_dispatch_rule():
    big = GEMV_MIN_ELEMENTS
    w = torch.empty(4096, 4096, dtype=torch.bfloat16)
    one = torch.empty(1, 4096, dtype=torch.bfloat16)
    assert not triton_gemv.use_gemv(one, w, big)  # CPU tensors stay on torch
    if torch.cuda.is_available():
        assert triton_gemv.use_gemv(one.cuda(), w.cuda(), big)
        assert not triton_gemv.use_gemv(torch.empty(2, 4096, dtype=torch.bfloat16, device="cuda"), w.cuda(), big)
        assert not triton_gemv.use_gemv(one.cuda().float(), w.cuda().float(), big)
        small = torch.empty(576, 576, dtype=torch.bfloat16, device="cuda")
        one_small = torch.empty(1, 576, dtype=torch.bfloat16, device="cuda")
        assert not triton_gemv.use_gemv(one_small, small, big)
        assert triton_gemv.use_gemv(one_small, small, 0)


def test_use_gemv_for_all_sizes_lowers_every_linear_layer():
    from freetoken_core.layers import MergedLinear, QKVLinear

    model = torch.nn.Sequential(Linear(8, 8), QKVLinear(8, 2, 1, 4), MergedLinear(8, [4, 4]), torch.nn.LayerNorm(8))
    assert all(m.gemv_min_elements == GEMV_MIN_ELEMENTS for m in model[:3])
    assert use_gemv_for_all_sizes(model) == 3
    assert all(m.gemv_min_elements == 0 and not m.rows_gemm for m in model[:3])
    use_gemv_for_all_sizes(model, rows=True)
    assert all(m.rows_gemm for m in model[:3])


# --- a few rows (speculative verify steps) -------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("k", [200, 256])  # K not / a multiple of block_k
@pytest.mark.parametrize("bias", [False, True])
def test_rows_gemm_matches_reference(dtype, m, k, bias):
    n = 72  # not a multiple of block_n
    x = _randn(m, k, dtype=dtype, seed=11)
    w = _randn(n, k, dtype=dtype, seed=12) * 0.1
    b = _randn(n, dtype=dtype, seed=13) if bias else None
    got = rows_gemm(x, w, b, block_n=32, block_k=64)
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, gemv_reference(x, w, b), **tol)


@pytest.mark.parametrize("block_n", [16, 64])  # tile widths other than the one above
def test_rows_gemm_tile_widths(block_n):
    x = _randn(5, 200, dtype=torch.float32, seed=16)
    w = _randn(72, 200, dtype=torch.float32, seed=17) * 0.1
    torch.testing.assert_close(rows_gemm(x, w, block_n=block_n, block_k=64), gemv_reference(x, w), atol=1e-3, rtol=1e-3)


def test_rows_gemm_dispatch_rule():
    w = torch.empty(576, 576, dtype=torch.bfloat16)
    rows = torch.empty(9, 576, dtype=torch.bfloat16)
    assert not triton_gemv.use_rows_gemm(rows, w, 0)  # CPU tensors stay on torch
    if torch.cuda.is_available():
        w, rows = w.cuda(), rows.cuda()
        assert triton_gemv.use_rows_gemm(rows, w, 0)
        assert not triton_gemv.use_rows_gemm(rows, w, GEMV_MIN_ELEMENTS)  # only where the engine lowered the bar
        assert not triton_gemv.use_rows_gemm(rows[:1], w, 0)  # one row: the GEMV
        assert not triton_gemv.use_rows_gemm(torch.empty(17, 576, dtype=torch.bfloat16, device="cuda"), w, 0)
        big = torch.empty(4096, 4096, dtype=torch.bfloat16, device="cuda")  # Llama-3-8B's o_proj: cuBLAS is faster
        assert not triton_gemv.use_rows_gemm(torch.empty(9, 4096, dtype=torch.bfloat16, device="cuda"), big, 0)


@needs_cuda
@pytest.mark.parametrize("m", [2, 5, 9, 16])
@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (576, 1536), (6144, 4096)])
def test_rows_gemm_bf16_shapes(m, n, k):
    x = _randn(m, k, dtype=torch.bfloat16, seed=14)
    w = _randn(n, k, dtype=torch.bfloat16, seed=15) * 0.02
    torch.testing.assert_close(rows_gemm(x, w), gemv_reference(x, w), atol=1e-2, rtol=1e-2)


def _replayed_in_a_graph(lin: Linear, x: torch.Tensor, new_x: torch.Tensor) -> torch.Tensor:
    """lin captured in a CUDA graph on a copy of x, then replayed on new_x: the graph's output."""
    static_x = x.clone()
    lin(static_x)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = lin(static_x)
    static_x.copy_(new_x)
    g.replay()
    return static_y


@needs_cuda
def test_linear_uses_rows_gemm_in_a_cuda_graph():
    lin = Linear(576, 960, dtype=torch.bfloat16).cuda()
    lin.weight.data.normal_(0, 0.02)
    use_gemv_for_all_sizes(lin, rows=True)
    x = torch.randn(9, 576, device="cuda", dtype=torch.bfloat16)
    replayed = _replayed_in_a_graph(lin, x, x * 2)
    torch.testing.assert_close(replayed, gemv_reference(x * 2, lin.weight), atol=1e-2, rtol=1e-2)


@needs_cuda
# 8B projections, and SmolLM2's (K = 576 / 1536: not a multiple of the K block, so the first tile
# that a PDL launch loads before waiting is a masked one)
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 14336), (960, 576), (3072, 576), (576, 1536)])
def test_gemv_bf16_8b_shapes(n, k):
    x = _randn(1, k, dtype=torch.bfloat16, seed=4)
    w = _randn(n, k, dtype=torch.bfloat16, seed=5) * 0.02
    torch.testing.assert_close(gemv(x, w), gemv_reference(x, w), atol=1e-2, rtol=1e-2)


@needs_cuda
def test_linear_uses_gemv_in_a_cuda_graph():
    lin = Linear(4096, 4096, dtype=torch.bfloat16).cuda()
    lin.weight.data.normal_(0, 0.02)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    assert triton_gemv.use_gemv(x, lin.weight, lin.gemv_min_elements)
    eager = lin(x)
    torch.testing.assert_close(_replayed_in_a_graph(lin, x, x * 2), lin(x * 2))
    torch.testing.assert_close(eager, gemv_reference(x, lin.weight), atol=1e-2, rtol=1e-2)


# --- RMSNorm (+ residual add) fused into the GEMV, optionally with SiLU-and-mul ------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("k", [200, 256])
def test_norm_gemv_matches_reference(dtype, residual, gated, norm, k):
    n = 72  # output rows (per half when gated): not a multiple of block_n
    x = _randn(1, k, dtype=dtype, seed=1)
    r = _randn(1, k, dtype=dtype, seed=6) if residual else None
    g = 1 + 0.1 * _randn(k, dtype=dtype, seed=7) if norm else None
    w = _randn(2 * n if gated else n, k, dtype=dtype, seed=2) * 0.1
    b = _randn(w.shape[0], dtype=dtype, seed=3)
    got, h = triton_norm_gemv.norm_gemv(x, r, g, 1e-5, w, b, gated, block_n=16, block_k=64, num_warps=4, num_stages=2)
    want, want_h = triton_norm_gemv.norm_gemv_reference(x, r, g, 1e-5, w, b, gated)
    assert got.shape == (1, n)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)  # the new residual is exact
    if not residual:
        assert h is x


def test_norm_linear_cpu_path_is_the_unfused_sequence():
    from freetoken_core.layers import MergedLinear, RMSNorm, silu_and_mul
    from freetoken_core.layers.norm_linear import norm_linear

    norm = RMSNorm(64, 1e-5)
    norm.weight.data.normal_(1, 0.1)
    lin = MergedLinear(64, [48, 48])
    lin.weight.data.normal_(0, 0.1)
    x, r = torch.randn(3, 64), torch.randn(3, 64)
    y, h = norm_linear(norm, lin, x, r, gated=True)
    normed, want_h = norm(x, r)
    torch.testing.assert_close(y, silu_and_mul(lin(normed)))
    torch.testing.assert_close(h, want_h)
    y0, h0 = norm_linear(norm, lin, x, None)
    assert h0 is x
    torch.testing.assert_close(y0, lin(norm(x)))
    with pytest.raises(ValueError, match="gate | up"):
        norm_linear(norm, Linear(64, 96), x, r, gated=True)


@needs_cuda
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (14336, 4096, True), (960, 576, False)])
def test_norm_gemv_bf16_8b_shapes(n, k, gated):
    x = _randn(1, k, dtype=torch.bfloat16, seed=4)
    r = _randn(1, k, dtype=torch.bfloat16, seed=8)
    g = 1 + 0.1 * _randn(k, dtype=torch.bfloat16, seed=9)
    w = _randn(2 * n if gated else n, k, dtype=torch.bfloat16, seed=5) * 0.02
    got, h = triton_norm_gemv.norm_gemv(x, r, g, 1e-5, w, None, gated)
    want, want_h = triton_norm_gemv.norm_gemv_reference(x, r, g, 1e-5, w, None, gated)
    # the unfused path rounds the normed row to bf16 twice before the GEMV; the fused one does not
    torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)


@needs_cuda
def test_norm_linear_fused_in_a_cuda_graph():
    from freetoken_core.layers import MergedLinear, RMSNorm
    from freetoken_core.layers.norm_linear import norm_linear

    norm = RMSNorm(4096, 1e-5, torch.bfloat16).cuda()
    lin = MergedLinear(4096, [14336, 14336], dtype=torch.bfloat16).cuda()
    lin.weight.data.normal_(0, 0.02)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    static_x, static_r = x.clone(), r.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y, static_h = norm_linear(norm, lin, static_x, static_r, gated=True)
    static_x.copy_(x * 2)
    g.replay()
    want, want_h = triton_norm_gemv.norm_gemv_reference(x * 2, r, norm.weight, 1e-5, lin.weight, None, True)
    torch.testing.assert_close(static_y, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(static_h, want_h, atol=0, rtol=0)



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("k", [200, 256])
def test_norm_gemv_normed_matches_reference(dtype, zero_centered, k):
    """The post-attention norm fused into the MoE router's GEMV: the logits, the normed row the experts
    take (rounded as the RMSNorm kernel rounds it) and the new residual."""
    from freetoken_core.kernels.fused_ops_ref import rms_norm_torch, zero_centered_rms_norm_torch

    n = 72  # router rows: not a multiple of block_n
    x, r = _randn(1, k, dtype=dtype, seed=11), _randn(1, k, dtype=dtype, seed=12)
    g = 0.1 * _randn(k, dtype=dtype, seed=13) + (0 if zero_centered else 1)
    w = _randn(n, k, dtype=dtype, seed=14) * 0.1
    logits, normed, h = triton_norm_gemv.norm_gemv_normed(x, r, g, 1e-5, w, zero_centered=zero_centered)
    want_logits, want_h = triton_norm_gemv.norm_gemv_reference(x, r, g, 1e-5, w, None, zero_centered=zero_centered)
    want_normed = (zero_centered_rms_norm_torch if zero_centered else rms_norm_torch)(x + r, g, 1e-5)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(logits, want_logits, **tol)
    # fp32: equal up to the order of the sum of squares; fp16: at most one rounding step apart
    torch.testing.assert_close(normed, want_normed, **(dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32
                                                       else dict(atol=2e-3, rtol=2e-3)))
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    assert normed.shape == x.shape and logits.shape == (1, n)


@pytest.mark.parametrize("zero_centered", [False, True])
def test_moe_block_forward_with_norm_is_norm_then_block(zero_centered):
    """SparseMoeBlock.forward_with_norm (the decoder layer hands it the post-attention norm) computes
    block(norm(x + residual)) and returns x + residual, on CPU (the unfused sequence) and on one CUDA row
    (one launch for the norm and the router)."""
    from freetoken_core.layers import RMSNorm
    from freetoken_core.layers.moe import SparseMoeBlock
    from freetoken_core.layers.norm import ZeroCenteredRMSNorm

    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    hidden, experts = 256, 16
    norm = (ZeroCenteredRMSNorm if zero_centered else RMSNorm)(hidden, 1e-6, dtype).to(DEV)
    norm.weight.data.normal_(0 if zero_centered else 1, 0.1)
    block = SparseMoeBlock(hidden, experts, 4, 64, True, dtype).to(DEV)
    for p in block.parameters():
        p.data.normal_(0, 3.0 / hidden ** 0.5)
    for rows in (1, 3):
        x = torch.randn(rows, hidden, dtype=dtype, device=DEV)
        r = torch.randn(rows, hidden, dtype=dtype, device=DEV)
        with torch.no_grad():
            if rows == 1:
                # The fused router takes the normed row unrounded, the unfused one after its rounding to
                # bf16: a near-tie in the top-k would pick other experts. A router whose logits on this row
                # are 0.5 apart (E rows along the normed row, scaled -4..4) leaves no near-tie.
                hf = norm(x, r)[0].float()[0]
                spread = torch.linspace(-4, 4, experts, device=DEV)[torch.randperm(experts, device=DEV)]
                block.gate.weight.copy_((spread[:, None] * hf[None, :] / hf.dot(hf)).to(dtype))
            got, got_r = block.forward_with_norm(norm, x, r)
            h, want_r = norm(x, r)
            want = block(h)
        torch.testing.assert_close(got_r, want_r, atol=0, rtol=0)
        torch.testing.assert_close(got, want, **(dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else {}))


@needs_cuda
@pytest.mark.parametrize("n", [128, 257])  # Qwen3-30B-A3B's router, Qwen3.6's with the shared gate stacked
@pytest.mark.parametrize("zero_centered", [False, True])
def test_norm_gemv_normed_bf16_router_shapes(n, zero_centered):
    from freetoken_core.kernels.fused_ops import fused_add_rmsnorm

    k = 2048
    x, r = _randn(1, k, dtype=torch.bfloat16, seed=21), _randn(1, k, dtype=torch.bfloat16, seed=22)
    g = 0.1 * _randn(k, dtype=torch.bfloat16, seed=23) + (0 if zero_centered else 1)
    w = _randn(n, k, dtype=torch.bfloat16, seed=24) * 0.02
    logits, normed, h = triton_norm_gemv.norm_gemv_normed(x, r, g, 1e-6, w, zero_centered=zero_centered)
    want_normed, want_h = fused_add_rmsnorm(x.clone(), r.clone(), g, 1e-6, zero_centered=zero_centered)
    torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    torch.testing.assert_close(normed, want_normed, atol=1e-2, rtol=1e-2)  # one bf16 step at most
    assert (normed == want_normed).float().mean() > 0.99
    want_logits, _ = triton_norm_gemv.norm_gemv_reference(x, r, g, 1e-6, w, None, zero_centered=zero_centered)
    torch.testing.assert_close(logits, want_logits, atol=5e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
def test_norm_gemv_routed_equals_router_then_topk(dtype, shared, renormalize):
    """FREETOKEN_ROUTER_TOPK_FUSED's kernel: the post-attention norm, the router GEMV and its top-k in one
    launch (the last program ranks the logits) gives the routes of norm_gemv_normed + topk_softmax exactly,
    and leaves its arrival counter at zero for the next launch."""
    from freetoken_core.kernels import moe_router

    k, experts, top_k = 256, 72, 4  # 72 (+1) router rows: several programs arrive
    n = experts + int(shared)
    x, r = _randn(1, k, dtype=dtype, seed=31), _randn(1, k, dtype=dtype, seed=32)
    g = 1 + 0.1 * _randn(k, dtype=dtype, seed=33)
    w = _randn(n, k, dtype=dtype, seed=34) * (3.0 / k ** 0.5)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    route = triton_norm_gemv.RouterTopK(top_k, renormalize, shared, counter)
    for step in range(2):  # a second launch on the same counter
        weights, ids, normed, h = triton_norm_gemv.norm_gemv_routed(x * (step + 1), r, g, 1e-5, w, route)
        logits, want_normed, want_h = triton_norm_gemv.norm_gemv_normed(x * (step + 1), r, g, 1e-5, w)
        want_w, want_ids = moe_router.topk_softmax(logits, top_k, renormalize, shared)
        assert weights.shape == ids.shape == (1, top_k + int(shared))
        torch.testing.assert_close(ids, want_ids, atol=0, rtol=0)
        torch.testing.assert_close(weights, want_w, atol=0, rtol=0)
        torch.testing.assert_close(normed, want_normed, atol=0, rtol=0)
        torch.testing.assert_close(h, want_h, atol=0, rtol=0)
        assert counter.item() == 0


@needs_cuda
@pytest.mark.parametrize("experts,shared,zero_centered", [(128, False, False), (256, True, True)])
def test_norm_gemv_routed_bf16_router_shapes_in_a_cuda_graph(experts, shared, zero_centered):
    """The real router shapes (Qwen3-30B-A3B: 128 x 2048; Qwen3.6 with its shared gate: 257 x 2048) on the
    compiled kernel, captured once and replayed on new inputs: the routes equal the two-launch path's."""
    from freetoken_core.kernels import moe_router

    k, top_k = 2048, 8
    n = experts + int(shared)
    w = _randn(n, k, dtype=torch.bfloat16, seed=41) * (3.0 / k ** 0.5)
    g = 0.1 * _randn(k, dtype=torch.bfloat16, seed=42) + (0 if zero_centered else 1)
    route = triton_norm_gemv.RouterTopK(top_k, True, shared, torch.zeros(1, dtype=torch.int32, device="cuda"))
    x, r = torch.zeros(1, k, dtype=torch.bfloat16, device="cuda"), torch.zeros(1, k, dtype=torch.bfloat16, device="cuda")
    triton_norm_gemv.norm_gemv_routed(x, r, g, 1e-6, w, route, zero_centered=zero_centered)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, normed, h = triton_norm_gemv.norm_gemv_routed(x, r, g, 1e-6, w, route, zero_centered=zero_centered)
    for seed in (43, 44, 45):
        x.copy_(_randn(1, k, dtype=torch.bfloat16, seed=seed))
        r.copy_(_randn(1, k, dtype=torch.bfloat16, seed=seed + 100))
        graph.replay()
        logits, want_normed, want_h = triton_norm_gemv.norm_gemv_normed(x, r, g, 1e-6, w, zero_centered=zero_centered)
        want_w, want_ids = moe_router.topk_softmax(logits, top_k, True, shared)
        torch.testing.assert_close(ids, want_ids, atol=0, rtol=0)
        torch.testing.assert_close(weights, want_w, atol=0, rtol=0)
        torch.testing.assert_close(normed, want_normed, atol=0, rtol=0)
        torch.testing.assert_close(h, want_h, atol=0, rtol=0)
    assert route.counter.item() == 0


@needs_cuda
def test_moe_block_routes_in_the_router_launch(monkeypatch):
    """SparseMoeBlock.forward_with_norm with FREETOKEN_ROUTER_TOPK_FUSED=1 on one bf16 row equals the
    switch off (the same logits, ranked in the router's launch instead of a top-k launch)."""
    from freetoken_core import env
    from freetoken_core.layers import RMSNorm
    from freetoken_core.layers.moe import SparseMoeBlock

    torch.manual_seed(0)
    norm = RMSNorm(2048, 1e-6, torch.bfloat16).cuda()
    block = SparseMoeBlock(2048, 128, 8, 768, True, torch.bfloat16).cuda()
    for p in block.parameters():
        p.data.normal_(0, 3.0 / 2048 ** 0.5)
    x, r = torch.randn(1, 2048, dtype=torch.bfloat16, device="cuda"), torch.randn(1, 2048, dtype=torch.bfloat16,
                                                                                  device="cuda")
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FREETOKEN_ROUTER_TOPK_FUSED", flag)
        env.kernel_env.cache_clear()
        with torch.no_grad():
            outs[flag] = block.forward_with_norm(norm, x, r)
    env.kernel_env.cache_clear()
    torch.testing.assert_close(outs["1"][0], outs["0"][0], atol=0, rtol=0)
    torch.testing.assert_close(outs["1"][1], outs["0"][1], atol=0, rtol=0)


# --- the gated attention's o_proj: o * sigmoid(gate) applied to the input row (FREETOKEN_ATTN_GATE_GEMV) ---

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("k", [200, 256])  # K not / a multiple of block_k
@pytest.mark.parametrize("bias", [False, True])
def test_gated_gemv_matches_reference(dtype, k, bias):
    n = 72
    x = _randn(1, k, dtype=dtype, seed=21)
    gate = 3.0 * _randn(1, k, dtype=dtype, seed=22)  # sigmoid over its whole range
    w = _randn(n, k, dtype=dtype, seed=23) * 0.1
    b = _randn(n, dtype=dtype, seed=24) if bias else None
    got = gemv(x, w, b, block_n=16, block_k=64, num_warps=4, num_stages=2, gate=gate)
    want = gemv_reference(x, w, b, gate=gate)
    torch.testing.assert_close(want, gemv_reference(x * torch.sigmoid(gate), w, b), atol=0, rtol=0)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("d", [16, 12])  # heads that fill K tiles of 32 evenly / straddle them
def test_gated_gemv_reads_a_strided_gate_in_place(d):
    """The gate as Attention.split_query leaves it: [1, H, D] heads of the [q | gate] rows, 2D apart."""
    heads, k_tile = 5, 32
    rows = _randn(1, heads, 2 * d, dtype=torch.float16, seed=31)
    gate = rows[..., d:]
    x = _randn(1, heads * d, dtype=torch.float16, seed=32)
    w = _randn(40, heads * d, dtype=torch.float16, seed=33) * 0.1
    got = gemv(x, w, block_n=16, block_k=k_tile, gate=gate)
    contiguous = gemv(x, w, block_n=16, block_k=k_tile, gate=gate.reshape(1, -1))
    torch.testing.assert_close(got, contiguous, atol=0, rtol=0)
    torch.testing.assert_close(got, gemv_reference(x, w, gate=gate), atol=2e-2, rtol=1e-2)


def test_gated_gemv_rounds_like_torch_per_element():
    """W = I: each output is one input element, so the transformed row itself is compared. fp16 under the
    interpreter (numpy's exp vs torch's: allow a rare last-place flip); on the GPU the bf16 test is exact."""
    k = 128
    x = _randn(1, k, dtype=torch.float16, seed=41)
    gate = 4.0 * _randn(1, k, dtype=torch.float16, seed=42)
    eye = torch.eye(k, dtype=torch.float16, device=DEV)
    got = gemv(x, eye, block_n=16, block_k=64, gate=gate)
    want = x * torch.sigmoid(gate)
    assert (got != want).float().mean().item() <= 0.02
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_gated_gemv_checks_the_gate():
    x = torch.zeros(1, 32, device=DEV)
    w = torch.zeros(16, 32, device=DEV)
    with pytest.raises(AssertionError, match="does not fit"):
        gemv(x, w, block_n=16, block_k=32, gate=torch.zeros(1, 16, device=DEV))
    with pytest.raises(AssertionError, match="does not fit"):
        gemv(x, w, block_n=16, block_k=32, gate=torch.zeros(1, 32, device=DEV, dtype=torch.float16))


@needs_cuda
@pytest.mark.parametrize("heads,d", [(16, 256), (32, 128)])  # Qwen3.6's o_proj input (4096), a 32 x 128 one
def test_gpu_gated_gemv_bf16_is_the_unfused_path_bit_for_bit(heads, d):
    """bf16 at Qwen3.6's o_proj (2048 x 4096, its measured tile): equal bits to the unfused path (torch's
    sigmoid and multiply, then the same GEMV), and with W = I the gated row itself equals torch's."""
    k = heads * d
    rows = _randn(1, heads, 2 * d, dtype=torch.bfloat16, seed=51) * 4.0
    gate = rows[..., d:]
    o = _randn(1, k, dtype=torch.bfloat16, seed=52)
    w = _randn(2048, k, dtype=torch.bfloat16, seed=53) * 0.02
    unfused = o * torch.sigmoid(gate.reshape(1, -1))
    torch.testing.assert_close(gemv(o, w, gate=gate), gemv(unfused, w), atol=0, rtol=0)
    torch.testing.assert_close(gemv(o, w, gate=gate), gemv_reference(o, w, gate=gate), atol=3e-2, rtol=2e-2)
    # every bf16 gate value in [-64, 64] through the sigmoid and the product (past that sigmoid's tail
    # nears fp32's subnormals, where flush-to-zero choices rather than rounding would be tested)
    sweep = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    sweep = sweep[torch.isfinite(sweep) & (sweep.float().abs() <= 64.0)].cuda()
    eye = torch.eye(k, dtype=torch.bfloat16, device="cuda")
    for start in range(0, sweep.numel(), k):
        g = sweep[start: start + k]
        g = torch.cat([g, g.new_zeros(k - g.numel())]).view(1, k)
        x = _randn(1, k, dtype=torch.bfloat16, seed=start)
        torch.testing.assert_close(gemv(x, eye, gate=g), x * torch.sigmoid(g), atol=0, rtol=0)


@needs_cuda
def test_gpu_gated_gemv_replays_in_a_cuda_graph():
    heads, d = 16, 256
    rows = torch.randn(1, heads, 2 * d, dtype=torch.bfloat16, device="cuda")
    o = torch.randn(1, heads * d, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2048, heads * d, dtype=torch.bfloat16, device="cuda") * 0.02
    gemv(o, w, gate=rows[..., d:])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gemv(o, w, gate=rows[..., d:])
    rows.copy_(torch.randn_like(rows))
    o.copy_(torch.randn_like(o))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, gemv(o * torch.sigmoid(rows[..., d:].reshape(1, -1)), w), atol=0, rtol=0)
