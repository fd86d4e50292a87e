"""Block-FP8 fused mixture-of-experts: `fused_moe.py`'s grouped GEMM for FP8 expert stacks (prefill, large batches)
and the dispatch between it and the decode GEMVs of `fp8_moe_gemv.py`.

Layout and alignment as `fused_moe.py` (`moe_align_block_size`, w13 [E, 2I, H] gate first, w2 [E, H, I]); the
stacks are float8_e4m3fn with block scales s13 [E, ceil(2I/GN), ceil(H/GK)], s2 [E, ceil(H/GN), ceil(I/GK)]
(fp8_moe_gemv.py). Each program multiplies one BLOCK_SIZE_M block of one expert's routes by a BLOCK_SIZE_N slice of
that expert's rows; BLOCK_SIZE_K divides GK and BLOCK_SIZE_N divides GN (and I, where the up rows start), so every
K step of a program meets one scale per weight tile, applied once to the step's fp32 product. Two modes:
- w8a8 (bf16 / fp16 activations): x and the SiLU-and-mul output are quantized per token and GK group
  (`fp8_gemm.per_token_group_quant_fp8`, two more launches) and `tl.dot` runs on FP8 operands, scaled by the
  token's and the block's scales: faster than weight-only at 64 tokens and 1.7x at 8,192 (`bench_fp8.py --tiles`);
- weight-only (fp32 activations, the reference math): the FP8 tile converts exactly to the activations' dtype.
Nothing syncs with the host: CUDA-graph safe. References: `fp8_moe_ref.py`.
"""

from __future__ import annotations

import torch

from .fp8_moe_ref import fp8_fused_moe_reference, fp8_fused_moe_w8a8_reference  # noqa: F401  (beside the kernels)
from .fp8_ref import DEFAULT_BLOCK
from .fused_moe_configs import DECODE_MAX_TOKENS, Config, down_config, fp8_grouped_config, get_config

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .fp8_gemm import grouped_pid, per_token_group_quant_fp8, quantizes_activations  # noqa: E402
from .fp8_gemv import pow2_divisor  # noqa: E402
from .fp8_moe_gemv import check_fp8_expert_args, fp8_fused_moe_decode  # noqa: E402
from .fused_moe import _sum_routes, moe_align_block_size  # noqa: E402
from .jit_util import round_to, silu_mul_rounded  # noqa: E402


@triton.jit
def _scaled_dot(a, b, a_s, b_s, acc, A_FP8: tl.constexpr, PRECISION: tl.constexpr):
    # acc + (a @ b) * scales: FP8 x FP8 on the tensor cores (A_FP8, a_s [M] the tokens' scales), or b converted
    # exactly to a's dtype
    if A_FP8:
        acc += tl.dot(a, b) * (a_s[:, None] * b_s)
    else:
        acc += tl.dot(a, b.to(a.dtype), input_precision=PRECISION) * b_s
    return acc


