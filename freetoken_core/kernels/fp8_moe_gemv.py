"""The block-FP8 mixture-of-experts decode path: `moe_gemv.py`'s GEMVs that read only the chosen experts' weights,
for FP8 expert stacks. Same launches, grids, tiles (`fused_moe_configs.get_decode_config`), PDL chain and rounding
points; `fp8_moe.fp8_fused_moe` sends T <= DECODE_MAX_TOKENS here.

Layout as `fused_moe.py` (w13 [E, 2I, H] gate rows first, w2 [E, H, I], routes r = t * k + j) in float8_e4m3fn with
block scales s13 [E, ceil(2I/GN), ceil(H/GK)] and s2 [E, ceil(H/GN), ceil(I/GK)] (element (e, n, k) scaled by
s[e, n // GN, k // GK]: the grid of the stacked [2I, H] matrix). BLOCK_N divides GN (and I, where the up rows
start), so a program's rows share one scale row per expert; the scales multiply the activation slice in fp32.
Reference: `fp8_moe_ref.fp8_fused_moe_reference`.
"""

from __future__ import annotations

import torch

# Being in freetoken_core.kernels, this module runs after the package's __init__, which decides
# TRITON_INTERPRET before the first `import triton`.
from .fp8_moe_ref import fp8_fused_moe_reference  # noqa: F401  (the reference, beside its kernels)
from .fp8_ref import DEFAULT_BLOCK
from .fused_moe_configs import Config, down_routes, get_decode_config
from .pdl import pdl_launch

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .fp8_gemv import check_fp8_weight, k_scales, pow2_divisor  # noqa: E402
from .jit_util import round_to, silu_mul_rounded  # noqa: E402
from .moe_gemv import _down_accumulate, _down_chunk, _down_tiles, _route_rows  # noqa: E402
from .pdl_jit import pdl_wait_then_release  # noqa: E402


def check_fp8_expert_args(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, block: tuple[int, int]) -> None:
    """The layouts every FP8 expert kernel (decode and grouped) assumes."""
    e, two_i, h = w13.shape
    check_fp8_weight(w13, s13, block)
    check_fp8_weight(w2, s2, block)
    if w2.shape != (e, h, two_i // 2) or x.dim() != 2 or x.shape[1] != h or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} are not "
                         "[T, H], [E, 2I, H] and [E, H, I]")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"routing {tuple(topk_ids.shape)} / {tuple(topk_weights.shape)} does not fit x {tuple(x.shape)}")
    assert topk_ids.is_contiguous() and topk_weights.is_contiguous()


