"""The mixture-of-experts decode path in Triton: GEMVs that read only the chosen experts' weights, for a few
tokens (`fused_moe.fused_moe` sends T <= DECODE_MAX_TOKENS here, more to its grouped GEMM). Layout as
`fused_moe.py` (w13 [E, 2I, H] gate first, w2 [E, H, I], routes r = t * k + j); references in `fused_moe_ref.py`.

- `moe_gemv_gate_up`: one program per route and BLOCK_N act columns, act = SiLU(gate) * up.
- `moe_gemv_down`: one program per token and BLOCK_N output columns of all its k routes, summed in fp32 (no
  [T, k, H] buffer, no third launch); the k routes' rows as one tile, or in a loop over the routes
  (`fused_moe_configs.down_routes`); the loop may load its first routes as one tile before the PDL wait (the
  tile's "early").
Both take USE_PDL (kernels/pdl.py); the expert ids are activations, so gate/up waits first; down, launched right
after it, finds them final and loads its first weight tile before its wait. (Folding `moe_router.topk_softmax`
into the gate/up GEMV, one launch fewer per layer, was tried and measured slower on the H200: every program then
ranks the logits before its weight loads; RESULTS.md, issue 12.)

Outputs are allocated from shapes alone, nothing syncs with the host: CUDA-graph safe. Rounding follows
transformers' eager path (each of gate/up, SiLU, the product, down and the weighted output rounded to the model
dtype); accumulation is fp32.
"""

from __future__ import annotations

import torch

# Being in freetoken_core.kernels, this module runs after the package's __init__, which decides
# TRITON_INTERPRET before the first `import triton`.
from .fused_moe_configs import Config, down_routes, get_decode_config
from .pdl import pdl_launch

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .jit_util import round_to, silu_mul_rounded  # noqa: E402
from .pdl_jit import pdl_wait_then_release  # noqa: E402


