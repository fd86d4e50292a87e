"""Paged KV storage and the page allocator.

Layout (per layer): k and v are [num_pages, page_size, num_kv_heads, head_dim] (flashinfer's NHD
paged layout). A token at position p of the request in page-table row r lives in page
`page_table[r, p // page_size]`, slot `p % page_size`; its flat slot index is
`page * page_size + p % page_size` into `k.view(-1, num_kv_heads, head_dim)`.

Page 0 is never handed out: CUDA-graph padding rows write their K/V there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DUMMY_PAGE = 0


@dataclass
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def bytes_per_page(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem


class KVCache:
    """The K/V buffers of every layer."""

    def __init__(self, shape: KVCacheShape, num_pages: int, device: torch.device) -> None:
        if num_pages < 2:
            raise ValueError(f"KV cache needs at least 2 pages (one is the dummy page), got {num_pages}")
        self.shape = shape
        self.num_pages = num_pages
        self.page_size = shape.page_size
        self.device = device
        dims = (num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(dims, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]

    def flat(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_pages * page_size, num_kv_heads, head_dim] views for slot-indexed reads and writes."""
        k, v = self.k[layer_id], self.v[layer_id]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def store(self, layer_id: int, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        kf, vf = self.flat(layer_id)
        kf.index_copy_(0, out_loc, k.to(kf.dtype))
        vf.index_copy_(0, out_loc, v.to(vf.dtype))


class PagePool:
    """Free list of page ids with an explicit allocated bitmap: a double hand-out or double free
    is a bug and raises at once instead of corrupting another request's cache."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, DUMMY_PAGE, -1))  # pop() gives low ids first
        self._allocated = [False] * num_pages
        self._allocated[DUMMY_PAGE] = True

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        """Pages that requests can use (all but the dummy page)."""
        return self.num_pages - 1

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache out of pages: need {n}, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            if self._allocated[p]:
                raise AssertionError(f"page {p} handed out twice")
            self._allocated[p] = True
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p == DUMMY_PAGE or not self._allocated[p]:
                raise AssertionError(f"page {p} freed but not allocated")
            self._allocated[p] = False
            self._free.append(p)

    def check(self) -> None:
        """Consistency: free list and bitmap agree, no duplicates."""
        assert len(set(self._free)) == len(self._free), "duplicate page in free list"
        for p in self._free:
            assert not self._allocated[p], f"page {p} both free and allocated"
        assert sum(self._allocated) == self.num_pages - len(self._free)
