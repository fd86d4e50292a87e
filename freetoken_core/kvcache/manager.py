"""CacheManager: page-table rows and pages per request.

The page table is an int32 [max_running_req + 1, pages_per_row] tensor on the model's device; the
last row is the dummy row (all DUMMY_PAGE) that CUDA-graph padding uses. A CPU mirror answers the
scheduler's questions without device syncs; new entries reach the device in one write per step
(`flush`).
"""

from __future__ import annotations

import torch

from ..core import Req, to_device
from .pool import DUMMY_PAGE, PagePool


def pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


class CacheManager:
    def __init__(
        self, num_pages: int, page_size: int, max_running_req: int, max_seq_len: int, device: torch.device
    ) -> None:
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.pool = PagePool(num_pages)
        self.pages_per_row = pages_for(max_seq_len, page_size)
        self.dummy_row = max_running_req
        self.page_table = torch.full(
            (max_running_req + 1, self.pages_per_row), DUMMY_PAGE, dtype=torch.int32, device=device
        )
        self._table_cpu = torch.full_like(self.page_table, DUMMY_PAGE, device="cpu")
        self._free_rows: list[int] = list(range(max_running_req - 1, -1, -1))
        self._pages: dict[int, list[int]] = {}  # table row -> its pages in order
        # (row, index) -> page, not yet on the device. A dict, not a list: one step may set the same
        # entry twice (rollback then re-allocate, free then a new request in the row), and a CUDA
        # index_put with duplicate indices keeps an arbitrary one of them, not the last.
        self._dirty: dict[tuple[int, int], int] = {}

    # --- rows -------------------------------------------------------------------------------
    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    @property
    def num_free_pages(self) -> int:
        return self.pool.num_free

    @property
    def num_total_pages(self) -> int:
        return self.pool.capacity

    def assign_row(self, req: Req) -> None:
        assert req.table_row < 0, f"request {req.uid} already has row {req.table_row}"
        if not self._free_rows:
            raise RuntimeError("no free page-table row (max_running_req reached)")
        req.table_row = self._free_rows.pop()
        self._pages[req.table_row] = []

    # --- pages ------------------------------------------------------------------------------
    def pages_needed(self, req: Req, num_tokens: int) -> int:
        """Extra pages `req` needs so that `num_tokens` tokens of it fit."""
        have = len(self._pages.get(req.table_row, [])) if req.table_row >= 0 else 0
        return max(0, pages_for(num_tokens, self.page_size) - have)

    def pages_needed_total(self, reqs: list[Req], lengths: list[int]) -> int:
        """sum(pages_needed(r, n)) over a batch in one pass (the decode planner asks every step)."""
        ps, pages = self.page_size, self._pages
        total = 0
        for r, n in zip(reqs, lengths):
            short = (n + ps - 1) // ps - len(pages[r.table_row])
            if short > 0:
                total += short
        return total

    def allocate(self, req: Req, num_tokens: int) -> None:
        """Make sure the request's pages cover its first `num_tokens` tokens."""
        if num_tokens > self.pages_per_row * self.page_size:
            raise ValueError(f"request {req.uid} needs {num_tokens} tokens, over max_seq_len {self.max_seq_len}")
        pages = self._pages[req.table_row]
        n_new = pages_for(num_tokens, self.page_size) - len(pages)
        if n_new <= 0:
            return
        new = self.pool.alloc(n_new)
        start = len(pages)
        pages.extend(new)
        for i, p in enumerate(new):
            self._table_cpu[req.table_row, start + i] = p
            self._dirty[(req.table_row, start + i)] = p

    def rollback_tail(self, req: Req, keep_tokens: int) -> None:
        """Free the pages past the first `keep_tokens` tokens (speculative rows not committed)."""
        pages = self._pages[req.table_row]
        keep = pages_for(keep_tokens, self.page_size)
        if keep >= len(pages):
            return
        tail = pages[keep:]
        del pages[keep:]
        self.pool.free(tail)
        for i in range(keep, keep + len(tail)):
            self._table_cpu[req.table_row, i] = DUMMY_PAGE
            self._dirty[(req.table_row, i)] = DUMMY_PAGE

    def free(self, req: Req) -> None:
        """Give back every page and the row of a finished or aborted request."""
        if req.table_row < 0:
            return
        row = req.table_row
        pages = self._pages.pop(row)
        self.pool.free(pages)
        self._table_cpu[row, : len(pages)] = DUMMY_PAGE
        for i in range(len(pages)):
            self._dirty[(row, i)] = DUMMY_PAGE
        self._free_rows.append(row)
        req.table_row = -1

    def pages_of(self, req: Req) -> list[int]:
        return list(self._pages.get(req.table_row, []))

    # --- slots ------------------------------------------------------------------------------
    def slots(self, req: Req, start: int, end: int) -> list[int]:
        """Flat cache slots of positions [start, end) of a request (pages must be allocated)."""
        ps = self.page_size
        pages = self._pages[req.table_row]
        return [pages[p // ps] * ps + p % ps for p in range(start, end)]

    def slot(self, req: Req, pos: int) -> int:
        """Flat cache slot of one position of a request (its page must be allocated)."""
        ps = self.page_size
        return self._pages[req.table_row][pos // ps] * ps + pos % ps

    def flush(self) -> None:
        """Write this step's page-table changes to the device table in one operation."""
        if not self._dirty:
            return
        (rows, cols), vals = zip(*self._dirty.keys()), list(self._dirty.values())
        self._dirty.clear()
        dev = self.page_table.device
        idx = to_device([rows, cols], torch.int64, dev)
        self.page_table[idx[0], idx[1]] = to_device(vals, torch.int32, dev)

    def check(self) -> None:
        """Every allocated page belongs to exactly one request row; the CPU mirror matches."""
        self.pool.check()
        seen: set[int] = set()
        for row, pages in self._pages.items():
            for p in pages:
                assert p not in seen, f"page {p} owned twice"
                seen.add(p)
            assert self._table_cpu[row, : len(pages)].tolist() == pages
        assert len(seen) == self.pool.capacity - self.pool.num_free
