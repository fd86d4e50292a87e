"""Plain-torch references of `causal_conv1d.py`: the causal depthwise conv1d (+ SiLU) of gated-delta-net
layers over per-request conv states [slots, C, K-1] in a slot pool (transformers' qwen3_next
`causal_conv1d_fn` / `causal_conv1d_update`). The CPU path of the layer; imports nothing but torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r} (silu/swish or None)")


def _conv(xx: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None):
    """xx [..., C, K-1+L] (state then inputs) -> fp32 [..., C, L]: y_p = b + sum_j w_j xx[p + j]."""
    K = weight.shape[-1]
    L = xx.shape[-1] - (K - 1)
    xf, wf = xx.float(), weight.float()
    y = sum(wf[:, j, None] * xf[..., j:j + L] for j in range(K))
    if bias is not None:
        y = y + bias.float()[:, None]
    return _activate(y, activation)


def causal_conv1d_varlen_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
    conv_state_pool: torch.Tensor, slot_ids: torch.Tensor, initial_zero: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv1d (+ activation) over B concatenated sequences. x [T, C];
    weight [C, K]; conv_state_pool [slots, C, K-1] holds each request's last K-1 inputs (zeros
    where initial_zero[i]). Computes in fp32 and rounds once to x's dtype. Writes each request's
    last K-1 inputs back in place; a sequence shorter than K-1 shifts its older state entries left."""
    K = weight.shape[-1]
    y = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    slots = slot_ids.tolist()
    fresh = [False] * len(slots) if initial_zero is None else initial_zero.tolist()
    for i, slot in enumerate(slots):
        s, e = bounds[i], bounds[i + 1]
        prev = conv_state_pool[slot].to(x.dtype)
        if fresh[i]:
            prev = torch.zeros_like(prev)
        xx = torch.cat([prev, x[s:e].t()], dim=-1)  # [C, K-1+L]
        y[s:e] = _conv(xx, weight, bias, activation).t().to(x.dtype)
        conv_state_pool[slot] = xx[:, xx.shape[-1] - (K - 1):].to(conv_state_pool.dtype)
    return y


def conv1d_update_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state_pool: torch.Tensor,
    slot_ids: torch.Tensor, num_rows: torch.Tensor, rows_per_req: int, write_state: bool = True,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Decode / verify conv: x [B*R, C] request-major (R = rows_per_req). Every row's output comes
    from the slot's conv state and the request's earlier rows. With write_state, slot i ends holding
    its last K-1 inputs after num_rows[i] (device int, 0..R) rows; without it the pool is untouched."""
    K, R = weight.shape[-1], rows_per_req
    B, C = slot_ids.shape[0], x.shape[-1]
    prev = conv_state_pool[slot_ids].to(x.dtype)  # [B, C, K-1]
    xx = torch.cat([prev, x.view(B, R, C).transpose(1, 2)], dim=-1)  # [B, C, K-1+R]
    y = _conv(xx, weight, bias, activation).transpose(1, 2).reshape(B * R, C).to(x.dtype)
    if write_state:
        # after n rows the last K-1 inputs are xx[..., n : n+K-1] (n = 0: the old state)
        idx = num_rows.to(torch.long).view(B, 1, 1) + torch.arange(K - 1, device=x.device)
        new = xx.gather(-1, idx.expand(B, C, K - 1))
        conv_state_pool[slot_ids] = new.to(conv_state_pool.dtype)
    return y