@triton.jit
def _fp8_fused_moe_kernel(a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr,
                          total_ptr, N, K, EM, num_valid, up_rows, stride_am, stride_asm, stride_be, stride_bn,
                          stride_bse, stride_bsn, stride_cm, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr,
                          TOP_K: tl.constexpr, GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr,
                          A_FP8: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                          BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr, EVEN_K: tl.constexpr,
                          PRECISION: tl.constexpr):
    # fused_moe._fused_moe_kernel with an FP8 B: C[r] = A[r // TOP_K] @ B[e].T for the routes r of one expert's
    # block. GATED: B's up rows start at row up_rows (= N, I columns out) and C = silu(gate) * up
    pid_m, pid_n = grouped_pid(tl.program_id(0), tl.cdiv(EM, BLOCK_SIZE_M), tl.cdiv(N, BLOCK_SIZE_N), GROUP_SIZE_M)
    if pid_m * BLOCK_SIZE_M >= tl.load(total_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_token = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    token_ok = offs_token < num_valid  # the padding sentinel is num_valid
    a_rows = offs_token // TOP_K
    n0 = pid_n * BLOCK_SIZE_N
    offs_bn = (n0 + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N  # wrapped columns: computed, never stored
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] + offs_bn[None, :] * stride_bn  # [K, N], K contiguous
    s_gate = b_s_ptr + expert * stride_bse + (n0 // GROUP_N) * stride_bsn
    s_up = b_s_ptr + expert * stride_bse + ((up_rows + n0) // GROUP_N) * stride_bsn
    a_s_rows = a_s_ptr + a_rows * stride_asm
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_SIZE_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=token_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=token_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        a_s = 1.0
        if A_FP8:
            a_s = tl.load(a_s_rows + k0 // GROUP_K, mask=token_ok, other=0.0)
        acc = _scaled_dot(a, b, a_s, tl.load(s_gate + k0 // GROUP_K).to(tl.float32), acc, A_FP8, PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(b_ptrs + up_rows * stride_bn)
            else:
                b_up = tl.load(b_ptrs + up_rows * stride_bn, mask=k_ok[:, None], other=0.0)
            acc_up = _scaled_dot(a, b_up, a_s, tl.load(s_up + k0 // GROUP_K).to(tl.float32), acc_up, A_FP8,
                                 PRECISION)
        a_ptrs += BLOCK_SIZE_K
        b_ptrs += BLOCK_SIZE_K
    out_ty = c_ptr.dtype.element_ty
    if GATED:
        acc = silu_mul_rounded(acc, acc_up, out_ty)
    if MUL_ROUTED_WEIGHT:  # rounded like torch's `down(act) * weight.to(dtype)`
        w = tl.load(topk_weights_ptr + offs_token, mask=token_ok, other=0.0)
        acc = round_to(acc, out_ty) * round_to(w, out_ty)[:, None]
    offs_cn = n0 + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_cn[None, :]
    tl.store(c_ptrs, acc.to(out_ty), mask=token_ok[:, None] & (offs_cn[None, :] < N))


def _fit_tile(config: Config, block: tuple[int, int], up_rows: int) -> Config:
    """The config's tile with BLOCK_SIZE_N / BLOCK_SIZE_K fitted into the scale block (and the up rows' start)."""
    cfg = dict(config)
    cfg["BLOCK_SIZE_N"] = pow2_divisor(cfg["BLOCK_SIZE_N"], block[0], *([up_rows] if up_rows else []))
    cfg["BLOCK_SIZE_K"] = pow2_divisor(cfg["BLOCK_SIZE_K"], block[1])
    if min(cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]) < 16:
        raise ValueError(f"FP8 expert tile {cfg} is under tl.dot's 16 (scale block {block}, up rows at {up_rows})")
    return cfg


def _launch_fp8_grouped(a: torch.Tensor, a_scale: torch.Tensor | None, b: torch.Tensor, b_scale: torch.Tensor,
                        c: torch.Tensor, topk_weights: torch.Tensor,
                        align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, gated: bool,
                        block: tuple[int, int], config: Config) -> None:
    sorted_ids, expert_ids, total = align
    n = b.shape[1] // 2 if gated else b.shape[1]
    k = b.shape[2]
    cfg = _fit_tile(config, block, n if gated else 0)
    bm, bn, bk = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    grid = (triton.cdiv(sorted_ids.shape[0], bm) * triton.cdiv(n, bn),)
    _fp8_fused_moe_kernel[grid](
        a, a_scale if a_scale is not None else b_scale, b, b_scale, c, topk_weights, sorted_ids, expert_ids, total,
        n, k, sorted_ids.shape[0], topk_weights.numel(), n, a.stride(0),
        a_scale.stride(0) if a_scale is not None else 0, b.stride(0), b.stride(1), b_scale.stride(0),
        b_scale.stride(1), c.stride(0), GROUP_N=block[0], GROUP_K=block[1], TOP_K=top_k, GATED=gated,
        MUL_ROUTED_WEIGHT=not gated, A_FP8=a_scale is not None, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=cfg["GROUP_SIZE_M"], EVEN_K=k % bk == 0,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def fp8_fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                          block: tuple[int, int] = DEFAULT_BLOCK, config: Config | None = None,
                          w8a8: bool | None = None) -> torch.Tensor:
    """`fused_moe.fused_moe_grouped` for FP8 experts: align, gated grouped GEMM, weighted grouped GEMM, sum over k.
    w8a8 (default: for bf16 / fp16 x): activations quantized per token group before each GEMM
    (`fp8_fused_moe_w8a8_reference`), else weight-only (`fp8_fused_moe_reference`)."""
    check_fp8_expert_args(x, w13, s13, w2, s2, topk_weights, topk_ids, block)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    if w8a8 is None:
        w8a8 = quantizes_activations(x.dtype)
    if config is None:
        config = (fp8_grouped_config(num_tokens) if w8a8
                  else get_config(num_experts, hidden, two_i // 2, num_tokens, x.dtype))
    align = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], num_experts)
    a, a_scale = per_token_group_quant_fp8(x, block[1]) if w8a8 else (x, None)
    act = torch.empty((num_tokens * top_k, two_i // 2), dtype=x.dtype, device=x.device)
    _launch_fp8_grouped(a, a_scale, w13, s13, act, topk_weights, align, top_k, True, block, config)
    a, a_scale = per_token_group_quant_fp8(act, block[1]) if w8a8 else (act, None)
    y = torch.empty((num_tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    _launch_fp8_grouped(a, a_scale, w2, s2, y, topk_weights, align, 1, False, block, down_config(config))
    return _sum_routes(y, num_tokens, top_k)


def fp8_fused_moe(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, block: tuple[int, int] = DEFAULT_BLOCK,
                  config: Config | None = None, decode_config: dict[str, Config] | None = None,
                  shared_last: bool = False, w8a8: bool | None = None) -> torch.Tensor:
    """`fused_moe.fused_moe` for FP8 experts: x [T, H] -> [T, H] by the decode GEMVs for T <= DECODE_MAX_TOKENS
    (weight-only), else by the grouped GEMM (w8a8 for 16-bit x unless told, `fp8_fused_moe_grouped`)."""
    if x.shape[0] <= DECODE_MAX_TOKENS:
        return fp8_fused_moe_decode(x, w13, s13, w2, s2, topk_weights, topk_ids, block=block, config=decode_config,
                                    shared_last=shared_last)
    return fp8_fused_moe_grouped(x, w13, s13, w2, s2, topk_weights, topk_ids, block=block, config=config, w8a8=w8a8)