@triton.jit
def _fp8_gate_up_dots(x_row, w_ptr, s_ptr, expert, I, H, stride_we, stride_wn, stride_se, stride_sn,
                      GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      EVEN_K: tl.constexpr):
    # (w13[e, n] . x, w13[e, I + n] . x) in fp32 for this program's BLOCK_N columns n, each K slice of x scaled
    # by the gate rows' and the up rows' block scales
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_gate = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    w_up = w_gate + I * stride_wn
    s_gate = s_ptr + expert * stride_se + (n0 // GROUP_N) * stride_sn
    s_up = s_ptr + expert * stride_se + ((I + n0) // GROUP_N) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            mask = n_ok[:, None]
            xk = tl.load(x_row + offs_k).to(tl.float32)
        else:
            mask = n_ok[:, None] & (offs_k < H)[None, :]
            xk = tl.load(x_row + offs_k, mask=offs_k < H, other=0.0).to(tl.float32)
        x_gate = xk * k_scales(s_gate, k0, H, GROUP_K, BLOCK_K, EVEN_K)
        x_up = xk * k_scales(s_up, k0, H, GROUP_K, BLOCK_K, EVEN_K)
        acc += tl.load(w_gate + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x_gate[None, :]
        acc_up += tl.load(w_up + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * x_up[None, :]
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)


@triton.jit
def _fp8_moe_gemv_gate_up_kernel(x_ptr, w_ptr, s_ptr, ids_ptr, act_ptr, I, H, stride_xt, stride_we, stride_wn,
                                 stride_se, stride_sn, stride_ar, shared_expert, GROUP_N: tl.constexpr,
                                 GROUP_K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                                 SHARED_LAST: tl.constexpr):
    # moe_gemv._moe_gemv_gate_up_kernel with FP8 experts (SHARED_LAST: the shared expert's routes compute before
    # the PDL wait, as there)
    r = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (r // TOP_K) * stride_xt
    if SHARED_LAST and r % TOP_K == TOP_K - 1:
        gate, up = _fp8_gate_up_dots(x_row, w_ptr, s_ptr, shared_expert.to(tl.int64), I, H, stride_we, stride_wn,
                                     stride_se, stride_sn, GROUP_N, GROUP_K, BLOCK_N, BLOCK_K, EVEN_K)
        if USE_PDL:
            pdl_wait_then_release()
    else:
        if USE_PDL:  # the expert id is an activation: nothing can be prefetched before the wait
            pdl_wait_then_release()
        expert = tl.load(ids_ptr + r).to(tl.int64)
        gate, up = _fp8_gate_up_dots(x_row, w_ptr, s_ptr, expert, I, H, stride_we, stride_wn, stride_se, stride_sn,
                                     GROUP_N, GROUP_K, BLOCK_N, BLOCK_K, EVEN_K)
    out_ty = act_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + r * stride_ar + offs_n, silu_mul_rounded(gate, up, out_ty).to(out_ty), mask=offs_n < I)


@triton.jit
def _route_k_scales(s_rows, j_ok, k0, I, GROUP_K: tl.constexpr, BLOCK_K: tl.constexpr):
    # the block scales of K slice k0 of each route's expert rows: [R, 1] (one block a step) or [R, BLOCK_K]
    if BLOCK_K <= GROUP_K:
        s = tl.load(s_rows + k0 // GROUP_K, mask=j_ok, other=0.0).to(tl.float32)[:, None]
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        s = tl.load(s_rows[:, None] + (offs_k // GROUP_K)[None, :], mask=j_ok[:, None] & (offs_k < I)[None, :],
                    other=0.0).to(tl.float32)
    return s


@triton.jit
def _fp8_moe_gemv_down_kernel(act_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr, out_ptr, H, I, stride_ar, stride_we,
                              stride_wn, stride_se, stride_sn, stride_ot, GROUP_N: tl.constexpr,
                              GROUP_K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                              USE_PDL: tl.constexpr, IDS_BEFORE_WAIT: tl.constexpr):
    # moe_gemv._moe_gemv_down_kernel (all k routes as one [R, N, K] tile) with FP8 experts: each route's act
    # slice is scaled by its expert's block scale
    t = tl.program_id(0).to(tl.int64)
    if USE_PDL and not IDS_BEFORE_WAIT:
        pdl_wait_then_release()
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    routes, j_ok, a_rows, w_rows, rows_ok = _route_rows(act_ptr, w_ptr, ids_ptr, t, offs_n, H, stride_ar, stride_we,
                                                        stride_wn, TOP_K, TOP_K, BLOCK_R)
    experts = tl.load(ids_ptr + routes, mask=j_ok, other=0, cache_modifier=".cg").to(tl.int64)
    s_rows = s_ptr + experts * stride_se + (n0 // GROUP_N) * stride_sn
    acc = tl.zeros((BLOCK_R, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    if USE_PDL and IDS_BEFORE_WAIT:
        a_ptrs, a_mask, w_ptrs, w_mask = _down_tiles(a_rows, w_rows, j_ok, rows_ok, 0, I, BLOCK_K, EVEN_K)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        s = _route_k_scales(s_rows, j_ok, 0, I, GROUP_K, BLOCK_K)
        pdl_wait_then_release()  # act is the gate/up GEMV's output
        a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32) * s
        acc += w.to(tl.float32) * a[:, None, :]
        k_start = BLOCK_K
    for k0 in range(k_start, I, BLOCK_K):
        a_ptrs, a_mask, w_ptrs, w_mask = _down_tiles(a_rows, w_rows, j_ok, rows_ok, k0, I, BLOCK_K, EVEN_K)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32) * _route_k_scales(s_rows, j_ok, k0, I, GROUP_K,
                                                                                       BLOCK_K)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc += w.to(tl.float32) * a[:, None, :]
    out_ty = out_ptr.dtype.element_ty
    weights = tl.load(topk_weights_ptr + routes, mask=j_ok, other=0.0)
    y = round_to(round_to(tl.sum(acc, axis=2), out_ty) * round_to(weights, out_ty)[:, None], out_ty)  # [R, N]
    tl.store(out_ptr + t * stride_ot + offs_n, tl.sum(y, axis=0).to(out_ty), mask=offs_n < H)


@triton.jit
def _fp8_down_chunk(act_ptr, w_ptr, s_ptr, ids_ptr, t, it, offs_n, n_ok, n0, I, stride_ar, stride_we, stride_wn,
                    stride_se, stride_sn, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, TOP_K: tl.constexpr,
                    K_CHUNKS: tl.constexpr, BLOCK_K: tl.constexpr):
    # moe_gemv._down_chunk plus the chunk's block scales (scalar or [BLOCK_K]) of the route's expert
    r, a_ptrs, k_ok, w_ptrs, w_mask = _down_chunk(act_ptr, w_ptr, ids_ptr, t, it, offs_n, n_ok, I, stride_ar,
                                                  stride_we, stride_wn, TOP_K, K_CHUNKS, BLOCK_K)
    expert = tl.load(ids_ptr + r, cache_modifier=".cg").to(tl.int64)
    s_row = s_ptr + expert * stride_se + (n0 // GROUP_N) * stride_sn
    s = k_scales(s_row, (it % K_CHUNKS) * BLOCK_K, I, GROUP_K, BLOCK_K, False)
    return r, a_ptrs, k_ok, w_ptrs, w_mask, s


@triton.jit
def _fp8_moe_gemv_down_loop_kernel(act_ptr, w_ptr, s_ptr, ids_ptr, topk_weights_ptr, out_ptr, H, I, stride_ar,
                                   stride_we, stride_wn, stride_se, stride_sn, stride_ot, GROUP_N: tl.constexpr,
                                   GROUP_K: tl.constexpr, TOP_K: tl.constexpr, K_CHUNKS: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                                   IDS_BEFORE_WAIT: tl.constexpr):
    # moe_gemv._moe_gemv_down_loop_kernel (one flat loop over (route, K chunk)) with FP8 experts; the bf16 tile's
    # "early" (several routes loaded before the PDL wait) is not taken here: the first chunk only
    t = tl.program_id(0).to(tl.int64)
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    out_ty = out_ptr.dtype.element_ty
    part = tl.zeros((BLOCK_N,), dtype=tl.float32)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    start = 0
    if USE_PDL:
        if IDS_BEFORE_WAIT:
            r, a_ptrs, k_ok, w_ptrs, w_mask, s = _fp8_down_chunk(
                act_ptr, w_ptr, s_ptr, ids_ptr, t, 0, offs_n, n_ok, n0, I, stride_ar, stride_we, stride_wn,
                stride_se, stride_sn, GROUP_N, GROUP_K, TOP_K, K_CHUNKS, BLOCK_K)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            pdl_wait_then_release()  # act is the gate/up GEMV's output
            a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32) * s
            part, y = _down_accumulate(w, a, part, y, 0, r, topk_weights_ptr, out_ty, K_CHUNKS)
            start = 1
        else:
            pdl_wait_then_release()
    for it in range(start, TOP_K * K_CHUNKS):
        r, a_ptrs, k_ok, w_ptrs, w_mask, s = _fp8_down_chunk(
            act_ptr, w_ptr, s_ptr, ids_ptr, t, it, offs_n, n_ok, n0, I, stride_ar, stride_we, stride_wn, stride_se,
            stride_sn, GROUP_N, GROUP_K, TOP_K, K_CHUNKS, BLOCK_K)
        a = tl.load(a_ptrs, mask=k_ok, other=0.0).to(tl.float32) * s
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        part, y = _down_accumulate(w, a, part, y, it, r, topk_weights_ptr, out_ty, K_CHUNKS)
    tl.store(out_ptr + t * stride_ot + offs_n, y.to(out_ty), mask=n_ok)


def fp8_moe_gemv_gate_up(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, topk_ids: torch.Tensor,
                         block: tuple[int, int] = DEFAULT_BLOCK, config: Config | None = None,
                         shared_last: bool = False) -> torch.Tensor:
    """`moe_gemv.moe_gemv_gate_up` for FP8 experts: act [T*k, I] = silu(gate) * up of each route's expert."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    cfg = config or get_decode_config(num_experts, hidden, inter, x.dtype)["gate_up"]
    block_n = pow2_divisor(cfg["BLOCK_N"], block[0], inter)
    block_k = cfg["BLOCK_K"] if cfg["BLOCK_K"] > block[1] else pow2_divisor(cfg["BLOCK_K"], block[1])
    act = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    grid = (num_tokens * top_k, triton.cdiv(inter, block_n))
    _fp8_moe_gemv_gate_up_kernel[grid](
        x, w13, s13, topk_ids, act, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), act.stride(0), num_experts - 1, GROUP_N=block[0], GROUP_K=block[1], TOP_K=top_k,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0, SHARED_LAST=shared_last,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(x),
    )
    return act


def fp8_moe_gemv_down(act: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK, config: Config | None = None,
                      after_gate_up: bool = False) -> torch.Tensor:
    """`moe_gemv.moe_gemv_down` for FP8 experts: [T, H] = sum over the k routes of weight * (w2[e] @ act[route])."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    cfg = config or get_decode_config(num_experts, hidden, inter, act.dtype)["down"]
    block_n = pow2_divisor(cfg["BLOCK_N"], block[0])
    out = torch.empty((num_tokens, hidden), dtype=act.dtype, device=act.device)
    grid = (num_tokens, triton.cdiv(hidden, block_n))
    args = (act, w2, s2, topk_ids, topk_weights, out, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
            s2.stride(0), s2.stride(1), out.stride(0))
    launch = dict(GROUP_N=block[0], GROUP_K=block[1], TOP_K=top_k, BLOCK_N=block_n, num_warps=cfg["num_warps"],
                  num_stages=cfg["num_stages"], IDS_BEFORE_WAIT=after_gate_up, **pdl_launch(act))
    if down_routes(cfg, top_k) == "loop":
        block_k = min(cfg["BLOCK_K"], triton.next_power_of_2(inter))
        if block_k < block[1]:
            block_k = pow2_divisor(block_k, block[1])
        _fp8_moe_gemv_down_loop_kernel[grid](*args, K_CHUNKS=triton.cdiv(inter, block_k), BLOCK_K=block_k, **launch)
    else:
        block_k = cfg["BLOCK_K"] if cfg["BLOCK_K"] > block[1] else pow2_divisor(cfg["BLOCK_K"], block[1])
        _fp8_moe_gemv_down_kernel[grid](*args, BLOCK_R=triton.next_power_of_2(top_k), BLOCK_K=block_k,
                                        EVEN_K=inter % block_k == 0, **launch)
    return out


def fp8_fused_moe_decode(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, block: tuple[int, int] = DEFAULT_BLOCK,
                         config: dict[str, Config] | None = None, shared_last: bool = False) -> torch.Tensor:
    """`moe_gemv.fused_moe_decode` for FP8 experts: two GEMV launches that read only the k chosen experts a token."""
    check_fp8_expert_args(x, w13, s13, w2, s2, topk_weights, topk_ids, block)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    config = config or get_decode_config(w13.shape[0], w13.shape[2], w2.shape[2], x.dtype)
    act = fp8_moe_gemv_gate_up(x, w13, s13, topk_ids, block, config["gate_up"], shared_last)
    return fp8_moe_gemv_down(act, w2, s2, topk_weights, topk_ids, block, config["down"], after_gate_up=True)
