"""Fused mixture-of-experts in Triton: token->expert alignment, grouped GEMM, decode GEMVs (the router's
top-k that feeds them is `moe_router.topk_softmax`).

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
- `fused_moe_decode` (a few tokens): reads only the chosen experts' weights: `moe_gemv_gate_up` (one
  program per route and BLOCK_N act columns) and `moe_gemv_down` (one program per token and BLOCK_N
  output columns of all its k routes, summed in fp32: no [T, k, H] buffer, no third launch; the k routes'
  rows as one tile, or in a loop over the routes: `fused_moe_configs.down_routes`).
  Both take USE_PDL (kernels/pdl.py); the expert ids are activations, so gate/up waits first; down, launched
  right after it, finds them final and loads its first weight tile before its wait.
  (Folding `moe_router.topk_softmax` into the gate/up GEMV, one launch fewer per layer, was tried and measured
  slower on the H200: every program then ranks the logits before its weight loads; RESULTS.md, issue 12.)

Every output is allocated from shapes alone and nothing syncs with the host: CUDA-graph safe. The
grouped grid is sized by the longest possible `sorted_token_ids`; programs past
`num_tokens_post_padded` exit at once. Rounding follows transformers' eager path (gate/up, SiLU,
the product, down, the weighted output: each rounded to the model dtype); accumulation is fp32.
"""

from __future__ import annotations

import torch

# Being in freetoken_core.kernels, this module runs after the package's __init__, which decides
# TRITON_INTERPRET before the first `import triton`.
from .fused_moe_configs import (
    DECODE_MAX_TOKENS, Config, down_config, down_routes, get_config, get_decode_config,
)
from .fused_moe_ref import moe_padded_len
from .pdl import pdl_launch

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .pdl_jit import pdl_wait_then_release  # noqa: E402

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
def _round(v, dtype: tl.constexpr):
    """Round fp32 `v` to the model dtype and back: the rounding points of the eager torch path."""
    return v.to(dtype).to(tl.float32)


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    gate = _round(gate, dtype)
    return _round(gate / (1.0 + tl.exp(-gate)), dtype) * _round(up, dtype)


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
        acc = _silu_mul(acc, acc_up, out_ty)
    if MUL_ROUTED_WEIGHT:  # rounded like torch's `down(act) * weight.to(dtype)`
        w = tl.load(topk_weights_ptr + offs_token, mask=token_ok, other=0.0)
        acc = _round(acc, out_ty) * _round(w, out_ty)[:, None]
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