def check_expert_args(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> None:
    """The layouts every fused-MoE kernel (decode and grouped) assumes."""
    e, two_i, h = w13.shape
    assert x.dim() == 2 and x.shape[1] == h and x.stride(1) == 1, "x must be [T, H] with contiguous rows"
    assert w2.shape == (e, h, two_i // 2) and w13.dtype == w2.dtype == x.dtype
    assert w13.stride(2) == 1 and w2.stride(2) == 1, "expert weights need contiguous rows"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0]
    assert topk_ids.is_contiguous() and topk_weights.is_contiguous()


@triton.jit
def _gate_up_dots(x_row, w_ptr, expert, I, H, stride_we, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVEN_K: tl.constexpr):
    # (w13[e, n] . x, w13[e, I + n] . x) in fp32 for this program's BLOCK_N columns n
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
    return tl.sum(acc, axis=1), tl.sum(acc_up, axis=1)


@triton.jit
def _moe_gemv_gate_up_kernel(x_ptr, w_ptr, ids_ptr, act_ptr, I, H, stride_xt, stride_we, stride_wn,
                             stride_ar, shared_expert, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_PDL: tl.constexpr,
                             SHARED_LAST: tl.constexpr):
    # act[r, n] = silu(w13[e, n] . x) * (w13[e, I + n] . x) for route r = t * TOP_K + j, expert e = ids[r]
    r = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (r // TOP_K) * stride_xt
    if SHARED_LAST and r % TOP_K == TOP_K - 1:
        # A token's last route is a stacked shared expert (SHARED_LAST): its expert is known without the ids,
        # and x (the normed hidden state, written by the router's launch, two kernels back) is final when this
        # kernel starts (the top-k, the one kernel still running, writes only the routes). So these programs
        # compute their whole dot products before the PDL wait, while the top-k runs (Qwen3.6: a ninth of the
        # expert weights); they store after it (act's memory may be a block the top-k still reads).
        gate, up = _gate_up_dots(x_row, w_ptr, shared_expert.to(tl.int64), I, H, stride_we, stride_wn, BLOCK_N,
                                 BLOCK_K, EVEN_K)
        if USE_PDL:
            pdl_wait_then_release()
    else:
        if USE_PDL:  # the expert id is an activation: nothing can be prefetched before the wait
            pdl_wait_then_release()
        expert = tl.load(ids_ptr + r).to(tl.int64)
        gate, up = _gate_up_dots(x_row, w_ptr, expert, I, H, stride_we, stride_wn, BLOCK_N, BLOCK_K, EVEN_K)
    out_ty = act_ptr.dtype.element_ty
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + r * stride_ar + offs_n, silu_mul_rounded(gate, up, out_ty).to(out_ty), mask=offs_n < I)


@triton.jit
def _route_rows(act_ptr, w_ptr, ids_ptr, t, offs_n, H, stride_ar, stride_we, stride_wn, TOP_K: tl.constexpr,
                COUNT: tl.constexpr, BLOCK_R: tl.constexpr):
    """Token t's first COUNT routes (BLOCK_R lanes): their route ids, lane mask, act rows [R] and the [R, N] rows
    of their experts' down weights (ids read through L2, .cg), with the [R, N] mask."""
    offs_j = tl.arange(0, BLOCK_R)
    j_ok = offs_j < COUNT
    routes = t * TOP_K + offs_j
    experts = tl.load(ids_ptr + routes, mask=j_ok, other=0, cache_modifier=".cg").to(tl.int64)
    rows_ok = j_ok[:, None] & (offs_n < H)[None, :]
    w_rows = w_ptr + experts[:, None] * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    return routes, j_ok, act_ptr + routes * stride_ar, w_rows, rows_ok


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
    # the first weight tile loads before it, while the gate/up GEMV still streams. Ids read through L2 (.cg).
    t = tl.program_id(0).to(tl.int64)
    if USE_PDL and not IDS_BEFORE_WAIT:
        pdl_wait_then_release()
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    routes, j_ok, a_rows, w_rows, rows_ok = _route_rows(act_ptr, w_ptr, ids_ptr, t, offs_n, H, stride_ar, stride_we,
                                                        stride_wn, TOP_K, TOP_K, BLOCK_R)
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
    y = round_to(round_to(tl.sum(acc, axis=2), out_ty) * round_to(weights, out_ty)[:, None], out_ty)  # [R, N]
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
    weight = round_to(tl.load(topk_weights_ptr + r), out_ty)
    y += tl.where(last, round_to(round_to(part, out_ty) * weight, out_ty), 0.0)
    return tl.where(last, 0.0, part), y


@triton.jit
def _moe_gemv_down_loop_kernel(act_ptr, w_ptr, ids_ptr, topk_weights_ptr, out_ptr, H, I, stride_ar, stride_we,
                               stride_wn, stride_ot, TOP_K: tl.constexpr, K_CHUNKS: tl.constexpr,
                               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                               IDS_BEFORE_WAIT: tl.constexpr, EARLY: tl.constexpr = 1, EARLY_P: tl.constexpr = 1):
    # The route loop (tile "routes": "loop"): as _moe_gemv_down_kernel, but one flat loop over (route j, K chunk)
    # in route order, one weight tile [BLOCK_N, BLOCK_K] at a time, pipelined by Triton: registers do not grow
    # with k. Where k is not a power of two the all-routes tile pads it (k + 1 = 9 with a stacked shared expert:
    # 16 route lanes); there this loop was faster (Qwen3.6), at k = 8 slower (fewer routes' rows in flight).
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    out_ty = out_ptr.dtype.element_ty
    part = tl.zeros((BLOCK_N,), dtype=tl.float32)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    start = 0
    if EARLY > 1:
        # The tile's "early" (K_CHUNKS = 1: a loop step is a whole route): the first EARLY routes' weight rows as
        # one [EARLY, N, K] tile, loaded before the PDL wait when the ids are final (IDS_BEFORE_WAIT), so more of
        # this program's weights stream while the gate/up GEMV ends; their products are added to y in route order.
        if USE_PDL and not IDS_BEFORE_WAIT:
            pdl_wait_then_release()
        routes, e_ok, a_rows, w_rows, rows_ok = _route_rows(act_ptr, w_ptr, ids_ptr, t, offs_n, H, stride_ar,
                                                            stride_we, stride_wn, TOP_K, EARLY, EARLY_P)
        a_ptrs_e, a_mask_e, w_ptrs_e, w_mask_e = _down_tiles(a_rows, w_rows, e_ok, rows_ok, 0, I, BLOCK_K, False)
        w_e = tl.load(w_ptrs_e, mask=w_mask_e, other=0.0)
        if USE_PDL and IDS_BEFORE_WAIT:
            pdl_wait_then_release()  # act is the gate/up GEMV's output
        a_e = tl.load(a_ptrs_e, mask=a_mask_e, other=0.0)
        dots = round_to(tl.sum(w_e.to(tl.float32) * a_e.to(tl.float32)[:, None, :], axis=2), out_ty)  # [E, N]
        weights = round_to(tl.load(topk_weights_ptr + routes, mask=e_ok, other=0.0), out_ty)
        contrib = round_to(dots * weights[:, None], out_ty)
        lanes = tl.arange(0, EARLY_P)
        for e in tl.static_range(EARLY):
            y += tl.sum(tl.where(lanes[:, None] == e, contrib, 0.0), axis=0)
        start = EARLY
    elif USE_PDL:
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
                     config: Config | None = None, shared_last: bool = False) -> torch.Tensor:
    """act [T*k, I] = silu(gate) * up of each route's expert, reading only the chosen experts' rows.
    shared_last: every token's last route is the shared expert stacked last in w13 (expert E - 1; the routing
    of `moe_router.topk_softmax(shared_expert=True)`), so those routes start before the ids are final."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    cfg = config or get_decode_config(num_experts, hidden, two_i // 2, x.dtype)["gate_up"]
    act = torch.empty((num_tokens * top_k, two_i // 2), dtype=x.dtype, device=x.device)
    grid = (num_tokens * top_k, triton.cdiv(two_i // 2, cfg["BLOCK_N"]))
    _moe_gemv_gate_up_kernel[grid](
        x, w13, topk_ids, act, two_i // 2, hidden, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        num_experts - 1, TOP_K=top_k, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        EVEN_K=hidden % cfg["BLOCK_K"] == 0, SHARED_LAST=shared_last, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"], **pdl_launch(x),
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
        k_chunks = triton.cdiv(inter, block_k)
        early = min(cfg.get("early", 1), top_k)
        if early > 1 and k_chunks != 1:
            raise ValueError(f"down tile early={early} needs BLOCK_K >= the intermediate size {inter} "
                             "(one chunk a route)")
        _moe_gemv_down_loop_kernel[grid](*args, K_CHUNKS=k_chunks, BLOCK_K=block_k, EARLY=early,
                                         EARLY_P=triton.next_power_of_2(early), **launch)
    else:
        _moe_gemv_down_kernel[grid](*args, BLOCK_R=triton.next_power_of_2(top_k), BLOCK_K=cfg["BLOCK_K"],
                                    EVEN_K=inter % cfg["BLOCK_K"] == 0, **launch)
    return out


def fused_moe_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, config: dict[str, Config] | None = None,
                     shared_last: bool = False) -> torch.Tensor:
    """The decode path (a few tokens): two GEMV launches that read only the k chosen experts per token.
    config: {"gate_up": ..., "down": ...} as `get_decode_config` returns (None: from the table).
    shared_last: see `moe_gemv_gate_up`."""
    check_expert_args(x, w13, w2, topk_weights, topk_ids)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    config = config or get_decode_config(w13.shape[0], w13.shape[2], w2.shape[2], x.dtype)
    act = moe_gemv_gate_up(x, w13, topk_ids, config["gate_up"], shared_last)
    return moe_gemv_down(act, w2, topk_weights, topk_ids, config["down"], after_gate_up=True)
