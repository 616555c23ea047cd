"""The radix tree's node (an edge and the pages of its tokens on each tier) and the result
of a match. Shared by the tree's modules; read-only outside the tree.

Layout. Each node's edge holds a whole number of pages: `tokens` (int64 array, page-aligned)
and, per tier, the pages holding their K/V: `pages` on the device (a list, one page per
`page_size` tokens, or empty when the edge lives on the host only; also kept as the int64
`page_array` for the pool, made once per node: at page size 1 converting page lists on every
incref/decref cost more than the tree) and `host` (the host tier's pages, or None). Children
are found by a dict keyed by the raw bytes of their first page, so a walk does one dict
lookup per node and compares the rest of the edge as one numpy slice compare. For
token-deep partial matches each node also keeps its children's keys sorted: the child
sharing the longest prefix with a query page is next to the query's insertion point.

Partial leaves. The one exception to whole pages: a *partial leaf* holds the last, partly
filled page of a finished sequence — `tokens` has 1..page_size-1 entries, `pages` one device
page. It never has children, never goes to the host, is never locked and is never named in
cache events; its key (its tokens' bytes) is shorter than a page's, so a walk by full-page
keys never finds it and only the token-deep partial search does. No partial leaf's tokens
are a prefix of a sibling's key (an insert that would break this drops or skips it), so at
most one partial leaf is a prefix of any query page: the key just before its insertion point.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np

from radixserve.cache.retention import PageRetention
from radixserve.cache.transfer import LoadHandle


class RadixNode:
    """One edge of the tree: page-aligned tokens and the pages holding their K/V (a partial
    leaf: fewer than a page of tokens in one device page; see the module docstring).

    Doubles as the lock handle returned by `RadixTree.match`. Read-only outside the tree.
    A root has `key is None` and no pages; a node removed from the tree has `parent is None`.
    `pages` are device pages (empty: the edge is on the host only), `host` host pages (None:
    no host copy).
    """

    __slots__ = ("parent", "children", "key", "tokens", "_pages", "_page_array", "host", "retention",
                 "lock_ref", "tick", "inserted_at", "hits", "heap_seq", "host_heap_seq", "expiry_seq",
                 "host_expiry_seq", "sorted_keys",
                 "namespace", "chain", "device_children", "loading", "left_device_in", "partial")

    def __init__(self, namespace: Hashable, key: bytes | None, tokens: np.ndarray,
                 pages: list[int], sorted_children: bool, page_array: np.ndarray | None = None) -> None:
        self.parent: RadixNode | None = None
        self.children: dict[bytes, RadixNode] = {}
        self.key = key                      # bytes of the first page; None for a root
        self.tokens = tokens                # int64 [num_pages * page_size]
        self._pages = pages                 # device pages, one per page_size tokens; [] if host only
        self._page_array = page_array       # the same as int64, made on first use (`page_array`)
        self.host: list[int] | None = None  # host pages, one per page_size tokens; None: none
        self.retention: PageRetention | None = None  # None: every page at the default
        self.lock_ref = 0                   # locks held on this node or any descendant
        self.tick = 0                       # recency counter value of the last touch
        self.inserted_at = 0.0              # clock time the pages were cached
        self.hits = 0                       # matches that used these pages
        self.heap_seq = -1                  # sequence number of its live device eviction-queue entry
        self.host_heap_seq = -1             # ... and of its live host eviction-queue entry
        self.expiry_seq = -1                # the generation of its live device expiry times
        self.host_expiry_seq = -1           # ... and of its live host expiry times
        self.sorted_keys: list[bytes] | None = [] if sorted_children else None
        self.namespace = namespace
        # Page-hash chain state at the end of the edge and pages from the root through it,
        # computed only when events are on (None: not computed yet, or stale).
        self.chain: tuple[int, int] | None = None
        self.device_children = 0           # children with pages on the device
        self.loading: LoadHandle | None = None  # an unfinished copy of host pages into `pages`
        self.left_device_in = -1            # the eviction call that took its pages off the device
        self.partial = False                # a partial leaf: one page, fewer than page_size tokens

    @property
    def pages(self) -> list[int]:
        """Device pages, one per page_size tokens (empty: the edge is on the host only)."""
        return self._pages

    @pages.setter
    def pages(self, pages: list[int]) -> None:
        self._pages = pages
        self._page_array = None

    def num_pages(self, page_size: int) -> int:
        """Pages of the edge on either tier (a partial leaf's one page included)."""
        return 1 if self.partial else len(self.tokens) // page_size

    @property
    def page_array(self) -> np.ndarray:
        """`pages` as an int64 array, converted once and kept: the pool takes arrays, and at
        page size 1 converting a node's page list on every incref/decref cost more than the
        tree's own work."""
        if self._page_array is None or len(self._page_array) != len(self._pages):
            self._page_array = np.fromiter(self._pages, dtype=np.int64, count=len(self._pages))
        return self._page_array

    def truncate_pages(self, keep: int) -> None:
        """Keeps the first `keep` device pages (eviction from the tail)."""
        del self._pages[keep:]
        if self._page_array is not None:
            self._page_array = self._page_array[:keep]

    def split_pages(self, num_pages: int) -> tuple[list[int], np.ndarray | None]:
        """Keeps the pages from `num_pages` on; returns the first `num_pages` (list, array if
        one was made) for the node split off above."""
        head, array = self._pages[:num_pages], self._page_array
        self._pages = self._pages[num_pages:]
        self._page_array = None if array is None else array[num_pages:]
        return head, None if array is None else array[:num_pages]

    def cut_tail(self, keep: int, page_size: int) -> None:
        """Keeps the edge's first `keep` pages of tokens and retention (eviction from the
        tail, on whichever tier held them); the hash chain ends elsewhere now."""
        self.tokens = self.tokens[: keep * page_size]
        self.chain = None
        if self.retention is not None:
            self.retention.truncate(keep)

    def subtree(self) -> list[RadixNode]:
        """This node and every node below it."""
        nodes, stack = [], [self]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            nodes.append(node)
        return nodes

    def attach(self, child: RadixNode) -> None:
        """Links `child` below this node (under its key)."""
        child.parent = self
        self.children[child.key] = child
        if child.pages:
            self.device_children += 1
        if self.sorted_keys is not None:
            insort(self.sorted_keys, child.key)

    def unlink(self, key: bytes) -> RadixNode:
        """Removes the child under `key` from this node's children; returns it."""
        child = self.children.pop(key)
        if child.pages:
            self.device_children -= 1
        if self.sorted_keys is not None:
            del self.sorted_keys[bisect_left(self.sorted_keys, key)]
        return child

    def split(self, num_pages: int, page_size: int) -> RadixNode:
        """Cuts this node after `num_pages` pages and returns the new upper node, linked in
        its place.

        This node keeps the lower part, so a lock handle held on it still covers the same
        path (and its hash-chain state, which describes the end of the same path). Both parts
        keep the node's tiers, locks, recency, hits and loading state.
        """
        cut = num_pages * page_size
        head, head_array = self.split_pages(num_pages)
        top = RadixNode(self.namespace, self.key, self.tokens[:cut].copy(), head, self.sorted_keys is not None,
                        head_array)
        self.tokens = self.tokens[cut:].copy()
        if self.host is not None:
            top.host, self.host = self.host[:num_pages], self.host[num_pages:]
        if self.retention is not None:
            top.retention, self.retention = self.retention.split(num_pages)
        top.lock_ref, top.tick, top.inserted_at, top.hits = self.lock_ref, self.tick, self.inserted_at, self.hits
        top.loading, top.left_device_in = self.loading, self.left_device_in
        parent = self.parent
        top.parent = parent
        parent.children[top.key] = top  # same first page, same key, same tier: parent unchanged
        self.key = self.tokens[:page_size].tobytes()
        top.attach(self)
        return top

    def unfinished_load(self) -> LoadHandle | None:
        """The copy from the host into `pages` while it is unfinished (forgotten once done)."""
        if self.loading is not None and self.loading.done():
            self.loading = None
        return self.loading

    @property
    def is_root(self) -> bool:
        """True for a namespace root (no pages, never evicted)."""
        return self.key is None

    def __repr__(self) -> str:
        pages = self.pages if len(self.pages) <= 8 else [*self.pages[:8], "..."]
        return (f"RadixNode(pages={pages}, host={'-' if self.host is None else len(self.host)}, "
                f"children={len(self.children)}, lock_ref={self.lock_ref}, tick={self.tick})")


@dataclass
class MatchResult:
    """The cached prefix of a token sequence: device pages, then the host-only continuation."""

    num_tokens: int            # tokens matched on the device: len(pages) * page_size + partial_tokens
    pages: list[int]           # fully matched device pages, in order
    node: RadixNode            # lock handle covering exactly `pages`
    partial_page: int | None   # device page whose first `partial_tokens` slots match too
    partial_tokens: int        # 0 <= partial_tokens < page_size
    host_pages: list[int] = field(default_factory=list)  # host pages continuing `pages`
    host_node: RadixNode | None = None  # lock handle covering `pages` + `host_pages` (None: none)
    host_tokens: int = 0       # len(host_pages) * page_size
    loads: list[LoadHandle] = field(default_factory=list)  # unfinished copies into `pages`
    page_chunks: list[np.ndarray] = field(default_factory=list, repr=False)  # nodes' page arrays
    # An unfinished copy from the host into `partial_page`: a reader of it fences it first.
    partial_load: LoadHandle | None = None

    @property
    def page_array(self) -> np.ndarray:
        """`pages` as an int64 array, from the nodes' arrays (no per-page conversion)."""
        return np.concatenate(self.page_chunks) if self.page_chunks else np.zeros(0, np.int64)

    @property
    def cached_tokens(self) -> int:
        """Tokens found on either tier."""
        return self.num_tokens + self.host_tokens