def _check(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    e, two_i, h = w13.shape
    assert x.dim() == 2 and x.shape[1] == h and x.stride(1) == 1, "x must be [T, H] with contiguous rows"
    assert w2.shape == (e, h, two_i // 2) and w13.dtype == w2.dtype == x.dtype
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need contiguous rows"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0]
    assert topk_ids.is_contiguous() and topk_weights.is_contiguous()


def _sum_routes(y: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    # torch's sum accumulates half precision in fp32 and rounds once
    return y.view(num_tokens, top_k, -1).sum(1) if top_k > 1 else y.view(num_tokens, -1)


def fused_moe_grouped(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, config: Config | None = None) -> torch.Tensor:
    """The prefill / large-batch path: align, gated grouped GEMM, weighted grouped GEMM, sum over k."""
    _check(x, w13, w2, topk_weights, topk_ids)
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


# ------------------------------------------------------------------------------------------ decode GEMVs


@triton.jit
def _gate_up_gemv(x_row, w_ptr, expert, act_ptr, r, I, H, stride_we, stride_wn, stride_ar, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    # act[r, n] = silu(w13[e, n] . x) * (w13[e, I + n] . x) for this program's BLOCK_N columns n
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_gate = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    w_up = w_gate + I * stride_wn
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
        acc += tl.load(w_gate + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * xk[None, :]
        acc_up += tl.load(w_up + offs_k[None, :], mask=mask, other=0.0).to(tl.float32) * xk[None, :]
    out_ty = act_ptr.dtype.element_ty
    act = _silu_mul(tl.sum(acc, axis=1), tl.sum(acc_up, axis=1), out_ty)
    tl.store(act_ptr + r * stride_ar + offs_n, act.to(out_ty), mask=n_ok)


@triton.jit
def _moe_gemv_gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, I, H, stride_xt, stride_we, stride_wn,
                             stride_ar, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    # route r = t * TOP_K + j runs expert e = ids[r] on token t
    r = tl.program_id(0).to(tl.int64)
    if USE_PDL:  # the expert id is an activation: nothing can be prefetched before the wait
        pdl_wait_then_release()
    expert = tl.load(ids_ptr + r).to(tl.int64)
    _gate_up_gemv(x_ptr + (r // TOP_K) * stride_xt, w_ptr, expert, act_ptr, r, I, H, stride_we, stride_wn,
                  stride_ar, BLOCK_N, BLOCK_K, EVEN_K)


@triton.jit
def _down_tiles(a_rows, w_rows, j_ok, rows_ok, k0, I, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The addresses and masks of one BLOCK_K step: act [R, K] and the routes' weight rows [R, N, K]."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:
        a_mask = j_ok[:, None]
        w_mask = rows_ok[:, :, None]
    else:
        a_mask = j_ok[:, None] & (offs_k < I)[None, :]
        w_mask = rows_ok[:, :, None] & (offs_k < I)[None, None, :]
    return a_rows[:, None] + offs_k[None, :], a_mask, w_rows[:, :, None] + offs_k[None, None, :], w_mask


@triton.jit
def _moe_gemv_down_kernel(act_ptr, w_ptr, ids_ptr, topk_weights_ptr, out_ptr, H, I, stride_ar, stride_we,
                          stride_wn, stride_ot, TOP_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                          IDS_BEFORE_WAIT: tl.constexpr):
    # out[t, n] = sum_j round(w2[e_j, n] . act[t * TOP_K + j]) * weight_j. All k routes of token t are one
    # [BLOCK_R, BLOCK_N, BLOCK_K] tile, so their weight rows stream together (a loop over the routes
    # would leave each program one route's rows in flight); the k products are summed in fp32.
    # IDS_BEFORE_WAIT (launched right after the gate/up GEMV of the same routes, which waits for the kernel
    # that wrote the ids before it lets this one start): the ids are final before this kernel's PDL wait, so
    # the first weight tile loads before it, while the gate/up GEMV still streams (H200, Qwen3-30B-A3B batch 1:
    # 2.51 -> 2.46 ms a step). Ids read through L2 (.cg).
    t = tl.program_id(0).to(tl.int64)
    if USE_PDL and not IDS_BEFORE_WAIT:
        pdl_wait_then_release()
    offs_j = tl.arange(0, BLOCK_R)
    j_ok = offs_j < TOP_K
    routes = t * TOP_K + offs_j
    experts = tl.load(ids_ptr + routes, mask=j_ok, other=0, cache_modifier=".cg").to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ok = j_ok[:, None] & (offs_n < H)[None, :]  # [R, N]
    w_rows = w_ptr + experts[:, None] * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [R, N]
    a_rows = act_ptr + routes * stride_ar  # [R]
    acc = tl.zeros((BLOCK_R, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = 0
    if USE_PDL and IDS_BEFORE_WAIT:
        a_ptrs, a_mask, w_ptrs, w_mask = _down_tiles(a_rows, w_rows, j_ok, rows_ok, 0, I, BLOCK_K, EVEN_K)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        pdl_wait_then_release()  # act is the gate/up GEMV's output
        a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * a[:, None, :]
        k_start = BLOCK_K
    for k0 in range(k_start, I, BLOCK_K):
        a_ptrs, a_mask, w_ptrs, w_mask = _down_tiles(a_rows, w_rows, j_ok, rows_ok, k0, I, BLOCK_K, EVEN_K)
        a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)  # [R, K]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc += w.to(tl.float32) * a[:, None, :]
    out_ty = out_ptr.dtype.element_ty
    weights = tl.load(topk_weights_ptr + routes, mask=j_ok, other=0.0)
    y = _round(_round(tl.sum(acc, axis=2), out_ty) * _round(weights, out_ty)[:, None], out_ty)  # [R, N]
    tl.store(out_ptr + t * stride_ot + offs_n, tl.sum(y, axis=0).to(out_ty), mask=offs_n < H)


@triton.jit
def _down_chunk(act_ptr, w_ptr, ids_ptr, t, it, offs_n, n_ok, I, stride_ar, stride_we, stride_wn,
                TOP_K: tl.constexpr, K_CHUNKS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step `it` of the flat (route, K chunk) loop: the route's act chunk [K] and its expert's weight
    rows [N, K] (addresses and masks), and the route index r."""
    r = t * TOP_K + it // K_CHUNKS
    offs_k = (it % K_CHUNKS) * BLOCK_K + tl.arange(0, BLOCK_K)
    expert = tl.load(ids_ptr + r, cache_modifier=".cg").to(tl.int64)
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    k_ok = offs_k < I
    return r, act_ptr + r * stride_ar + offs_k, k_ok, w_ptrs, n_ok[:, None] & k_ok[None, :]


@triton.jit
def _down_accumulate(w, a, part, y, it, r, topk_weights_ptr, out_ty: tl.constexpr, K_CHUNKS: tl.constexpr):
    """Add one chunk's dot products to the route's partial; at the route's last chunk, add
    round(round(partial) * round(weight)) to y (transformers' eager rounding) and restart the partial."""
    part += tl.sum(w.to(tl.float32) * a.to(tl.float32)[None, :], axis=1)
    last = (it % K_CHUNKS) == K_CHUNKS - 1
    weight = _round(tl.load(topk_weights_ptr + r), out_ty)
    y += tl.where(last, _round(_round(part, out_ty) * weight, out_ty), 0.0)
    return tl.where(last, 0.0, part), y


@triton.jit
def _moe_gemv_down_loop_kernel(act_ptr, w_ptr, ids_ptr, topk_weights_ptr, out_ptr, H, I, stride_ar, stride_we,
                               stride_wn, stride_ot, TOP_K: tl.constexpr, K_CHUNKS: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                               IDS_BEFORE_WAIT: tl.constexpr):
    # The route loop (tile "routes": "loop"): as _moe_gemv_down_kernel, but one flat loop over (route j, K chunk)
    # in route order, one weight tile [BLOCK_N, BLOCK_K] at a time, pipelined by Triton: registers do not grow
    # with k. Where k is not a power of two the all-routes tile pads it (k + 1 = 9 with a stacked shared expert:
    # 16 route lanes); there this loop was faster on the H200 (Qwen3.6 batch 1: 2.86 -> 2.66 ms a step).
    # On Qwen3-30B-A3B (k = 8) it was slower (2.46 -> 2.75-3.2 ms): fewer routes' rows in flight at once.
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    out_ty = out_ptr.dtype.element_ty
    part = tl.zeros((BLOCK_N,), dtype=tl.float32)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    start = 0
    if USE_PDL:
        if IDS_BEFORE_WAIT:
            r, a_ptrs, k_ok, w_ptrs, w_mask = _down_chunk(act_ptr, w_ptr, ids_ptr, t, 0, offs_n, n_ok, I, stride_ar,
                                                          stride_we, stride_wn, TOP_K, K_CHUNKS, BLOCK_K)
            w = tl.load(w_ptrs, mask=w_mask, other=0.0)
            pdl_wait_then_release()  # act is the gate/up GEMV's output
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            part, y = _down_accumulate(w, a, part, y, 0, r, topk_weights_ptr, out_ty, K_CHUNKS)
            start = 1
        else:
            pdl_wait_then_release()
    for it in range(start, TOP_K * K_CHUNKS):
        r, a_ptrs, k_ok, w_ptrs, w_mask = _down_chunk(act_ptr, w_ptr, ids_ptr, t, it, offs_n, n_ok, I, stride_ar,
                                                      stride_we, stride_wn, TOP_K, K_CHUNKS, BLOCK_K)
        a = tl.load(a_ptrs, mask=k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        part, y = _down_accumulate(w, a, part, y, it, r, topk_weights_ptr, out_ty, K_CHUNKS)
    tl.store(out_ptr + t * stride_ot + offs_n, y.to(out_ty), mask=n_ok)


def moe_gemv_gate_up(x: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor,
                     config: Config | None = None) -> torch.Tensor:
    """act [T*k, I] = silu(gate) * up of each route's expert, reading only the chosen experts' rows."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    cfg = config or get_decode_config(num_experts, hidden, two_i // 2, x.dtype)["gate_up"]
    act = torch.empty((num_tokens * top_k, two_i // 2), dtype=x.dtype, device=x.device)
    grid = (num_tokens * top_k, triton.cdiv(two_i // 2, cfg["BLOCK_N"]))
    _moe_gemv_gate_up_kernel[grid](
        x, w13, topk_ids, act, two_i // 2, hidden, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], EVEN_K=hidden % cfg["BLOCK_K"] == 0,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(x),
    )
    return act


def moe_gemv_down(act: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  config: Config | None = None, after_gate_up: bool = False) -> torch.Tensor:
    """[T, H] = sum over the k routes of weight * (w2[e] @ act[route]), in one launch. after_gate_up: launched
    right after `moe_gemv_gate_up` of the same ids (nothing in between), so the ids are final before the PDL
    wait and the first weight tile loads early."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    cfg = config or get_decode_config(num_experts, hidden, inter, act.dtype)["down"]
    out = torch.empty((num_tokens, hidden), dtype=act.dtype, device=act.device)
    grid = (num_tokens, triton.cdiv(hidden, cfg["BLOCK_N"]))
    args = (act, w2, topk_ids, topk_weights, out, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
            out.stride(0))
    launch = dict(TOP_K=top_k, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                  IDS_BEFORE_WAIT=after_gate_up, **pdl_launch(act))
    if down_routes(cfg, top_k) == "loop":
        block_k = min(cfg["BLOCK_K"], triton.next_power_of_2(inter))
        _moe_gemv_down_loop_kernel[grid](*args, K_CHUNKS=triton.cdiv(inter, block_k), BLOCK_K=block_k, **launch)
    else:
        _moe_gemv_down_kernel[grid](*args, BLOCK_R=triton.next_power_of_2(top_k), BLOCK_K=cfg["BLOCK_K"],
                                    EVEN_K=inter % cfg["BLOCK_K"] == 0, **launch)
    return out


def fused_moe_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, config: dict[str, Config] | None = None) -> torch.Tensor:
    """The decode path (a few tokens): two GEMV launches that read only the k chosen experts per token.
    config: {"gate_up": ..., "down": ...} as `get_decode_config` returns (None: from the table)."""
    _check(x, w13, w2, topk_weights, topk_ids)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    config = config or get_decode_config(w13.shape[0], w13.shape[2], w2.shape[2], x.dtype)
    act = moe_gemv_gate_up(x, w13, topk_ids, config["gate_up"])
    return moe_gemv_down(act, w2, topk_weights, topk_ids, config["down"], after_gate_up=True)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, config: Config | None = None,
              decode_config: dict[str, Config] | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H]: the MoE experts of `fused_moe_ref`, by the decode path for
    T <= DECODE_MAX_TOKENS and by the grouped GEMM above. `config` (a `get_config` dict) tunes the
    grouped path, `decode_config` (a `get_decode_config` dict) the decode path; None: the table's."""
    if x.shape[0] <= DECODE_MAX_TOKENS:
        return fused_moe_decode(x, w13, w2, topk_weights, topk_ids, config=decode_config)
    return fused_moe_grouped(x, w13, w2, topk_weights, topk_ids, config=config)
