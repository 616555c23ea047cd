"""The prefix cache: a radix tree from token-id sequences to chains of KV pages.

Layout. Each node's edge holds a whole number of pages: `tokens` (int64 array, page-aligned)
and `pages` (a list, one page per `page_size` tokens: a match returns a list, and extending a
list by a node's pages costs far less than turning array elements into ints). Children are
found by a dict keyed by the raw bytes of their first page, so the walk does one dict lookup
per node and compares the rest of the edge as one numpy slice compare; it drops to page
arithmetic only where the slices differ. For token-deep partial matches each node also keeps
its children's keys sorted: the child sharing the longest prefix with a query page is next to
the query's insertion point.

Recency is a counter (`tick`) bumped by every match/insert and stamped on each node it
touches, so LRU order is exact even when the clock does not move. A match or insert that ends
inside an edge splits it at the page boundary, so every page of a node shares one tick and one
hit count.

The jobs around the shape live in their own modules: per-page retention priorities
(retention.py), the eviction order and its queue (eviction.py), counters and histograms
(stats.py), and the events that tell subscribers what the cache holds (events.py, named by
page_hash.py).
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from radixserve.cache.events import DEVICE, CacheEventHub
from radixserve.cache.eviction import EvictionKey, EvictionQueue, make_policy
from radixserve.cache.page_hash import namespace_id, namespace_seed, page_hashes, state_hash
from radixserve.cache.pool import PagePool, as_int64
from radixserve.cache.retention import DEFAULT_PRIORITY, PageRetention, Retention
from radixserve.cache.stats import CacheStats, Histogram

__all__ = ["DEFAULT_PRIORITY", "Histogram", "MatchResult", "RadixNode", "RadixTree", "Retention"]

RangeRetention = Sequence[tuple[int, int, Retention]]  # (first token, end token, retention)


class RadixNode:
    """One edge of the tree: page-aligned tokens and the pages holding their K/V.

    Doubles as the lock handle returned by `RadixTree.match`. Read-only outside the tree.
    A root has `key is None` and no pages; a node removed from the tree has `parent is None`.
    """

    __slots__ = ("parent", "children", "key", "tokens", "pages", "retention", "lock_ref", "tick",
                 "inserted_at", "hits", "heap_seq", "sorted_keys", "namespace", "chain")

    def __init__(self, namespace: Hashable, key: bytes | None, tokens: np.ndarray,
                 pages: list[int], sorted_children: bool) -> None:
        self.parent: RadixNode | None = None
        self.children: dict[bytes, RadixNode] = {}
        self.key = key                      # bytes of the first page; None for a root
        self.tokens = tokens                # int64 [len(pages) * page_size]
        self.pages = pages                  # one page per page_size tokens
        self.retention: PageRetention | None = None  # None: every page at the default
        self.lock_ref = 0                   # locks held on this node or any descendant
        self.tick = 0                       # recency counter value of the last touch
        self.inserted_at = 0.0              # clock time the pages were cached
        self.hits = 0                       # matches that used these pages
        self.heap_seq = -1                  # sequence number of its live eviction-queue entry
        self.sorted_keys: list[bytes] | None = [] if sorted_children else None
        self.namespace = namespace
        # Page-hash chain state at the end of the edge and pages from the root through it,
        # computed only when events are on (None: not computed yet, or stale).
        self.chain: tuple[int, int] | None = None

    @property
    def is_root(self) -> bool:
        """True for a namespace root (no pages, never evicted)."""
        return self.key is None

    def __repr__(self) -> str:
        pages = self.pages if len(self.pages) <= 8 else [*self.pages[:8], "..."]
        return (f"RadixNode(pages={pages}, children={len(self.children)}, "
                f"lock_ref={self.lock_ref}, tick={self.tick})")


@dataclass
class MatchResult:
    """The cached prefix of a token sequence."""

    num_tokens: int            # tokens matched: len(pages) * page_size + partial_tokens
    pages: list[int]           # fully matched cached pages, in order
    node: RadixNode            # lock handle covering exactly `pages`
    partial_page: int | None   # cached page whose first `partial_tokens` slots match too
    partial_tokens: int        # 0 <= partial_tokens < page_size


def _as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a 1-D int64 array (no copy when they already are one)."""
    arr = as_int64(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence, got shape {arr.shape}")
    return arr


def _common_length(edge: np.ndarray, query: np.ndarray) -> int:
    """Length of the common prefix of `edge` and a non-empty `query` no longer than it."""
    differs = edge[: len(query)] != query
    first = int(differs.argmax())
    return first if differs[first] else len(query)


class RadixTree:
    """Maps token prefixes to chains of pages in `pool`; see the module docstring.

    The tree holds one reference on every page it caches. `match` changes no refcount: the
    caller increfs the pages it keeps and locks `node` while it uses them. Token arguments
    may be lists or int64 numpy arrays (arrays skip a conversion on every call). With
    `events`, every change of the cached pages is reported to that hub.
    """

    def __init__(self, pool: PagePool, *, eviction_policy: str = "priority",
                 clock: Callable[[], float] = time.monotonic,
                 events: CacheEventHub | None = None) -> None:
        self.pool = pool
        self.page_size: int = pool.page_size
        self.policy = make_policy(eviction_policy)
        self.events = events
        self._clock = clock
        self._roots: dict[Hashable, RadixNode] = {}
        self._queue: EvictionQueue[RadixNode] = EvictionQueue(self._key, self._is_evictable_leaf,
                                                                  lambda: self._num_nodes)
        self._tick = 0
        self._num_nodes = 0
        self._cached = 0
        self._locked = 0
        self._stats = CacheStats()
        self._namespace_ids: dict[Hashable, tuple[str, int]] = {}

    # ------------------------------------------------------------------ counters
    @property
    def cached_pages(self) -> int:
        """Pages held by the tree."""
        return self._cached

    @property
    def locked_pages(self) -> int:
        """Cached pages in locked nodes (in use by some sequence)."""
        return self._locked

    @property
    def evictable_pages(self) -> int:
        """Cached pages that repeated leaf eviction can free."""
        return self._cached - self._locked

    # ------------------------------------------------------------------ match
    def match(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable = None, *,
              update: bool = True) -> MatchResult:
        """The longest cached prefix of `tokens`, whole pages plus a token-deep partial page.

        With `update` (the default) the match counts as a use: it splits an edge it ends in
        (so `node` covers exactly `pages`), refreshes recency along the path and records
        statistics. `update=False` only peeks: nothing changes, and `node` is then the deepest
        node whose edge matched in full, which may cover fewer pages than `pages`.
        """
        toks = _as_tokens(tokens)
        size = self.page_size
        n = len(toks)
        root = self._roots.get(namespace)
        if update:
            self._tick += 1
            self._stats.lookup(n)
        if root is None:
            return MatchResult(0, [], self._new_root(namespace), None, 0)
        tick, now = self._tick, self._clock()
        node, pos = root, 0
        pages: list[int] = []
        partial_page: int | None = None
        partial_tokens = 0
        while True:
            rest = n - pos
            child = node.children.get(toks[pos:pos + size].tobytes()) if rest >= size else None
            if child is None:
                partial_page, partial_tokens = self._best_partial(node, toks[pos:pos + size])
                break
            edge_len = len(child.tokens)
            matched = _common_length(child.tokens, toks[pos:pos + min(edge_len, rest)])
            full = matched // size
            if matched == edge_len:
                if update:
                    self._touch(child, tick, now)
                pages += child.pages
                node, pos = child, pos + edge_len
                continue
            partial_tokens = matched - full * size
            if update:
                child = self._split(child, full)
                self._touch(child, tick, now)
                pages += child.pages
                node = child
                tail = next(iter(child.children.values()))
                partial_page = tail.pages[0] if partial_tokens else None
            else:
                pages += child.pages[:full]
                partial_page = child.pages[full] if partial_tokens else None
            pos += full * size
            break
        num_tokens = len(pages) * size + partial_tokens
        if update:
            self._stats.hit(num_tokens)
        return MatchResult(num_tokens, pages, node, partial_page, partial_tokens)

    def _best_partial(self, node: RadixNode, query: np.ndarray) -> tuple[int | None, int]:
        """The child page sharing the longest (< page_size) prefix with `query`."""
        keys = node.sorted_keys
        if not keys or not len(query):
            return None, 0
        i = bisect_left(keys, query.tobytes())
        best_page, best = None, 0
        # In sorted order the longest common prefix is with a neighbour of the insertion point.
        for j in (i - 1, i):
            if 0 <= j < len(keys):
                child = node.children[keys[j]]
                common = _common_length(child.tokens, query)
                if common > best:
                    best_page, best = child.pages[0], common
        return best_page, best

    def _touch(self, node: RadixNode, tick: int, now: float) -> None:
        node.tick = tick
        node.hits += 1
        self._stats.used(now - node.inserted_at, len(node.pages))

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int] | np.ndarray, pages: Sequence[int] | np.ndarray,
               namespace: Hashable = None, retention: Retention | None = None,
               range_retention: RangeRetention = ()) -> list[int]:
        """Caches the `len(tokens) // page_size` full pages of `tokens` (`pages[i]` holds
        tokens `[i*P, (i+1)*P)`; extra pages are ignored) and returns the given pages that
        were not adopted because the tree already held those tokens in other pages.

        Adopted pages gain the tree's reference. Each page's retention becomes the max of its
        current effective one and `retention`; pages overlapping `[start, end)` of a
        `range_retention` entry get that entry's retention if higher.
        """
        size = self.page_size
        toks = _as_tokens(tokens)
        num_full = len(toks) // size
        page_list = pages[:num_full].tolist() if isinstance(pages, np.ndarray) else list(pages[:num_full])
        if len(page_list) < num_full:
            raise ValueError(f"insert: {num_full} full pages of tokens but only {len(pages)} pages")
        if num_full == 0:
            return []
        toks = toks[: num_full * size]
        retention = retention or Retention()
        ranges = [(start // size, -(-end // size), r) for start, end, r in range_retention if end > start]
        now = self._clock()
        self._tick += 1
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self._new_root(namespace)
        node, pos = root, 0
        duplicates: list[int] = []
        while pos < len(toks):
            first = pos // size
            key = toks[pos:pos + size].tobytes()
            child = node.children.get(key)
            if child is None:
                self._add_leaf(node, key, toks[pos:], page_list[first:], retention, ranges, first, now)
                break
            matched = _common_length(child.tokens, toks[pos:pos + min(len(child.tokens), len(toks) - pos)])
            full = matched // size
            if full < len(child.pages):
                child = self._split(child, full)
            given = page_list[first:first + full]
            if given != child.pages:  # C-speed compare; the loop runs only on duplicates
                duplicates += [g for g, c in zip(given, child.pages) if g != c]
            if self._retain(child, first, retention, ranges, now):
                self._queue.schedule_expiries(child, child.retention.pending_expiries(now))
            child.tick = self._tick
            node, pos = child, pos + full * size
        return duplicates

    def _add_leaf(self, parent: RadixNode, key: bytes, tokens: np.ndarray, pages: list[int],
                  retention: Retention, ranges: list[tuple[int, int, Retention]],
                  first_page: int, now: float) -> None:
        self.pool.incref(pages)
        leaf = RadixNode(parent.namespace, key, tokens.copy(), pages, self.page_size > 1)
        leaf.tick, leaf.inserted_at = self._tick, now
        if not retention.is_default:
            leaf.retention = PageRetention.of(len(pages), retention, now)
        self._attach(parent, leaf)
        self._num_nodes += 1
        self._cached += len(pages)
        self._retain(leaf, first_page, None, ranges, now)
        if leaf.retention is not None:
            self._queue.schedule_expiries(leaf, leaf.retention.pending_expiries(now))
        self._queue.push(leaf, now)
        if self.events is not None and self.events.active:
            self._report_stored(leaf, 0)

    def _retain(self, node: RadixNode, first_page: int, retention: Retention | None,
                ranges: list[tuple[int, int, Retention]], now: float) -> bool:
        """Raises the node's page retentions (`first_page`: index of its first page in the
        inserted sequence); returns whether any changed."""
        changed = False
        if retention is not None and (node.retention is not None or not retention.is_default):
            changed = self._retention_of(node).raise_to(retention, now)
        for start, end, r in ranges:
            lo, hi = max(start - first_page, 0), min(end - first_page, len(node.pages))
            if lo < hi:
                changed |= self._retention_of(node).raise_to(r, now, lo, hi)
        return changed

    @staticmethod
    def _retention_of(node: RadixNode) -> PageRetention:
        if node.retention is None:
            node.retention = PageRetention.default(len(node.pages))
        return node.retention

    def end_retention(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable,
                      priority: int) -> None:
        """Ends early the temporary retention at `priority` of the pages along `tokens`: they
        fall back to their floor (for example a closed session's pages). Pages retained
        otherwise — a system prompt another request kept higher — are left as they are."""
        size = self.page_size
        toks = _as_tokens(tokens)
        toks = toks[: len(toks) // size * size]
        node = self._roots.get(namespace)
        now = self._clock()
        last: RadixNode | None = None
        pos = 0
        while node is not None and pos < len(toks):
            child = node.children.get(toks[pos:pos + size].tobytes())
            if child is None:
                break
            matched = _common_length(child.tokens, toks[pos:pos + min(len(child.tokens), len(toks) - pos)])
            full = matched // size
            self._retention_of(child).end_temporary(priority, now, full)
            last = child
            if full < len(child.pages):
                break
            node, pos = child, pos + full * size
        # Keys only shrink here, and only the last node can be a leaf: re-queue it now.
        if last is not None and self._is_evictable_leaf(last):
            self._queue.push(last, now)

    # ------------------------------------------------------------------ locks
    def lock(self, node: RadixNode) -> None:
        """Protects `node` and its ancestors from eviction until `unlock`."""
        if node.parent is None and not node.is_root:
            raise ValueError("lock: the node was evicted (lock it right after match)")
        while node is not None:
            if node.lock_ref == 0:
                self._locked += len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        """Releases one `lock` of `node`."""
        if node.lock_ref <= 0:
            raise ValueError(f"unlock: node is not locked (lock_ref {node.lock_ref})")
        now = None
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._locked -= len(node.pages)
                if self._is_evictable_leaf(node):
                    now = self._clock() if now is None else now
                    self._queue.push(node, now)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` pages from unlocked leaves, page by page from the tail of
        a leaf's edge, in the policy's order. Returns the pages actually freed in the pool."""
        if num_pages <= 0:
            return 0
        now = self._clock()
        self._queue.requeue_expired(now)
        freed = 0
        while freed < num_pages:
            popped = self._queue.pop(now)
            if popped is None:
                break
            node, _, bound = popped
            run = self.policy.tail_run(self._effective(node, now), node.tick, bound)
            freed += self._evict_tail(node, min(run, num_pages - freed), now)
        return freed

    def _evict_tail(self, node: RadixNode, count: int, now: float) -> int:
        keep = len(node.pages) - count
        if self.events is not None and self.events.active:
            self._report_removed(node, keep)
        evicted = node.pages[keep:]
        del node.pages[keep:]
        node.tokens = node.tokens[: keep * self.page_size]
        node.chain = None  # its edge ends elsewhere now
        if node.retention is not None:
            node.retention.truncate(keep)
        self._cached -= count
        self._stats.evicted(count, now - node.inserted_at, node.hits)
        freed = len(self.pool.decref(evicted))
        if keep:
            self._queue.push(node, now)
        else:
            self._detach(node, now)
        return freed

    def reset(self) -> int:
        """Drops every unlocked cached page (flush); returns the pages freed in the pool.

        Events: one "cleared", then "stored" for the pages that stayed because they are in use.
        """
        free_before = self.pool.num_free
        for namespace, root in list(self._roots.items()):
            stack = [root]
            while stack:
                node = stack.pop()
                for key, child in list(node.children.items()):
                    if child.lock_ref:
                        stack.append(child)
                    else:  # an unlocked node has no locked descendant: drop its subtree
                        self._unlink(node, key)
                        self._drop_subtree(child)
            if not root.children and not root.lock_ref:
                del self._roots[namespace]
        # Every node left is locked; unlock re-queues it.
        self._queue.forget(lambda node: node.parent is not None)
        if self.events is not None and self.events.active:
            self.events.cleared()
            for node, _ in self.nodes():
                if not node.is_root:
                    self._report_stored(node, 0)
        return self.pool.num_free - free_before

    def _drop_subtree(self, top: RadixNode) -> None:
        dropped: list[int] = []
        stack = [top]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            dropped += node.pages
            node.parent, node.heap_seq = None, -1
            self._num_nodes -= 1
        self._cached -= len(dropped)
        self.pool.decref(dropped)

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return (node.parent is not None and not node.children and node.lock_ref == 0
                and len(node.pages) > 0)

    def _effective(self, node: RadixNode, now: float) -> np.ndarray:
        if node.retention is None:
            return np.full(len(node.pages), DEFAULT_PRIORITY, dtype=np.int16)
        return node.retention.effective(now)

    def _key(self, node: RadixNode, now: float) -> EvictionKey:
        priority = DEFAULT_PRIORITY if node.retention is None else node.retention.tail_priority(now)
        return self.policy.key(priority, node.tick)

    # ------------------------------------------------------------------ events
    def _chain_end(self, node: RadixNode) -> tuple[int, int]:
        """(hash-chain state, pages from the root) at the end of `node`'s edge; computes and
        caches it for `node` and any ancestors that lack it."""
        path = []
        while not node.is_root and node.chain is None:
            path.append(node)
            node = node.parent
        state, depth = (0, 0) if node.is_root else node.chain
        if path:
            seed = self._namespace(path[0].namespace)[1]
            for step in reversed(path):
                _, state = page_hashes(step.tokens, self.page_size, seed, state, depth)
                depth += len(step.pages)
                step.chain = (state, depth)
        return state, depth

    def _hashes(self, node: RadixNode) -> tuple[int | None, list[int]]:
        """The hash of the page before `node`'s edge (None at the root) and of its pages."""
        ns_id, seed = self._namespace(node.namespace)
        parent = node.parent
        state, depth = self._chain_end(parent)
        hashes, end = page_hashes(node.tokens, self.page_size, seed, state, depth)
        node.chain = (end, depth + len(node.pages))
        return (None if parent.is_root else state_hash(state, seed)), hashes.tolist()

    def _report_stored(self, node: RadixNode, first: int) -> None:
        """Reports `node`'s pages from index `first` on as stored on the device."""
        parent_hash, hashes = self._hashes(node)
        if first:
            parent_hash = hashes[first - 1]
        tokens = node.tokens[first * self.page_size:].tolist() if self.events.wants_tokens else None
        self.events.stored(self._namespace(node.namespace)[0], DEVICE, parent_hash, hashes[first:], tokens)

    def _report_removed(self, node: RadixNode, first: int) -> None:
        """Reports `node`'s pages from index `first` on as removed from the device."""
        _, hashes = self._hashes(node)
        self.events.removed(self._namespace(node.namespace)[0], DEVICE, hashes[first:])

    def _namespace(self, namespace: Hashable) -> tuple[str, int]:
        """The namespace's opaque id and hash seed (cached)."""
        known = self._namespace_ids.get(namespace)
        if known is None:
            ns_id = namespace_id(namespace)
            known = self._namespace_ids[namespace] = (ns_id, namespace_seed(ns_id))
        return known

    def cached_page_hashes(self) -> set[tuple[str, int]]:
        """(namespace id, page hash) of every cached page: what an event indexer should hold."""
        out: set[tuple[str, int]] = set()
        for node, _ in self.nodes():
            if not node.is_root:
                ns_id = self._namespace(node.namespace)[0]
                out.update((ns_id, h) for h in self._hashes(node)[1])
        return out

    # ------------------------------------------------------------------ shape
    def _new_root(self, namespace: Hashable) -> RadixNode:
        return RadixNode(namespace, None, np.empty(0, dtype=np.int64), [], self.page_size > 1)

    def _attach(self, parent: RadixNode, child: RadixNode) -> None:
        child.parent = parent
        parent.children[child.key] = child
        if parent.sorted_keys is not None:
            insort(parent.sorted_keys, child.key)

    def _unlink(self, parent: RadixNode, key: bytes) -> None:
        del parent.children[key]
        if parent.sorted_keys is not None:
            del parent.sorted_keys[bisect_left(parent.sorted_keys, key)]

    def _detach(self, node: RadixNode, now: float) -> None:
        """Removes an emptied leaf; its parent may become an evictable leaf."""
        parent = node.parent
        self._unlink(parent, node.key)
        node.parent, node.heap_seq = None, -1
        self._num_nodes -= 1
        if parent.children or parent.lock_ref:
            return
        if parent.is_root:
            if self._roots.get(parent.namespace) is parent:
                del self._roots[parent.namespace]
        else:
            self._queue.push(parent, now)

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cuts `node` after `num_pages` pages; returns the new upper node.

        `node` keeps the lower part, so a lock handle held on it still covers the same path
        (and its hash-chain state, which describes the end of the same path).
        """
        cut = num_pages * self.page_size
        top = RadixNode(node.namespace, node.key, node.tokens[:cut].copy(),
                        node.pages[:num_pages], self.page_size > 1)
        node.tokens, node.pages = node.tokens[cut:].copy(), node.pages[num_pages:]
        if node.retention is not None:
            top.retention, node.retention = node.retention.split(num_pages)
        top.lock_ref, top.tick, top.inserted_at, top.hits = node.lock_ref, node.tick, node.inserted_at, node.hits
        parent = node.parent
        top.parent = parent
        parent.children[top.key] = top  # same first page, same key: sorted_keys unchanged
        node.key = node.tokens[: self.page_size].tobytes()
        self._attach(top, node)
        self._num_nodes += 1
        if top.retention is not None:
            self._queue.schedule_expiries(top, top.retention.pending_expiries(self._clock()))
        return top

    # ------------------------------------------------------------------ inspection
    def nodes(self) -> Iterator[tuple[RadixNode, list[int]]]:
        """Every node (namespace roots included, with no pages) and its pages, for checkers."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node, list(node.pages)
            stack.extend(node.children.values())

    def queued_nodes(self) -> list[RadixNode]:
        """Nodes with a live entry in the eviction queue (for checkers)."""
        return list(self._queue.queued())

    def histograms(self) -> dict[str, Histogram]:
        """Age of cached KV when hit and when evicted (seconds since insertion, one
        observation per page) and how often each evicted page had been hit."""
        return self._stats.histograms()

    def stats(self) -> dict[str, float]:
        """Counters for metrics: lookups, tokens looked up and hit, page counts, evictions,
        and the sums/counts of the histograms."""
        out = self._stats.as_dict()
        out.update(cached_pages=self._cached, evictable_pages=self.evictable_pages,
                   locked_pages=self._locked, free_pages=self.pool.num_free, nodes=self._num_nodes)
        return out
