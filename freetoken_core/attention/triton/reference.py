"""Plain-torch references for the Triton kernels of this package (slow, obviously right).

Every kernel's test compares against these. They take the same arguments as the kernels' Python
wrappers and compute in fp32, one request at a time, gathering keys through the page table.
"""

from __future__ import annotations

import torch


def store_kv_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out_loc: torch.Tensor
) -> None:
    """Write k/v [T, Hkv, D] at flat slots `out_loc` [T] of the paged caches [pages, page_size, Hkv, D]."""
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    kf[out_loc.long()] = k.to(kf.dtype)
    vf[out_loc.long()] = v.to(vf.dtype)


def request_slots(page_table: torch.Tensor, row: int, length: int, page_size: int) -> torch.Tensor:
    """Flat cache slots of positions [0, length) of the request in page-table row `row`."""
    pos = torch.arange(length, device=page_table.device)
    return page_table[row, pos // page_size].long() * page_size + pos % page_size


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    table_rows: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """q [T, H, D]: the rows of request i are the `extend_lens[i]` tokens at positions
    prefix_lens[i] + j (requests in order). Each row attends causally to its request's keys
    [0, prefix + j]. Returns [T, H, D] in q's dtype. Decode is extend_lens == [1] * B, speculative
    verify is extend_lens == [rows_per_req] * B."""
    page_size = k_cache.shape[1]
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    num_heads, num_kv_heads = q.shape[1], kf.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for row, prefix, ext in zip(table_rows, prefix_lens, extend_lens):
        seq = prefix + ext
        slots = request_slots(page_table, row, seq, page_size)
        k = kf[slots].float().repeat_interleave(group, dim=1)  # [S, H, D]
        v = vf[slots].float().repeat_interleave(group, dim=1)
        qi = q[start : start + ext].float()  # [E, H, D]
        scores = torch.einsum("ehd,shd->hes", qi, k) * scale
        q_pos = prefix + torch.arange(ext, device=q.device)
        allowed = torch.arange(seq, device=q.device)[None, :] <= q_pos[:, None]  # [E, S]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + ext] = torch.einsum("hes,shd->ehd", probs, v).to(q.dtype)
        start += ext
    return out
