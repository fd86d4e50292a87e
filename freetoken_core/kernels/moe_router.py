"""The MoE router's top-k in Triton, beside its reference (`fused_moe_ref.topk_softmax_ref`,
`topk_softmax_shared_ref`).

`topk_softmax`: one program per token row: fp32 softmax over the E logits, then k rounds of argmax
(lowest id on exact ties; torch.topk orders them in no promised way), optional renormalisation over
the k chosen. With `shared_expert` the logits carry one more column, a shared expert's gate, and the
row's routes end with that expert (id E, weight sigmoid(gate)): the layout of a shared expert stacked
after the routed ones (models/qwen3_next.py). The output feeds `fused_moe.fused_moe` (same routing
layout); allocated from shapes alone, no host sync: CUDA-graph safe.
"""

from __future__ import annotations

import torch

# Being in freetoken_core.kernels, this module runs after the package's __init__, which decides
# TRITON_INTERPRET before the first `import triton`.
from .pdl import pdl_launch

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from .pdl_jit import pdl_wait_then_release  # noqa: E402

# ---------------------------------------------------------------------------------------------- router


@triton.jit
def _router_probs(logits_ptr, row, E, stride_l, BLOCK_E: tl.constexpr, CACHE: tl.constexpr):
    """fp32 softmax of one row of router logits; the padding lanes hold -inf, so they never win.
    CACHE ".cg": read through L2 only (logits other programs of this launch wrote); "" the default.
    (No default values on jit helpers: Triton 3.6 passes a str default through unwrapped and fails to compile.)"""
    offs_e = tl.arange(0, BLOCK_E)
    e_ok = offs_e < E
    logits = tl.load(logits_ptr + row * stride_l + offs_e, mask=e_ok, other=float("-inf"),
                     cache_modifier=CACHE).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, axis=0))
    return tl.where(e_ok, p / tl.sum(p, axis=0), float("-inf"))


@triton.jit
def _topk_rounds(probs, num_rounds, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """The first `num_rounds` of top-k: round j puts the largest probability left (the lowest id on
    exact ties) in lane j of (weights, ids); the other lanes hold 0."""
    offs_e = tl.arange(0, BLOCK_E)
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in range(num_rounds):
        best, idx = tl.max(probs, axis=0, return_indices=True, return_indices_tie_break_left=True)
        top_w = tl.where(offs_k == j, best, top_w)
        top_i = tl.where(offs_k == j, idx, top_i)
        probs = tl.where(offs_e == idx, float("-inf"), probs)
    return top_w, top_i


@triton.jit
def _store_routing(weights_ptr, ids_ptr, row, top_w, top_i, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                   BLOCK_K: tl.constexpr, OUT_K: tl.constexpr):
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=0)  # the lanes past TOP_K hold 0
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < TOP_K
    tl.store(weights_ptr + row * OUT_K + offs_k, top_w, mask=k_ok)
    tl.store(ids_ptr + row * OUT_K + offs_k, top_i, mask=k_ok)


@triton.jit
def _store_shared_route(logits_ptr, weights_ptr, ids_ptr, row, E, stride_l, TOP_K: tl.constexpr, OUT_K: tl.constexpr,
                        CACHE: tl.constexpr):
    # route k: the shared expert (stacked as expert E), weighted by sigmoid of its gate logit
    gate = tl.load(logits_ptr + row * stride_l + E, cache_modifier=CACHE).to(tl.float32)
    tl.store(weights_ptr + row * OUT_K + TOP_K, 1.0 / (1.0 + tl.exp(-gate)))
    tl.store(ids_ptr + row * OUT_K + TOP_K, E.to(tl.int32))


@triton.jit
def rank_when_last(logits_ptr, count_ptr, weights_ptr, ids_ptr, E, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                   SHARED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, OUT_K: tl.constexpr):
    """The epilogue of a one-row router GEMV (kernels/norm_gemv.py, FREETOKEN_ROUTER_TOPK_FUSED): each program
    has stored its logits; the last one to arrive ranks the whole row (one launch fewer than a top-k
    kernel after the GEMV). The barrier orders every thread's logit stores before the program's
    arrival, the acq_rel atomic publishes them to (and acquires the others' for) the last program,
    which reads them through L2 and resets the counter for the next launch (a CUDA graph replays it)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        probs = _router_probs(logits_ptr, 0, E, 0, BLOCK_E, ".cg")
        top_w, top_i = _topk_rounds(probs, TOP_K, BLOCK_E, BLOCK_K)
        _store_routing(weights_ptr, ids_ptr, 0, top_w, top_i, TOP_K, RENORMALIZE, BLOCK_K, OUT_K)
        if SHARED:
            _store_shared_route(logits_ptr, weights_ptr, ids_ptr, 0, E, 0, TOP_K, OUT_K, ".cg")


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride_l, TOP_K: tl.constexpr,
                         RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                         SHARED: tl.constexpr, OUT_K: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    if USE_PDL:
        pdl_wait_then_release()
    probs = _router_probs(logits_ptr, row, E, stride_l, BLOCK_E, "")
    top_w, top_i = _topk_rounds(probs, TOP_K, BLOCK_E, BLOCK_K)
    _store_routing(weights_ptr, ids_ptr, row, top_w, top_i, TOP_K, RENORMALIZE, BLOCK_K, OUT_K)
    if SHARED:
        _store_shared_route(logits_ptr, weights_ptr, ids_ptr, row, E, stride_l, TOP_K, OUT_K, "")


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 shared_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights fp32 [T, k], ids int32 [T, k]); see `topk_softmax_ref`.
    shared_expert: the logits are [T, E + 1], the last column the shared expert's gate, and the routing
    [T, k + 1] ends with it (`topk_softmax_shared_ref`): one launch for the router's top-k and the gate."""
    num_tokens, width = router_logits.shape
    num_experts = width - int(shared_expert)
    assert 1 <= top_k <= num_experts and router_logits.stride(1) == 1
    out_k = top_k + int(shared_expert)  # routes per token: the top-k, then the shared expert's
    weights = torch.empty((num_tokens, out_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, out_k), dtype=torch.int32, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    _topk_softmax_kernel[(num_tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
        RENORMALIZE=renormalize, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        SHARED=bool(shared_expert), OUT_K=out_k, num_warps=4 if block_e >= 512 else 1, **pdl_launch(router_logits),
    )
    return weights, ids
