"""Fused mixture-of-experts in Triton: token->expert alignment and the grouped GEMM here, the decode GEMVs in
`moe_gemv.py` (the router's top-k that feeds them is `moe_router.topk_softmax`).

Layout (shared with `fused_moe_ref.py`, the plain-torch reference of every kernel here):
`w13` [E, 2I, H] each expert's gate rows then up rows (gate first), `w2` [E, H, I], routing
`topk_weights` fp32 [T, k] and `topk_ids` int32 [T, k]. Routes are flattened as r = t * k + j.

- `moe_align_block_size`: groups the flattened routes by expert, each group padded to a multiple of
  the GEMM's BLOCK_SIZE_M (vLLM's semantics): a count kernel and a scatter kernel, one program per
  expert, stable (routes in increasing r within an expert).
- `fused_moe_grouped` (prefill, large batches), vLLM's `fused_moe_kernel` scheme: each program takes one
  BLOCK_SIZE_M block of `sorted_token_ids` (all one expert) and a BLOCK_SIZE_N slice of the output.
  GEMM 1 gathers the token rows of x and multiplies by w13[e]: gate and up tiles together, so
  SiLU(gate) * up is applied in registers and only act [T*k, I] is written. GEMM 2 multiplies act by
  w2[e] and the routed weight into [T, k, H]; a sum over k gives [T, H].
- `fused_moe_decode` (a few tokens, `moe_gemv.py`): two GEMVs that read only the chosen experts' weights.
- `fused_moe` picks one of the two by the token count (`fused_moe_configs.DECODE_MAX_TOKENS`).

Every output is allocated from shapes alone and nothing syncs with the host: CUDA-graph safe. The
grouped grid is sized by the longest possible `sorted_token_ids`; programs past
`num_tokens_post_padded` exit at once. Rounding follows transformers' eager path (gate/up, SiLU,
the product, down, the weighted output: each rounded to the model dtype); accumulation is fp32.
"""

from __future__ import annotations

import torch

# Being in freetoken_core.kernels, this module runs after the package's __init__, which decides
# TRITON_INTERPRET before the first `import triton`.
from .fused_moe_configs import DECODE_MAX_TOKENS, Config, down_config, get_config
from .fused_moe_ref import moe_padded_len

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .jit_util import round_to, silu_mul_rounded  # noqa: E402
from .moe_gemv import check_expert_args, fused_moe_decode  # noqa: E402

# ------------------------------------------------------------------------------------------ alignment


