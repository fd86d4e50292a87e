"""The prefix cache: a trie of full K/V pages over token ids, with reference counts and LRU eviction.

A node is one full page: its key is the page's `page_size` token ids, its parent the page before it, so
a path from the root spells a token prefix in whole pages (a radix tree whose edges are pages, the shape
vLLM's hash chain and SGLang's paged radix tree share; here the dict keys are the exact token tuples, so
there are no hash collisions to verify). Only full pages are cached: a partial last page is never shared,
so a request never writes a page another one reads.

A request that takes a cached prefix locks every node of its path (`ref` + 1 each); since a lock covers
the whole path, a node with `ref == 0` has no locked descendant, and unlocked leaves are evicted least
recently used first when the page pool runs short. Hybrid (gated-delta-net) models also keep, on some
nodes, a snapshot of the linear states after that node's last token (`snapshot`, a slot of the
`SnapshotPool`); a hybrid match ends at the deepest node that has one.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field


@dataclass(eq=False)
class PageNode:
    page: int
    key: tuple[int, ...]
    parent: "PageNode | None"
    depth: int  # pages from the root, this one included
    children: dict[tuple[int, ...], "PageNode"] = field(default_factory=dict)
    ref: int = 0
    last_access: int = 0
    snapshot: int = -1  # hybrid models: snapshot slot of the linear states after this page, -1 none
    snapshot_kind: int = 0  # hybrid: the kvcache.hybrid.Kind the snapshot was taken as (what it is worth)
    tails: dict[tuple[int, ...], object] = field(default_factory=dict)  # hybrid: kvcache.hybrid.Tail by tokens


@dataclass(frozen=True)
class PrefixMatch:
    nodes: list[PageNode]  # the matched path, root side first

    @property
    def pages(self) -> list[int]:
        return [n.page for n in self.nodes]


class PrefixCache:
    """Cached pages keyed by their token prefix. Owns the pages of its nodes (they stay allocated in the
    `PagePool`); pages come in by `insert` and leave by `evict` (handed back through `free_page`)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.root = PageNode(page=-1, key=(), parent=None, depth=0)
        self.num_nodes = 0
        self.num_unreferenced = 0  # nodes with ref == 0: every one of them can be evicted
        self._clock = itertools.count(1)
        self._leaves: list[tuple[int, int, PageNode]] = []  # (last_access, tiebreak, node), lazily validated
        self._tiebreak = itertools.count()
        self.query_tokens = 0  # prompt tokens looked up at admission (metrics)
        self.hit_tokens = 0
        self.evicted_pages = 0

    # --- lookup ---------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> PrefixMatch:
        """The longest cached prefix of `tokens` in whole pages. Touches the matched nodes; does not lock them."""
        ps = self.page_size
        node, path = self.root, []
        for start in range(0, len(tokens) - ps + 1, ps):
            child = node.children.get(tuple(tokens[start:start + ps]))
            if child is None:
                break
            path.append(child)
            node = child
        now = next(self._clock)
        for n in path:
            n.last_access = now
        return PrefixMatch(path)

    def lock(self, nodes: list[PageNode]) -> None:
        for n in nodes:
            if n.ref == 0:
                self.num_unreferenced -= 1
            n.ref += 1

    def unlock(self, nodes: list[PageNode]) -> None:
        now = next(self._clock)
        for n in nodes:
            assert n.ref > 0, f"page {n.page} unlocked more often than locked"
            n.ref -= 1
            n.last_access = now
            if n.ref == 0:
                self.num_unreferenced += 1
                self._push_leaf(n)

    # --- insert ---------------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int], num_locked: int) -> tuple[list[PageNode], list[int]]:
        """Cache the full pages of `tokens` (len(tokens) // page_size of `pages`). The first `num_locked`
        pages are already cached nodes (the caller's locked match). Returns (the path of nodes that now hold
        the prefix, the caller's pages that duplicate an existing node: the caller frees those)."""
        ps = self.page_size
        n_full = min(len(tokens) // ps, len(pages))
        node, path, duplicates = self.root, [], []
        now = next(self._clock)
        for i in range(n_full):
            key = tuple(tokens[i * ps:(i + 1) * ps])
            child = node.children.get(key)
            if i < num_locked:
                assert child is not None and child.page == pages[i], "a locked prefix page left the cache"
            elif child is not None:
                duplicates.append(pages[i])  # computed twice (two requests prefilled the same prefix at once)
            else:
                child = PageNode(page=pages[i], key=key, parent=node, depth=node.depth + 1)
                node.children[key] = child
                self.num_nodes += 1
                self.num_unreferenced += 1
                self._push_leaf(child)
            child.last_access = now
            path.append(child)
            node = child
        return path, duplicates

    # --- eviction -------------------------------------------------------------------------
    def _push_leaf(self, node: PageNode) -> None:
        if node.parent is None or node.ref or node.children or node.tails:
            return
        heapq.heappush(self._leaves, (node.last_access, next(self._tiebreak), node))
        if len(self._leaves) > 4 * self.num_nodes + 1024:  # stale entries of touched nodes: rebuild
            self._leaves = [(n.last_access, next(self._tiebreak), n) for n in self.nodes()
                            if not (n.ref or n.children or n.tails)]
            heapq.heapify(self._leaves)

    def evict(self, num_pages: int) -> tuple[list[int], list[int]]:
        """Remove up to `num_pages` unlocked nodes, least recently used leaves first. Returns (their pages,
        the snapshot slots they held)."""
        pages, snapshots = [], []
        while len(pages) < num_pages and self._leaves:
            stamp, _, node = heapq.heappop(self._leaves)
            if node.ref or node.children or node.tails or node.parent is None or stamp != node.last_access:
                if stamp != node.last_access:
                    self._push_leaf(node)  # touched since it was pushed: back in at its new time (if a leaf)
                continue
            parent = node.parent
            del parent.children[node.key]
            node.parent = None
            self.num_nodes -= 1
            self.num_unreferenced -= 1
            pages.append(node.page)
            self.evicted_pages += 1
            if node.snapshot >= 0:
                snapshots.append(node.snapshot)
                node.snapshot = -1
            self._push_leaf(parent)
        return pages, snapshots

    # --- checks ---------------------------------------------------------------------------
    def nodes(self) -> list[PageNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check(self) -> None:
        """Counters match the tree; a locked node's ancestors are locked at least as often."""
        nodes = self.nodes()
        assert len(nodes) == self.num_nodes, f"{len(nodes)} nodes, counter says {self.num_nodes}"
        assert sum(n.ref == 0 for n in nodes) == self.num_unreferenced
        for n in nodes:
            assert n.ref >= 0
            if n.parent is not self.root:
                assert n.parent.ref >= n.ref, f"page {n.page} locked more than its parent"
