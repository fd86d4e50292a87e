"""RMSNorm fused into a one-row GEMV (batch-1 decode): the decoder layer's input norm with the QKV
projection, the post-attention norm with the MoE router (and its top-k), as one launch each.

Every program of the GEMV reads the whole (small, L2-resident) input row anyway, so it also sums its
squares and scales its dot products by rstd at the end (`_norm_gemv_kernel`). The plain GEMV, its tiles
and the dispatch rule are in `gemv.py`; the references in `gemv_ref.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .fused_ops import rms_scaled
from .gemv import _ROUTER_TILE, _w_tile
from .gemv_ref import norm_gemv_reference  # noqa: F401  (the reference, beside its kernel)
from .moe_router import rank_when_last
from .pdl import pdl_launch
from .pdl_jit import pdl_wait_then_release

# Tiles per weight shape (N, K), as gemv.GEMV_CONFIGS, chosen by `bench_gemv.py --shape ... --fused` sweeps
# (the fused-norm qkv projections of Qwen3-30B-A3B and Qwen3.6).
NORM_GEMV_CONFIGS: dict[tuple[int, int], dict[str, int]] = {
    (5120, 2048): dict(block_n=8, block_k=512, num_warps=4, num_stages=3),
    (9216, 2048): dict(block_n=4, block_k=1024, num_warps=4, num_stages=2),
    # the routers with the post-attention norm fused in (norm_gemv_normed): the plain GEMV's tile
    (128, 2048): _ROUTER_TILE,
    (256, 2048): _ROUTER_TILE,
    (257, 2048): _ROUTER_TILE,
}


def norm_gemv_config(n: int, k: int) -> dict[str, int]:
    # bench_gemv.py --fused on the H200: 16/512/4 warps/2 stages was best for the 8B QKV (and gate_up)
    return NORM_GEMV_CONFIGS.get((n, k)) or dict(block_n=16, block_k=512 if k >= 4096 else 256, num_warps=4,
                                                  num_stages=2)


@triton.jit
def _norm_gemv_tile(k0, x_ptr, r_ptr, g_ptr, h_ptr, w, wu, acc, acc_up, ss, pid, K,
                    NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr, BLOCK_K: tl.constexpr,
                    ZERO_CENTERED: tl.constexpr):
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + offs_k, mask=k_ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # torch's x + residual
        # a masked store, not an `if`: a branch in the loop body stops Triton pipelining the loads
        tl.store(h_ptr + offs_k, x, mask=k_ok & (offs_k * 0 + pid == 0))
    xg = x.to(tl.float32)
    if NORM:
        ss += xg * xg
        g = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if ZERO_CENTERED:  # Qwen3-Next / Qwen3.5 norms: the checkpoint stores w - 1
            g = 1.0 + g
        xg = xg * g
    acc += w.to(tl.float32) * xg[None, :]
    if GATED:
        acc_up += wu.to(tl.float32) * xg[None, :]
    return acc, acc_up, ss


@triton.jit
def _norm_gemv_kernel(x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, y_ptr, h_ptr, n_ptr, route_w_ptr, route_i_ptr, count_ptr,
                      N, K, stride_wn, up_offset, eps,
                      NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                      ZERO_CENTERED: tl.constexpr = False, WRITE_NORMED: tl.constexpr = False,
                      TOP_K: tl.constexpr = 0, RENORMALIZE: tl.constexpr = False, SHARED: tl.constexpr = False,
                      BLOCK_E: tl.constexpr = 1, BLOCK_TK: tl.constexpr = 1):
    # y = W (RMSNorm(x + r) * g) in one pass: every program reads the whole (small, L2-resident) input
    # row anyway, so it also sums its squares and scales its dot products by rstd at the end. Program
    # 0 writes h = x + r (the next residual) to a separate buffer, as the others are still reading r.
    # GATED: W is [gate | up] (up rows start at up_offset) and y = silu(gate) * up.
    # WRITE_NORMED: program 0 also writes RMSNorm(x + r) itself to n_ptr, rounded as the RMSNorm kernel
    # rounds it (fused_ops._rmsnorm_kernel), for the consumers after this one (the MoE router: its experts
    # take the normed row).
    # TOP_K > 0 (the MoE router, FREETOKEN_ROUTER_TOPK_FUSED): y are router logits and the last program to
    # finish ranks them (moe_router.rank_when_last): the routes [1, TOP_K (+1 SHARED)] come out of this launch.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    ss = tl.zeros((BLOCK_K,), dtype=tl.float32)
    k_start = 0
    if USE_PDL:  # as in _gemv_kernel: the first weight tile(s) load before the wait
        w = _w_tile(w_ptr, offs_n, n_ok, 0, K, stride_wn, BLOCK_K, EVEN_K)
        wu = w
        if GATED:
            wu = _w_tile(w_ptr, offs_n + up_offset, n_ok, 0, K, stride_wn, BLOCK_K, EVEN_K)
        pdl_wait_then_release()
        acc, acc_up, ss = _norm_gemv_tile(0, x_ptr, r_ptr, g_ptr, h_ptr, w, wu, acc, acc_up, ss, pid, K,
                                          NORM, HAS_RESIDUAL, GATED, BLOCK_K, ZERO_CENTERED)
        k_start = BLOCK_K
    for k0 in range(k_start, K, BLOCK_K):
        w = _w_tile(w_ptr, offs_n, n_ok, k0, K, stride_wn, BLOCK_K, EVEN_K)
        wu = w
        if GATED:
            wu = _w_tile(w_ptr, offs_n + up_offset, n_ok, k0, K, stride_wn, BLOCK_K, EVEN_K)
        acc, acc_up, ss = _norm_gemv_tile(k0, x_ptr, r_ptr, g_ptr, h_ptr, w, wu, acc, acc_up, ss, pid, K,
                                          NORM, HAS_RESIDUAL, GATED, BLOCK_K, ZERO_CENTERED)
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(ss, axis=0) / K + eps)
    else:
        rstd = 1.0
    if WRITE_NORMED:
        if pid == 0:  # a second pass over the (L2-resident) inputs: x + r is recomputed, not re-read from h
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < K
                x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0)
                if HAS_RESIDUAL:
                    x = (x.to(tl.float32) + tl.load(r_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                         ).to(x_ptr.dtype.element_ty)
                g = tl.load(g_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
                normed = rms_scaled(x.to(tl.float32), rstd, g, x_ptr.dtype.element_ty, ZERO_CENTERED)
                tl.store(n_ptr + offs_k, normed.to(n_ptr.dtype.element_ty), mask=k_ok)
    y = tl.sum(acc, axis=1) * rstd
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if GATED:
        up = tl.sum(acc_up, axis=1) * rstd
        if HAS_BIAS:
            up += tl.load(b_ptr + up_offset + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        # the rounding points of the unfused path: gate and up in the model dtype, then silu(gate)
        gate = y.to(y_ptr.dtype.element_ty).to(tl.float32)
        up = up.to(y_ptr.dtype.element_ty).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32) * up
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=n_ok)
    if TOP_K > 0:
        rank_when_last(y_ptr, count_ptr, route_w_ptr, route_i_ptr, N - SHARED, TOP_K, RENORMALIZE, SHARED, BLOCK_E,
                       BLOCK_TK, TOP_K + SHARED)


def norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
              weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
              block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None, zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: (W RMSNorm(h) [+ b], h) with h = x + residual (x when residual is None), in one launch
    instead of an RMSNorm and a GEMV. gated: W is [gate | up] (2I rows) and the first output is
    silu(gate) * up, [1, I], replacing the SiLU-and-mul kernel as well. norm_weight None: no norm
    (a plain GEMV, with the residual add and gating still fused). zero_centered: the norm scales by
    (1 + norm_weight) (Qwen3-Next / Qwen3.5 RMSNorm)."""
    y, h, _ = _launch_norm_gemv(x, residual, norm_weight, eps, weight, bias, gated, False, block_n, block_k,
                                num_warps, num_stages, zero_centered)
    return y, h


