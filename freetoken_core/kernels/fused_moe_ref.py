"""Plain-torch mixture-of-experts: the CPU path of the MoE layer and the reference of every kernel
in `fused_moe.py` and `moe_gemv.py` (no Triton import: CPU users never load it).

Layout conventions, shared with the kernels:
- `w13` [E, 2I, H]: each expert's gate and up projections stacked along the rows, gate first
  (rows [0, I) gate, rows [I, 2I) up), exactly transformers 5's fused `experts.gate_up_proj`.
- `w2` [E, H, I]: each expert's down projection (transformers' `experts.down_proj`).
- Routing: `topk_weights` fp32 [T, k], `topk_ids` int32 [T, k], sorted by weight, largest first.

The math is transformers' Qwen3-MoE (`Qwen3MoeTopKRouter` + the eager `Qwen3MoeExperts` loop), down to
the order of the floating-point operations, so that fp32 results are bit-for-bit the same given the
same stacked weights (tests/kernels/test_fused_moe.py checks this against transformers itself).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def topk_softmax_ref(router_logits: torch.Tensor, top_k: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (any float dtype) -> (weights fp32 [T, k], expert ids int32 [T, k]).

    Softmax in fp32 over all experts, top-k of the probabilities (sorted, largest first; torch.topk
    orders exact ties in no promised way: the kernels take the lower id), renormalised over the k
    chosen when `renormalize` (Qwen3's `norm_topk_prob`). The weights stay fp32: the experts cast them to the hidden dtype
    where transformers does, so fp32 is the exact common ground for both paths.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def topk_softmax_shared_ref(router_logits: torch.Tensor, top_k: int,
                            renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [T, E + 1] whose last column is the shared expert's gate -> routing [T, k + 1]: the top-k
    of the first E columns (`topk_softmax_ref`), then expert E (the shared expert, stacked after the
    routed ones) with weight sigmoid(gate logit) in fp32. The experts' weighted sum over the k + 1
    routes is then `routed(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)`."""
    num_experts = router_logits.shape[-1] - 1
    weights, ids = topk_softmax_ref(router_logits[..., :num_experts], top_k, renormalize)
    shared_w = torch.sigmoid(router_logits[..., num_experts:].float())
    shared_id = torch.full_like(ids[..., :1], num_experts)
    return torch.cat([weights, shared_w], dim=-1), torch.cat([ids, shared_id], dim=-1)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], routing [T, k] -> sum_j w_j * down_e(silu(gate x) * up x),
    [T, H] in x's dtype.

    Loops over the experts that were hit, in increasing id, and accumulates each expert's weighted
    output with `index_add_` into zeros: transformers' eager loop, whose summation order (expert 0
    first) we keep so fp32 matches it exactly. Inside one expert the rows come in (route, token) order
    as `torch.where` on its [k, T] mask yields them, again as transformers does; a token never picks
    one expert twice, so `index_add_` never adds two rows into one within an expert.
    """
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    weights = topk_weights.to(x.dtype)  # transformers' router casts the weights back to the hidden dtype
    ids_t = topk_ids.t()  # [k, T]
    for e in torch.unique(topk_ids).tolist():  # sorted: experts in increasing id, only those hit
        route, token = torch.where(ids_t == e)
        h = F.linear(x[token], w13[e])  # [n, 2I]
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(act, w2[e]) * weights[token, route, None]
        out.index_add_(0, token, y)
    return out


def moe_padded_len(num_routes: int, block_size: int, num_experts: int) -> int:
    """The length of `sorted_token_ids` for `num_routes` = T * k (token, route) pairs: every route plus
    each non-empty expert's padding (< block_size), rounded up to a whole block. At most
    min(T * k, E) experts are non-empty, which bounds the padding far below E * (block_size - 1) for
    small batches (and so the grouped GEMM's grid). Depends on shapes alone: CUDA-graph safe."""
    padded = num_routes + min(num_routes, num_experts) * (block_size - 1)
    return -(-padded // block_size) * block_size


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_size: int,
                             num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the flattened (token, route) indices by expert, for the grouped GEMM (vLLM's semantics).

    Returns
    - `sorted_token_ids` int32 [P], P = `moe_padded_len(T * k, block_size, E)`: expert 0's flattened
      indices t * k + j in increasing order, padded with the sentinel T * k to a multiple of
      `block_size`, then expert 1's, ...; entries past `num_tokens_post_padded` hold the sentinel too.
    - `expert_ids` int32 [P // block_size]: the expert of each block of `sorted_token_ids`; blocks past
      `num_tokens_post_padded` hold -1 (the kernels exit before reading them).
    - `num_tokens_post_padded` int32 [1]: the used length (sum of the padded group sizes).
    An expert with no routes gets no block. Ids must lie in [0, num_experts).
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_routes = flat.numel()
    padded_len = moe_padded_len(num_routes, block_size, num_experts)
    device = topk_ids.device
    counts = torch.bincount(flat, minlength=num_experts)
    padded_counts = (counts + block_size - 1) // block_size * block_size
    starts = torch.cumsum(padded_counts, 0) - padded_counts  # each group's first slot
    order = torch.argsort(flat, stable=True)  # flattened indices grouped by expert, stable
    group_first = torch.cumsum(counts, 0) - counts  # the first position of each expert in `order`
    experts = flat[order]
    slots = starts[experts] + torch.arange(num_routes, device=device) - group_first[experts]
    sorted_ids = torch.full((padded_len,), num_routes, dtype=torch.int32, device=device)
    sorted_ids[slots] = order.to(torch.int32)
    total = padded_counts.sum()
    block_starts = torch.arange(0, padded_len, block_size, device=device)
    block_expert = torch.searchsorted(torch.cumsum(padded_counts, 0), block_starts, right=True)
    expert_ids = torch.where(block_starts < total, block_expert, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.reshape(1).to(torch.int32)
