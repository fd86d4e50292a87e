"""The prefix cache of hybrid (gated-delta-net) models: K/V pages in the trie plus linear-state snapshots.

A GDN layer's state at a prefix cannot be rebuilt from pages: it is a snapshot (conv + recurrent state),
copied out of the request's live slot into K/V pages (kvcache/snapshots.py): pages reserved for snapshots
(`reserved_pages`, from `prefix_cache_state_gb`) and any others no request needs. A hybrid match is the longest
prefix that has both its K/V pages and a snapshot. Snapshots are taken
  - at the end of every cached sequence (finish, abort, retraction). The end rarely falls on a page
    boundary, so it is kept as a *tail* of the last full-page node: the partial page (owned by the tail)
    and the snapshot after its last token. A request matching a tail gets a private copy of that page
    (copy on write: pages are never shared partially) and the snapshot;
  - at divergence points: when a request's K/V match reaches deeper than any snapshot on its path (a
    shared system prompt, then different users), its prefill is cut so that one chunk ends exactly at
    the end of the K/V match, and the state there becomes that node's snapshot, so every later request
    with that prefix hits all of it; likewise at every node past its best snapshot where the trie branches;
  - every `interval` tokens (a page multiple) of a long prefill, marked periodic.
A new snapshot takes free pages, else the least recently used bare cached K/V, else displaces only snapshots worth
no more than itself (`Kind`: periodic, then the ends of single sequences, then the points where the trie branches,
which every sequence below them shares). A request short of pages gets them back from snapshots (after the trie's
leaves and the tails): beyond the reserve, snapshots only ever hold pages no request needs, so their pages count
as free. A snapshot is never locked: a request copies it into its own slot at admission and is done with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from ..core import Req
from .linear_state import LinearStatePool, slot_of_row
from .manager import CacheManager
from .pool import KVCache
from .prefix_cache import PageNode, PrefixCache
from .snapshots import SnapshotPool


class Kind(IntEnum):
    """What a snapshot is worth, least first: one displaces only snapshots of its own kind or below."""

    PERIODIC = 0  # every `interval` tokens of a long prefill: a later request may diverge there
    SINGLE = 1  # where one sequence ends (a tail, an end on a page boundary): its next turn resumes there
    SHARED = 2  # where the trie branches: every sequence below it starts there (a shared system prompt)


@dataclass(eq=False)
class Tail:
    """A cached sequence's end inside a page: its tokens past the node, the partial page, the snapshot."""

    node: PageNode
    tokens: tuple[int, ...]
    page: int
    snapshot: int
    last_access: int = 0


