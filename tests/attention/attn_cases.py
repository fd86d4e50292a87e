"""Random paged-cache problems shared by the attention tests (CPU interpreter and GPU)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    k_cache: torch.Tensor  # [pages, page_size, Hkv, D], random everywhere (the "cached prefix")
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B + 1, pages_per_row] int32 (last row: dummy, all page 0)
    table_rows: list[int]  # request i lives in row table_rows[i] (rows are shuffled)
    prefix_lens: list[int]
    extend_lens: list[int]
    q: torch.Tensor  # [T, H, D] new rows, request after request
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    out_loc: torch.Tensor  # [T] int64 flat slots of the new rows

    def ints(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=self.q.device)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    @property
    def q_starts(self) -> list[int]:
        out, acc = [], 0
        for e in self.extend_lens:
            out.append(acc)
            acc += e
        return out


def make_case(
    prefix_lens: list[int], extend_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    page_size: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
) -> PagedCase:
    g = torch.Generator().manual_seed(seed)
    seqs = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages_per_row = max((s + page_size - 1) // page_size for s in seqs) + 1
    need = sum((s + page_size - 1) // page_size for s in seqs)
    num_pages = need + 3
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 stays the dummy page
    batch = len(seqs)
    rows = torch.randperm(batch, generator=g).tolist()
    table = torch.zeros(batch + 1, pages_per_row, dtype=torch.int32)
    for i, s in enumerate(seqs):
        for j in range((s + page_size - 1) // page_size):
            table[rows[i], j] = perm.pop()
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    total = sum(extend_lens)
    q = torch.randn(total, num_heads, head_dim, generator=g).to(dtype)
    k_new = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    v_new = torch.randn(total, num_kv_heads, head_dim, generator=g).to(dtype)
    loc = []
    for i, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        for pos in range(p, p + e):
            loc.append(int(table[rows[i], pos // page_size]) * page_size + pos % page_size)
    dev = torch.device(device)
    return PagedCase(
        k_cache.to(dev), v_cache.to(dev), table.to(dev), rows, list(prefix_lens), list(extend_lens),
        q.to(dev), k_new.to(dev), v_new.to(dev), torch.tensor(loc, dtype=torch.int64, device=dev),
    )


def manager_batch(mgr, phase: str, reqs: list, extend_lens: list[int], rows_per_req: int, device):
    """A Batch of `reqs` extending by `extend_lens` rows: pages allocated by the CacheManager `mgr`,
    out_loc its slots of the new rows, positions after each request's cached prefix (the backend tests'
    rigs: test_triton_backend.Pair, test_fused_kv_store.Rig)."""
    from freetoken_core.core import Batch

    prefix = [r.cached_len for r in reqs]
    for r, p, e in zip(reqs, prefix, extend_lens):
        mgr.allocate(r, p + e)
    mgr.flush()
    out_loc = [s for r, p, e in zip(reqs, prefix, extend_lens) for s in mgr.slots(r, p, p + e)]
    t = sum(extend_lens)
    return Batch(
        phase=phase, reqs=reqs, extend_lens=extend_lens, prefix_lens=prefix,
        input_ids=torch.zeros(t, dtype=torch.int64, device=device),
        positions=torch.tensor([p + i for p, e in zip(prefix, extend_lens) for i in range(e)], device=device),
        out_loc=torch.tensor(out_loc, dtype=torch.int64, device=device),
        sample_rows=torch.zeros(0, dtype=torch.int64, device=device), sample_reqs=[], rows_per_req=rows_per_req,
    )