@triton.jit
def _moe_count_kernel(ids_ptr, counts_ptr, numel, BLOCK: tl.constexpr):
    # one program per expert counts its routes; every program reads all T*k ids (L2-resident)
    e = tl.program_id(0)
    count = tl.zeros((), dtype=tl.int32)
    for i0 in range(0, numel, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
        count += tl.sum((ids == e).to(tl.int32), axis=0)
    tl.store(counts_ptr + e, count)


@triton.jit
def _moe_scatter_kernel(ids_ptr, counts_ptr, sorted_ptr, expert_ids_ptr, total_ptr, numel, E, padded_len,
                        block_size, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    # program e: its group's start is the sum of the padded counts of experts < e; it writes its routes
    # in increasing flattened index (a running rank from cumsum), its padding, its blocks' expert id.
    # The last program also fills the unused tail (sentinel ids, expert -1).
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    padded = (counts + block_size - 1) // block_size * block_size
    start = tl.sum(tl.where(offs_e < e, padded, 0), axis=0)
    count = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
    my_padded = tl.sum(tl.where(offs_e == e, padded, 0), axis=0)
    total = tl.sum(padded, axis=0)
    seen = tl.zeros((), dtype=tl.int32)
    for i0 in range(0, numel, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
        hit = (ids == e).to(tl.int32)
        rank = tl.cumsum(hit, axis=0)  # inclusive: the first hit gets 1
        tl.store(sorted_ptr + start + seen + rank - 1, offs, mask=hit != 0)
        seen += tl.sum(hit, axis=0)
    for i0 in range(start + count, start + my_padded, BLOCK):  # fewer than block_size slots
        offs = i0 + tl.arange(0, BLOCK)
        tl.store(sorted_ptr + offs, numel + offs * 0, mask=offs < start + my_padded)
    for b0 in range(start // block_size, (start + my_padded) // block_size, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        tl.store(expert_ids_ptr + offs, e + offs * 0, mask=offs < (start + my_padded) // block_size)
    if e == E - 1:
        tl.store(total_ptr, total)
        for i0 in range(total, padded_len, BLOCK):
            offs = i0 + tl.arange(0, BLOCK)
            tl.store(sorted_ptr + offs, numel + offs * 0, mask=offs < padded_len)
        for b0 in range(total // block_size, padded_len // block_size, BLOCK):
            offs = b0 + tl.arange(0, BLOCK)
            tl.store(expert_ids_ptr + offs, offs * 0 - 1, mask=offs < padded_len // block_size)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) as `moe_align_block_size_ref` returns them
    (same order: stable by flattened index), with two graph-safe launches."""
    assert topk_ids.is_contiguous()
    numel = topk_ids.numel()
    padded_len = moe_padded_len(numel, block_size, num_experts)
    device = topk_ids.device
    sorted_ids = torch.empty((padded_len,), dtype=torch.int32, device=device)
    expert_ids = torch.empty((padded_len // block_size,), dtype=torch.int32, device=device)
    total = torch.zeros((1,), dtype=torch.int32, device=device)
    if numel == 0:  # no launch (an empty grid); the sentinel is 0 here
        return sorted_ids.zero_(), expert_ids.fill_(-1), total
    counts = torch.empty((num_experts,), dtype=torch.int32, device=device)
    block = min(1024, triton.next_power_of_2(numel))
    _moe_count_kernel[(num_experts,)](topk_ids, counts, numel, BLOCK=block, num_warps=4)
    _moe_scatter_kernel[(num_experts,)](
        topk_ids, counts, sorted_ids, expert_ids, total, numel, num_experts, padded_len, block_size,
        BLOCK=block, BLOCK_E=triton.next_power_of_2(num_experts), num_warps=4,
    )
    return sorted_ids, expert_ids, total


# ---------------------------------------------------------------------------------------- grouped GEMM


@triton.jit
def _fused_moe_kernel(a_ptr, b_ptr, c_ptr, topk_weights_ptr, sorted_ids_ptr, expert_ids_ptr, total_ptr,
                      N, K, EM, num_valid, up_offset, stride_am, stride_ak, stride_be, stride_bn, stride_bk,
                      stride_cm, stride_cn, TOP_K: tl.constexpr, GATED: tl.constexpr,
                      MUL_ROUTED_WEIGHT: tl.constexpr, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr,
                      BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr, EVEN_K: tl.constexpr,
                      PRECISION: tl.constexpr):
    # C[r] = A[r // TOP_K] @ B[e].T for the routes r of one expert's block. GATED: B holds gate rows
    # then up rows (up_offset elements apart) and C = silu(gate) * up, N = I columns.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n  # grouped order: GROUP_SIZE_M row blocks share B in L2
    first_pid_m = (pid // num_pid_in_group) * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_SIZE_M >= tl.load(total_ptr):
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_token = tl.load(sorted_ids_ptr + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    token_ok = offs_token < num_valid  # the padding sentinel is num_valid
    # wrap the column index instead of masking B: the extra columns are computed and never stored
    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_token[:, None] // TOP_K) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
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
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            if EVEN_K:
                b_up = tl.load(b_ptrs + up_offset)
            else:
                b_up = tl.load(b_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk
    out_ty = c_ptr.dtype.element_ty
    if GATED:
        acc = silu_mul_rounded(acc, acc_up, out_ty)
    if MUL_ROUTED_WEIGHT:  # rounded like torch's `down(act) * weight.to(dtype)`
        w = tl.load(topk_weights_ptr + offs_token, mask=token_ok, other=0.0)
        acc = round_to(acc, out_ty) * round_to(w, out_ty)[:, None]
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + offs_token[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(out_ty), mask=token_ok[:, None] & (offs_cn[None, :] < N))


def _launch_grouped(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, topk_weights: torch.Tensor,
                    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, gated: bool,
                    config: Config) -> None:
    sorted_ids, expert_ids, total = align
    n = b.shape[1] // 2 if gated else b.shape[1]
    k = b.shape[2]
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    grid = (triton.cdiv(sorted_ids.shape[0], bm) * triton.cdiv(n, bn),)
    _fused_moe_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, total, n, k, sorted_ids.shape[0], topk_weights.numel(),
        n * b.stride(1), a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        TOP_K=top_k, GATED=gated, MUL_ROUTED_WEIGHT=not gated, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=config["GROUP_SIZE_M"], EVEN_K=k % bk == 0,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # fp32 stays exact fp32, never tf32
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


def _sum_routes(y: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    # torch's sum accumulates half precision in fp32 and rounds once
    return y.view(num_tokens, top_k, -1).sum(1) if top_k > 1 else y.view(num_tokens, -1)


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, config: Config | None = None) -> torch.Tensor:
    """The prefill / large-batch path: align, gated grouped GEMM, weighted grouped GEMM, sum over k."""
    check_expert_args(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if num_tokens == 0:
        return torch.empty_like(x)
    config = config or get_config(num_experts, hidden, two_i // 2, num_tokens, x.dtype)
    align = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], num_experts)
    act = torch.empty((num_tokens * top_k, two_i // 2), dtype=x.dtype, device=x.device)
    _launch_grouped(x, w13, act, topk_weights, align, top_k, True, config)
    y = torch.empty((num_tokens * top_k, hidden), dtype=x.dtype, device=x.device)
    _launch_grouped(act, w2, y, topk_weights, align, 1, False, down_config(config))
    return _sum_routes(y, num_tokens, top_k)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, config: Config | None = None,
              decode_config: dict[str, Config] | None = None, shared_last: bool = False) -> torch.Tensor:
    """x [T, H] -> [T, H]: the MoE experts of `fused_moe_ref`, by the decode path for
    T <= DECODE_MAX_TOKENS and by the grouped GEMM above. `config` (a `get_config` dict) tunes the
    grouped path, `decode_config` (a `get_decode_config` dict) the decode path; None: the table's.
    shared_last: every token's last route is the shared expert stacked last (the decode path starts it early)."""
    if x.shape[0] <= DECODE_MAX_TOKENS:
        return fused_moe_decode(x, w13, w2, topk_weights, topk_ids, config=decode_config, shared_last=shared_last)
    return fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, config=config)