class HybridCacheManager(CacheManager):
    def __init__(self, num_pages: int, page_size: int, max_running_req: int, max_seq_len: int,
                 device: torch.device, kv: KVCache, live: LinearStatePool, reserved_snapshots: int,
                 interval: int) -> None:
        super().__init__(num_pages, page_size, max_running_req, max_seq_len, device, PrefixCache(page_size))
        self.kv = kv
        self.snapshots = SnapshotPool(live, kv, self.pool.capacity)
        # pages requests never count on, so that this many snapshots always have room (held or free)
        self.reserved_pages = min(reserved_snapshots, self.snapshots.max_slots) * self.snapshots.pages_per_snapshot
        self.interval = max(page_size, interval // page_size * page_size)  # snapshots sit on page boundaries
        self._holders: dict[int, PageNode] = {}  # snapshot slot -> the node that has it
        self._tails: dict[int, Tail] = {}  # snapshot slot -> the tail that has it
        self._split: dict[int, list[tuple[int, Kind]]] = {}  # row -> (position, kind) to snapshot, ascending
        self._taken: dict[int, list[tuple[int, int, Kind]]] = {}  # row -> (position, slot, kind) taken

    # --- accounting -------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        # a tail's page is never locked, and a snapshot's pages go back whenever a request needs them, but for
        # the reserve
        return super().num_free_pages + len(self._tails) + self.snapshots.pages_in_use - self.reserved_pages

    @property
    def num_total_pages(self) -> int:
        return self.pool.capacity - self.reserved_pages

    @property
    def num_cached_pages(self) -> int:
        return super().num_cached_pages + len(self._tails)

    @property
    def num_cached_snapshots(self) -> int:
        return len(self._holders) + len(self._tails)

    @property
    def num_total_snapshots(self) -> int:
        return self.snapshots.num_slots

    @property
    def num_free_snapshots(self) -> int:
        """Free snapshot slots plus cached ones (never locked: all evictable); running requests' taken ones not.
        Counted from the free list and the holders, so a slot lost from both shows as missing."""
        return self.snapshots.num_free + self.num_cached_snapshots

    def _extra_owned_pages(self) -> list[int]:
        return [t.page for t in self._tails.values()] + self.snapshots.pages_of()

    def _live_slot(self, req: Req) -> int:
        return slot_of_row(req.table_row, self.dummy_row)

    def _alloc(self, n: int) -> list[int]:
        """Pages for a request, freed if need be: the trie's least recently used leaves (with a snapshot they hold),
        then tails (a snapshot and a page for less than a page of prefix), then snapshots on locked or inner nodes,
        lowest kind first, then running requests' snapshots not cached yet."""
        tails: list[Tail] | None = None  # sorted once, if the leaves do not suffice
        while self.pool.num_free < n:
            if self._evict(1):
                continue
            if tails is None:
                tails = sorted(self._tails.values(), key=lambda t: t.last_access, reverse=True)
            if tails:
                self._drop_tail(tails.pop())
                continue
            if not self._drop_any_snapshot():
                break
        return self.pool.alloc(n)

    def _release(self, slots: list[int]) -> None:
        self.pool.free(self.snapshots.give_back(slots))

    def _drop_tail(self, tail: Tail) -> None:
        del self._tails[tail.snapshot]
        del tail.node.tails[tail.tokens]
        self.pool.free([tail.page])
        self._release([tail.snapshot])
        self.prefix._push_leaf(tail.node)  # it may be an evictable leaf now

    def _on_evicted_snapshots(self, slots: list[int]) -> None:
        for s in slots:
            del self._holders[s]
        self._release(slots)

    def drop_unreferenced(self) -> None:
        for tail in list(self._tails.values()):
            self._drop_tail(tail)
        super().drop_unreferenced()

    def _snapshot_slot(self, live_slot: int, kind: Kind) -> int:
        """A snapshot holding the live state, or -1. Its pages come from the free list, else from the least recently
        used cached K/V leaves (not for a periodic one), else a cached snapshot of the lowest kind present, up to
        `kind`, gives way (least recently used first), else a running request's periodic one not cached yet; with
        every snapshot id in use (the pages hold no more) only the last two. With fewer snapshots than conversations,
        plain LRU would evict a shared system prompt's snapshot for each turn's end, which at most one later turn
        uses."""
        if not self.snapshots.num_free and not self._displace_snapshot(kind):
            return -1
        while self.pool.num_free < self.snapshots.pages_per_snapshot:
            if kind > Kind.PERIODIC and self._evict(1):
                continue
            if not self._displace_snapshot(kind):
                return -1
        return self.snapshots.take(live_slot, self.pool.alloc(self.snapshots.pages_per_snapshot))

    @staticmethod
    def _branches(node: PageNode) -> bool:
        """Whether more than one cached sequence continues past this node."""
        return len(node.children) + len(node.tails) > 1

    def _cached_kind(self, node: PageNode) -> Kind:
        """The kind it was taken as, or SHARED where the trie branches now. A shared prompt's snapshot stays SHARED
        when the sequences below it are evicted: under page pressure they are, and the next turn's end would
        displace it."""
        return Kind.SHARED if self._branches(node) else Kind(node.snapshot_kind)

    def _displace_snapshot(self, kind: Kind) -> bool:
        cached: list[tuple[tuple[Kind, int], PageNode | Tail]] = \
            [((self._cached_kind(n), n.last_access), n) for n in self._holders.values()]
        cached += [((Kind.SINGLE, t.last_access), t) for t in self._tails.values()]
        if cached:
            (lowest, _), victim = min(cached, key=lambda c: c[0])
            if lowest <= kind:
                if isinstance(victim, Tail):
                    self._drop_tail(victim)
                else:
                    del self._holders[victim.snapshot]
                    self._release([victim.snapshot])
                    victim.snapshot = -1
                return True
        return kind > Kind.PERIODIC and self._drop_in_flight(Kind.PERIODIC)

    def _drop_in_flight(self, up_to: Kind) -> bool:
        """Drop a snapshot a running request took and has not cached yet, of a kind up to `up_to`."""
        for taken in self._taken.values():
            for i, (_, slot, kind) in enumerate(taken):
                if kind <= up_to:
                    del taken[i]
                    self._release([slot])
                    return True
        return False

    def _drop_any_snapshot(self) -> bool:
        """For a request short of pages: the lowest-kind cached snapshot, else a running request's periodic one, else
        any of theirs."""
        return self._displace_snapshot(Kind.SHARED) or self._drop_in_flight(Kind.SHARED)

    def _hold(self, node: PageNode, slot: int, kind: Kind) -> None:
        node.snapshot, node.snapshot_kind = slot, kind
        self._holders[slot] = node

    # --- admission ----------------------------------------------------------------------------
    def attach_prefix(self, req: Req, max_tokens: int) -> int:
        row = req.table_row
        tokens = req.token_slice(0, max_tokens)
        kv_path = self.prefix.match(tokens).nodes
        # a tail needs a page for its copy (besides itself): without one, the node snapshot before it
        depth, tail = self._best_state(kv_path, tokens, with_tails=self.num_free_pages > 1)
        nodes = kv_path[:depth]
        self.prefix.lock(nodes)
        self._locked[row] = list(nodes)
        pages = [n.page for n in nodes]
        self._set_pages(row, 0, pages)
        self._pages[row].extend(pages)
        matched = depth * self.page_size
        live = self._live_slot(req)
        if tail is not None:
            tail.last_access = next(self.prefix._clock)
            del self._tails[tail.snapshot]  # not evicted for the page it is copied to
            (page,) = self._alloc(1)  # copy on write: the tail's partial page becomes the request's own
            self._tails[tail.snapshot] = tail
            for k, v in zip(self.kv.k, self.kv.v):
                k[page].copy_(k[tail.page])
                v[page].copy_(v[tail.page])
            self._set_pages(row, depth, [page])
            self._pages[row].append(page)
            self.snapshots.restore(tail.snapshot, live)
            matched += len(tail.tokens)
        elif depth:
            self.snapshots.restore(nodes[-1].snapshot, live)
        # where prefill chunks end for a snapshot: every interval; the end of a deeper K/V match (where this request
        # leaves the cached sequences: shared if the trie goes on there, else one sequence's end); and every point
        # past the match where the trie branches (a prefix cached sequences share, such as a system prompt that
        # conversations which all started at once never matched alone)
        ps = self.page_size
        points = {p: Kind.PERIODIC for p in range((matched // self.interval + 1) * self.interval, max_tokens + 1,
                                                  self.interval)}
        if len(kv_path) * ps > matched:
            points[len(kv_path) * ps] = Kind.SHARED if kv_path[-1].children else Kind.SINGLE
        for i, node in enumerate(kv_path[:-1]):
            if (i + 1) * ps > matched and self._branches(node):
                points[(i + 1) * ps] = Kind.SHARED
        self._split[row] = sorted(points.items())
        self._taken[row] = []
        return matched

    def _best_state(self, path: list[PageNode], tokens: list[int], with_tails: bool) -> tuple[int, Tail | None]:
        """The deepest point of the K/V path with a snapshot: (full pages, a tail past them or None)."""
        ps = self.page_size
        for depth in range(len(path), -1, -1):
            node = path[depth - 1] if depth else self.prefix.root
            rest = tokens[depth * ps:(depth + 1) * ps] if with_tails else []
            for n in range(min(len(rest), ps - 1), 0, -1):
                tail = node.tails.get(tuple(rest[:n]))
                if tail is not None:
                    return depth, tail
            if depth and node.snapshot >= 0:
                return depth, None
        return 0, None

    # --- prefill chunks -----------------------------------------------------------------------
    def chunk_limit(self, req: Req) -> int | None:
        """Where the request's next prefill chunk must end for a snapshot (None: anywhere)."""
        for pos, _ in self._split.get(req.table_row, []):
            if pos > req.cached_len:
                return pos
        return None

    def after_chunk(self, req: Req) -> None:
        """After a prefill chunk was launched: snapshot the state if the chunk ended at a split point (the copy
        is queued after the forward)."""
        split = self._split.get(req.table_row)
        while split and split[0][0] <= req.cached_len:
            pos, kind = split.pop(0)
            if pos == req.cached_len:
                slot = self._snapshot_slot(self._live_slot(req), kind)
                if slot >= 0:
                    self._taken[req.table_row].append((pos, slot, kind))

    # --- leaving ------------------------------------------------------------------------------
    def _on_inserted(self, req: Req, path: list[PageNode], pages: list[int], state_at: int) -> int:
        """The snapshots the request took go to their nodes; its end state becomes a node snapshot or a tail. The
        path is locked meanwhile: a snapshot's pages may come from evicting cached leaves, never these."""
        self.prefix.lock(path)
        try:
            return self._snapshot_path(req, path, pages, state_at)
        finally:
            self.prefix.unlock(path)

    def _snapshot_path(self, req: Req, path: list[PageNode], pages: list[int], state_at: int) -> int:
        ps, row = self.page_size, req.table_row
        self._split.pop(row, None)
        for pos, slot, kind in self._taken.pop(row, []):
            node = path[pos // ps - 1] if pos // ps <= len(path) else None
            if node is not None and node.snapshot < 0:
                self._hold(node, slot, kind)
            else:
                self._release([slot])
        if state_at <= 0:
            return -1
        depth = state_at // ps
        if depth > len(path):
            return -1
        node = path[depth - 1] if depth else self.prefix.root
        rest = tuple(req.token_slice(depth * ps, state_at))
        if not rest:  # the end is a page boundary: a node snapshot
            if node.snapshot < 0:
                slot = self._snapshot_slot(self._live_slot(req), Kind.SINGLE)
                if slot >= 0:
                    self._hold(node, slot, Kind.SINGLE)
            return -1
        if rest in node.tails or depth >= len(pages):
            return -1
        slot = self._snapshot_slot(self._live_slot(req), Kind.SINGLE)
        if slot < 0:
            return -1
        tail = Tail(node, rest, pages[depth], slot, next(self.prefix._clock))
        node.tails[rest] = tail
        self._tails[slot] = tail
        return tail.page

    def check(self) -> None:
        super().check()
        held = list(self._holders) + list(self._tails) + [s for t in self._taken.values() for _, s, _ in t]
        assert len(set(held)) == len(held), "a snapshot slot held twice"
        assert len(held) + self.snapshots.num_free == self.snapshots.num_slots, "snapshot slots leaked"
        for slot, node in self._holders.items():
            assert node.snapshot == slot and node.parent is not None