def norm_gemv_normed(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, zero_centered: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row: (W RMSNorm(h), RMSNorm(h), h), h = x + residual, in one launch: the RMSNorm kernel and the
    GEMV of a projection whose input row other layers need as well (the MoE router: the experts take the
    normed row, the next layer the residual)."""
    y, h, normed = _launch_norm_gemv(x, residual, norm_weight, eps, weight, None, False, True, None, None, None,
                                     None, zero_centered)
    assert normed is not None
    return y, normed, h


@dataclass(frozen=True)
class RouterTopK:
    """The MoE router's top-k run in the router GEMV's launch (`norm_gemv_routed`): k, renormalise over
    the k, whether the last weight row is a stacked shared expert's gate (k + 1 routes), and the int32
    arrival counter of that launch (zero between launches; the kernel resets it)."""

    top_k: int
    renormalize: bool
    shared_expert: bool
    counter: torch.Tensor


def norm_gemv_routed(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, route: RouterTopK, zero_centered: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row: (route weights fp32 [1, k(+1)], expert ids int32 [1, k(+1)], RMSNorm(h), h), h = x + residual,
    in one launch: the post-attention RMSNorm, the router GEMV and its top-k softmax
    (`moe_router.topk_softmax` of the GEMV's logits, the same numbers)."""
    n = weight.shape[0]
    num_experts = n - int(route.shared_expert)
    assert 1 <= route.top_k <= num_experts and route.counter.dtype == torch.int32 and route.counter.numel() >= 1
    out_k = route.top_k + int(route.shared_expert)
    weights = torch.empty((1, out_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((1, out_k), dtype=torch.int32, device=x.device)
    _, h, normed = _launch_norm_gemv(x, residual, norm_weight, eps, weight, None, False, True, None, None, None, None,
                                     zero_centered, route=(route, weights, ids, num_experts))
    assert normed is not None
    return weights, ids, normed, h


def _launch_norm_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor | None, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None, gated: bool, write_normed: bool,
                      block_n: int | None, block_k: int | None, num_warps: int | None, num_stages: int | None,
                      zero_centered: bool, route: tuple[RouterTopK, torch.Tensor, torch.Tensor, int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    k = x.shape[1]
    assert x.shape[0] == 1, f"norm_gemv takes one row, got {x.shape[0]}"
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    assert norm_weight is None or norm_weight.shape == (k,)
    assert not write_normed or norm_weight is not None
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    cfg = norm_gemv_config(n, k)
    block_n, block_k = block_n or cfg["block_n"], block_k or cfg["block_k"]
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1
        h = torch.empty_like(x)
    else:
        h = x
    normed = torch.empty_like(x) if write_normed else None
    topk: dict = {}
    route_w = route_i = count = y  # placeholders: the kernel reads them only with TOP_K > 0
    if route is not None:
        spec, route_w, route_i, num_experts = route
        count = spec.counter
        topk = dict(TOP_K=spec.top_k, RENORMALIZE=spec.renormalize, SHARED=spec.shared_expert,
                    BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_TK=triton.next_power_of_2(spec.top_k))
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if norm_weight is not None else x, weight,
        bias if bias is not None else weight, y, h, normed if normed is not None else y, route_w, route_i, count,
        n, k, weight.stride(0), n, float(eps), NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, GATED=gated, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        ZERO_CENTERED=zero_centered, WRITE_NORMED=write_normed, num_warps=num_warps or cfg["num_warps"],
        num_stages=num_stages or cfg["num_stages"], **topk, **pdl_launch(x),
    )
    return y, h, normed
