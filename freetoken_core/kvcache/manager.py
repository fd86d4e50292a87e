"""CacheManager: page-table rows and pages per request.

The page table is an int32 [max_running_req + 1, pages_per_row] tensor on the model's device; the
last row is the dummy row (all DUMMY_PAGE) that CUDA-graph padding uses. A CPU mirror answers the
scheduler's questions without device syncs; new entries reach the device in one write per step
(`flush`).

With a `PrefixCache`, a row's first pages may be cached pages it shares (locked nodes, never written:
they are full pages before the request's first uncached token); the rest are its own. Cached pages no
request holds count as free (`num_free_pages`): `allocate` evicts them when the free list runs short.
"""

from __future__ import annotations

import torch

from ..core import Req, to_device
from .pool import DUMMY_PAGE, PagePool
from .prefix_cache import PageNode, PrefixCache


def pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


class CacheManager:
    def __init__(
        self, num_pages: int, page_size: int, max_running_req: int, max_seq_len: int, device: torch.device,
        prefix_cache: PrefixCache | None = None,
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
        self.prefix = prefix_cache
        self._locked: dict[int, list[PageNode]] = {}  # table row -> the cached nodes its first pages are
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
        """Pages an allocation can get: the free list plus cached pages no request holds (evicted on demand)."""
        return self.pool.num_free + (self.prefix.num_unreferenced if self.prefix is not None else 0)

    @property
    def num_cached_pages(self) -> int:
        return self.prefix.num_nodes if self.prefix is not None else 0

    @property
    def num_total_pages(self) -> int:
        return self.pool.capacity

    def assign_row(self, req: Req) -> None:
        assert req.table_row < 0, f"request {req.uid} already has row {req.table_row}"
        if not self._free_rows:
            raise RuntimeError("no free page-table row (max_running_req reached)")
        req.table_row = self._free_rows.pop()
        self._pages[req.table_row] = []
        self._locked[req.table_row] = []

    def attach_prefix(self, req: Req, max_tokens: int) -> int:
        """A newly assigned row takes the longest cached prefix of the request's first `max_tokens` tokens
        (whole pages), locked until the request leaves. Returns the tokens it covers."""
        if self.prefix is None:
            return 0
        row = req.table_row
        assert not self._pages[row], f"request {req.uid} already has pages"
        match = self.prefix.match(req.token_slice(0, max_tokens))
        self.prefix.lock(match.nodes)
        self._locked[row] = list(match.nodes)
        self._set_pages(row, 0, match.pages)
        self._pages[row].extend(match.pages)
        return len(match.nodes) * self.page_size

    def _set_pages(self, row: int, start: int, pages: list[int]) -> None:
        for i, p in enumerate(pages):
            self._table_cpu[row, start + i] = p
            self._dirty[(row, start + i)] = p

    def _alloc(self, n: int) -> list[int]:
        short = n - self.pool.num_free
        if short > 0 and self.prefix is not None:
            self._evict(short)
        return self.pool.alloc(n)

    def _evict(self, num_pages: int) -> int:
        """Evict up to `num_pages` unheld cached pages (least recently used leaves) into the free list; returns how
        many."""
        pages, snapshots = self.prefix.evict(num_pages)
        self.pool.free(pages)
        self._on_evicted_snapshots(snapshots)
        return len(pages)

    def _on_evicted_snapshots(self, slots: list[int]) -> None:
        """Hook for the hybrid cache's snapshot pool (kvcache/hybrid.py)."""
        assert not slots, "snapshot slots without a snapshot pool"

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
        new = self._alloc(n_new)
        self._set_pages(req.table_row, len(pages), new)
        pages.extend(new)

    def rollback_tail(self, req: Req, keep_tokens: int) -> None:
        """Free the pages past the first `keep_tokens` tokens (speculative rows not committed)."""
        pages = self._pages[req.table_row]
        keep = pages_for(keep_tokens, self.page_size)
        if keep < len(self._locked[req.table_row]):
            raise AssertionError(f"request {req.uid}: rollback to {keep_tokens} tokens would free a shared page")
        if keep >= len(pages):
            return
        tail = pages[keep:]
        del pages[keep:]
        self.pool.free(tail)
        for i in range(keep, keep + len(tail)):
            self._table_cpu[req.table_row, i] = DUMMY_PAGE
            self._dirty[(req.table_row, i)] = DUMMY_PAGE

    def free(self, req: Req, cache_tokens: int = 0, state_at: int = -1) -> None:
        """Give back every page and the row of a finished, aborted or retracted request. With a prefix cache,
        the full pages of its first `cache_tokens` tokens (K/V written) are cached instead of freed.
        `state_at`: hybrid models, the position its linear states are at (-1: unknown)."""
        if req.table_row < 0:
            return
        row = req.table_row
        pages = self._pages.pop(row)
        locked = self._locked.pop(row)
        if self.prefix is not None:
            tokens = req.token_slice(0, max(cache_tokens, len(locked) * self.page_size))
            path, duplicates = self.prefix.insert(tokens, pages, len(locked))
            kept = self._on_inserted(req, path, pages, state_at if state_at == cache_tokens else -1)
            self.prefix.unlock(locked)
            self.pool.free(duplicates + [p for p in pages[len(path):] if p != kept])
        else:
            self.pool.free(pages)
        self._table_cpu[row, : len(pages)] = DUMMY_PAGE
        for i in range(len(pages)):
            self._dirty[(row, i)] = DUMMY_PAGE
        self._free_rows.append(row)
        req.table_row = -1

    def chunk_limit(self, req: Req) -> int | None:
        """Where the request's next prefill chunk must end (hybrid models: for a state snapshot); None: anywhere."""
        return None

    def after_chunk(self, req: Req) -> None:
        """After a prefill chunk of `req` was launched (hybrid models snapshot their states here)."""

    def prefix_stats(self) -> dict[str, int]:
        """The EngineStats fields of the prefix cache."""
        if self.prefix is None:
            return {}
        return dict(prefix_query_tokens_total=self.prefix.query_tokens, prefix_hit_tokens_total=self.prefix.hit_tokens,
                    prefix_cached_pages=self.num_cached_pages, prefix_cached_snapshots=self.num_cached_snapshots,
                    prefix_snapshot_slots_total=self.num_total_snapshots,
                    prefix_snapshot_slots_free=self.num_free_snapshots)

    # linear-state snapshots: only hybrid models have them (kvcache/hybrid.py)
    @property
    def num_cached_snapshots(self) -> int:
        return 0

    @property
    def num_total_snapshots(self) -> int:
        return 0

    @property
    def num_free_snapshots(self) -> int:
        return 0

    def count_lookup(self, prompt_tokens: int, hit_tokens: int) -> None:
        if self.prefix is not None:
            self.prefix.query_tokens += prompt_tokens
            self.prefix.hit_tokens += hit_tokens

    def _on_inserted(self, req: Req, path: list[PageNode], pages: list[int], state_at: int) -> int:
        """Hook for the hybrid cache (its states are snapshotted along the path); returns a page of the row
        it keeps (-1: none)."""
        return -1

    def _extra_owned_pages(self) -> list[int]:
        """Pages owned outside the rows and the trie (the hybrid cache's tails)."""
        return []

    def pages_of(self, req: Req) -> list[int]:
        return list(self._pages.get(req.table_row, []))

    def pages_released_by(self, req: Req) -> int:
        """Pages that become allocatable if `req` leaves now: its own, and the shared ones only it holds."""
        row = req.table_row
        if row < 0:
            return 0
        locked = self._locked[row]
        return len(self._pages[row]) - len(locked) + sum(n.ref == 1 for n in locked)

    def drop_unreferenced(self) -> None:
        """Evict every cached page no request holds (after a failed step: what it wrote is suspect)."""
        if self.prefix is not None:
            self._evict(self.prefix.num_unreferenced)

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
        """Every allocated page belongs to exactly one owner (a request row or the prefix cache); a row's
        shared pages are the locked cached nodes it starts with; the CPU mirror matches."""
        self.pool.check()
        cached: dict[int, PageNode] = {}
        if self.prefix is not None:
            self.prefix.check()
            cached = {n.page: n for n in self.prefix.nodes()}
        seen: set[int] = set(cached)
        for p in self._extra_owned_pages():
            assert p not in seen, f"page {p} owned twice"
            seen.add(p)
        refs: dict[int, int] = {}
        for row, pages in self._pages.items():
            locked = self._locked[row]
            assert [n.page for n in locked] == pages[: len(locked)], f"row {row}: shared pages out of order"
            for n in locked:
                assert cached.get(n.page) is n, f"row {row} holds page {n.page} the cache no longer has"
                refs[n.page] = refs.get(n.page, 0) + 1
            for p in pages[len(locked):]:
                assert p not in seen, f"page {p} owned twice"
                seen.add(p)
            assert self._table_cpu[row, : len(pages)].tolist() == pages
        for p, n in cached.items():
            assert n.ref == refs.get(p, 0), f"cached page {p} has ref {n.ref}, {refs.get(p, 0)} rows hold it"
        assert len(seen) == self.pool.capacity - self.pool.num_free
