"""Linear-state snapshots of the hybrid prefix cache, stored in K/V pages borrowed from the page pool.

A snapshot is a copy of one request's GDN states (every layer's conv and recurrent state). It has no pool of its
own: it occupies `pages_per_snapshot` pages of the K/V cache, taken from the page allocator like a request's pages
and given back when the snapshot is dropped, so memory that no snapshot uses stays K/V pages and running requests
can always reclaim what snapshots hold (kvcache/hybrid.py evicts them when pages run short). A page holds, in
every attention layer's K and V buffers, one piece of `piece_bytes`: a snapshot is packed into a staging buffer
(each state at a 16-byte aligned offset), viewed [2 * attention layers, pages, piece] and scattered, piece row j
into the pages of K/V buffer j; restoring gathers and unpacks. Snapshot ids are bounded by `max_slots` (as many as
the pages hold).
"""

from __future__ import annotations

import torch

from ..core import to_device
from .linear_state import LinearStatePool
from .pool import KVCache

ALIGN = 16  # bytes: every packed state starts at an offset its dtype can be viewed at


def snapshot_bytes(live: LinearStatePool) -> int:
    """Bytes of one packed snapshot: every GDN layer's conv and recurrent state of one slot, aligned."""
    total = 0
    for t in live.conv + live.recurrent:
        total += -(-t[0].numel() * t.element_size() // ALIGN) * ALIGN
    return total


def pages_per_snapshot(live: LinearStatePool, bytes_per_page: int) -> int:
    if bytes_per_page <= 0:
        raise ValueError("a hybrid prefix cache needs K/V pages to hold its snapshots (no attention layer)")
    return -(-snapshot_bytes(live) // bytes_per_page)


def _page_bytes(t: torch.Tensor) -> torch.Tensor:
    """A [num_pages, ...] K/V buffer as [num_pages, bytes of one page of it]."""
    return t.view(torch.uint8).view(t.shape[0], -1)


class SnapshotPool:
    def __init__(self, live: LinearStatePool, kv: KVCache, num_pages: int) -> None:
        """Snapshots of `live`'s states in `kv`'s pages, as many as `num_pages` pages hold."""
        self.live = live
        self._kv_pages = [_page_bytes(t) for t in kv.k + kv.v]
        piece = self._kv_pages[0].shape[1]
        self.pages_per_snapshot = pages_per_snapshot(live, kv.shape.bytes_per_page())
        self.bytes_per_snapshot = self.pages_per_snapshot * kv.shape.bytes_per_page()
        self.max_slots = num_pages // self.pages_per_snapshot
        self._staging = torch.zeros(self.bytes_per_snapshot, dtype=torch.uint8, device=live.device)
        self._pieces = self._staging.view(len(self._kv_pages), self.pages_per_snapshot, piece)
        # (live state buffer, its packed view in the staging buffer)
        self._packed: list[tuple[torch.Tensor, torch.Tensor]] = []
        offset = 0
        for t in live.conv + live.recurrent:
            nbytes = t[0].numel() * t.element_size()
            self._packed.append((t, self._staging[offset:offset + nbytes].view(t.dtype).view(t.shape[1:])))
            offset += -(-nbytes // ALIGN) * ALIGN
        self._free = list(range(self.max_slots - 1, -1, -1))
        self._pages: dict[int, tuple[list[int], torch.Tensor]] = {}  # slot -> (its pages, them as a device index)

    @property
    def num_slots(self) -> int:
        return self.max_slots

    @property
    def num_free(self) -> int:
        """Snapshot ids not in use (their pages come from the page pool)."""
        return len(self._free)

    @property
    def pages_in_use(self) -> int:
        return len(self._pages) * self.pages_per_snapshot

    def pages_of(self) -> list[int]:
        return [p for pages, _ in self._pages.values() for p in pages]

    def take(self, live_slot: int, pages: list[int]) -> int:
        """Copy the live slot's states into `pages` (exactly `pages_per_snapshot` of them); returns the snapshot id."""
        assert len(pages) == self.pages_per_snapshot and self._free
        slot = self._free.pop()
        index = to_device(pages, torch.int64, self.live.device)
        self._pages[slot] = (pages, index)
        for state, packed in self._packed:
            packed.copy_(state[live_slot])
        for kv_pages, pieces in zip(self._kv_pages, self._pieces):
            kv_pages.index_copy_(0, index, pieces)
        return slot

    def restore(self, slot: int, live_slot: int) -> None:
        _, index = self._pages[slot]
        for kv_pages, pieces in zip(self._kv_pages, self._pieces):
            torch.index_select(kv_pages, 0, index, out=pieces)
        for state, packed in self._packed:
            state[live_slot].copy_(packed)

    def give_back(self, slots: list[int]) -> list[int]:
        """Free snapshot ids; returns their pages for the page pool."""
        pages: list[int] = []
        for s in slots:
            assert s in self._pages and s not in self._free, f"snapshot slot {s} freed twice"
            pages += self._pages.pop(s)[0]
            self._free.append(s)
        return pages
