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
hit count. Retention priorities are kept per page (arrays, None while all are default).

Eviction keeps a heap of unlocked leaves keyed by the policy (tail-page priority, tick) and
validates entries lazily: an entry whose key is now larger is pushed again; keys that shrink
(a priority decaying, `set_retention`) are pushed eagerly, decays via a heap of expiry times.
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_left, insort
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from radixserve.cache.eviction import (
    DEFAULT_PRIORITY,
    NEVER,
    EvictionKey,
    Retention,
    effective_priorities,
    make_policy,
    raise_retention,
)
from radixserve.cache.pool import PagePool, as_int64

__all__ = ["DEFAULT_PRIORITY", "Histogram", "MatchResult", "RadixNode", "RadixTree", "Retention"]

AGE_BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)
REUSE_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


@dataclass
class Histogram:
    """Fixed-bucket histogram: `counts[i]` observations in (bounds[i-1], bounds[i]], the last
    one above bounds[-1] (Prometheus `le` semantics, not cumulative)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, weight: int = 1) -> None:
        """Records `value` `weight` times."""
        self.counts[bisect_left(self.bounds, value)] += weight
        self.sum += value * weight
        self.count += weight

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) pairs ending with +inf, as Prometheus wants."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append((bound, total))
        return out


class RadixNode:
    """One edge of the tree: page-aligned tokens and the pages holding their K/V.

    Doubles as the lock handle returned by `RadixTree.match`. Read-only outside the tree.
    A root has `key is None` and no pages; a node removed from the tree has `parent is None`.
    """

    __slots__ = ("parent", "children", "key", "tokens", "pages", "priority", "expiry", "floor",
                 "lock_ref", "tick", "inserted_at", "hits", "heap_seq", "sorted_keys", "namespace")

    def __init__(self, namespace: Hashable, key: bytes | None, tokens: np.ndarray,
                 pages: list[int], sorted_children: bool) -> None:
        self.parent: RadixNode | None = None
        self.children: dict[bytes, RadixNode] = {}
        self.key = key                      # bytes of the first page; None for a root
        self.tokens = tokens                # int64 [len(pages) * page_size]
        self.pages = pages                  # one page per page_size tokens
        self.priority: np.ndarray | None = None  # int16 per page; None: all default
        self.expiry: np.ndarray | None = None    # float64 per page, clock time; NEVER: no decay
        self.floor: np.ndarray | None = None     # int16 per page: the priority left after expiry
        self.lock_ref = 0                   # locks held on this node or any descendant
        self.tick = 0                       # recency counter value of the last touch
        self.inserted_at = 0.0              # clock time the pages were cached
        self.hits = 0                       # matches that used these pages
        self.heap_seq = -1                  # sequence number of its live eviction-heap entry
        self.sorted_keys: list[bytes] | None = [] if sorted_children else None
        self.namespace = namespace

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
    may be lists or int64 numpy arrays (arrays skip a conversion on every call).
    """

    def __init__(self, pool: PagePool, *, eviction_policy: str = "priority",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.page_size: int = pool.page_size
        self.policy = make_policy(eviction_policy)
        self._clock = clock
        self._roots: dict[Hashable, RadixNode] = {}
        self._heap: list[tuple[EvictionKey, int, RadixNode]] = []
        self._expiries: list[tuple[float, int, RadixNode]] = []
        self._seq = 0
        self._tick = 0
        self._num_nodes = 0
        self._cached = 0
        self._locked = 0
        self._lookups = 0
        self._lookup_tokens = 0
        self._hit_tokens = 0
        self._evicted = 0
        self._hit_age = Histogram(AGE_BUCKETS_S)
        self._evict_age = Histogram(AGE_BUCKETS_S)
        self._evict_reuse = Histogram(REUSE_BUCKETS)

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
            self._lookups += 1
            self._lookup_tokens += n
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
                child = self._split(child, full, now)
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
            self._hit_tokens += num_tokens
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
        self._hit_age.observe(now - node.inserted_at, len(node.pages))

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int] | np.ndarray, pages: Sequence[int] | np.ndarray,
               namespace: Hashable = None, retention: Retention | None = None,
               range_retention: Sequence[tuple[int, int, Retention]] = ()) -> list[int]:
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
                child = self._split(child, full, now)
            given = page_list[first:first + full]
            if given != child.pages:  # C-speed compare; the loop runs only on duplicates
                duplicates += [g for g, c in zip(given, child.pages) if g != c]
            if self._retain(child, first, retention, ranges, now):
                self._schedule_expiries(child, now)
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
            leaf.priority = np.full(len(pages), retention.priority, dtype=np.int16)
            leaf.expiry = np.full(len(pages), retention.expiry(now))
            permanent = retention.priority if retention.duration_s is None else DEFAULT_PRIORITY
            leaf.floor = np.full(len(pages), permanent, dtype=np.int16)
        self._attach(parent, leaf)
        self._num_nodes += 1
        self._cached += len(pages)
        self._retain(leaf, first_page, None, ranges, now)
        self._schedule_expiries(leaf, now)
        self._push(leaf, now)

    def _retain(self, node: RadixNode, first_page: int, retention: Retention | None,
                ranges: list[tuple[int, int, Retention]], now: float) -> bool:
        """Raises the node's page retentions (`first_page`: index of its first page in the
        inserted sequence); returns whether any changed."""
        changed = False
        if retention is not None and (node.priority is not None or not retention.is_default):
            changed = raise_retention(*self._retention_arrays(node), retention, now)
        for start, end, r in ranges:
            lo, hi = max(start - first_page, 0), min(end - first_page, len(node.pages))
            if lo < hi:
                priority, expiry, floor = self._retention_arrays(node)
                changed |= raise_retention(priority[lo:hi], expiry[lo:hi], floor[lo:hi], r, now)
        return changed

    @staticmethod
    def _retention_arrays(node: RadixNode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if node.priority is None:
            node.priority = np.full(len(node.pages), DEFAULT_PRIORITY, dtype=np.int16)
            node.expiry = np.full(len(node.pages), NEVER)
            node.floor = np.full(len(node.pages), DEFAULT_PRIORITY, dtype=np.int16)
        return node.priority, node.expiry, node.floor

    def set_retention(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable,
                      retention: Retention) -> None:
        """Overwrites the retention of the cached full pages along `tokens` (a retention
        without a duration overwrites their floor too). Changes neither recency nor the
        tree's shape."""
        permanent = retention.duration_s is None

        def overwrite(priority: np.ndarray, expiry: np.ndarray, floor: np.ndarray, now: float) -> None:
            priority[:] = retention.priority
            expiry[:] = retention.expiry(now)
            if permanent:
                floor[:] = retention.priority

        self._along(tokens, namespace, overwrite)

    def end_retention(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable,
                      priority: int) -> None:
        """Ends early the temporary retention at `priority` of the pages along `tokens`: they
        fall back to their floor (for example a closed session's pages). Pages retained
        otherwise — a system prompt another request kept higher — are left as they are."""

        def end(current: np.ndarray, expiry: np.ndarray, floor: np.ndarray, now: float) -> None:
            ending = (expiry > now) & (expiry < NEVER) & (current == priority)
            current[ending] = floor[ending]
            expiry[ending] = NEVER

        self._along(tokens, namespace, end)

    def _along(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable,
               change: Callable[[np.ndarray, np.ndarray, np.ndarray, float], None]) -> None:
        """Applies `change` to the retention arrays of the cached full pages along `tokens`."""
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
            priority, expiry, floor = self._retention_arrays(child)
            change(priority[:full], expiry[:full], floor[:full], now)
            self._schedule_expiries(child, now)
            last = child
            if full < len(child.pages):
                break
            node, pos = child, pos + full * size
        # Only the last node can be a leaf; its key may have dropped, so re-queue it now.
        if last is not None and self._is_evictable_leaf(last):
            self._push(last, now)

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
                    self._push(node, now)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` pages from unlocked leaves, page by page from the tail of
        a leaf's edge, in the policy's order. Returns the pages actually freed in the pool."""
        if num_pages <= 0:
            return 0
        now = self._clock()
        while self._expiries and self._expiries[0][0] <= now:
            _, _, node = heapq.heappop(self._expiries)
            if self._is_evictable_leaf(node):
                self._push(node, now)
        heap = self._heap
        freed = 0
        while freed < num_pages and heap:
            key, seq, node = heapq.heappop(heap)
            if seq != node.heap_seq:
                continue
            node.heap_seq = -1
            if not self._is_evictable_leaf(node):
                continue
            current = self._key(node, now)
            if current != key:  # touched or raised since it was queued
                self._push(node, now, current)
                continue
            run = self.policy.tail_run(self._effective(node, now), node.tick, heap[0][0] if heap else None)
            freed += self._evict_tail(node, min(run, num_pages - freed), now)
        return freed

    def _evict_tail(self, node: RadixNode, count: int, now: float) -> int:
        keep = len(node.pages) - count
        evicted = node.pages[keep:]
        del node.pages[keep:]
        node.tokens = node.tokens[: keep * self.page_size]
        if node.priority is not None:
            node.priority, node.expiry, node.floor = node.priority[:keep], node.expiry[:keep], node.floor[:keep]
        self._cached -= count
        self._evicted += count
        self._evict_age.observe(now - node.inserted_at, count)
        self._evict_reuse.observe(node.hits, count)
        freed = len(self.pool.decref(evicted))
        if keep:
            self._push(node, now)
        else:
            self._detach(node, now)
        return freed

    def reset(self) -> int:
        """Drops every unlocked cached page (flush); returns the pages freed in the pool."""
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
        self._heap.clear()  # every node left is locked; unlock re-queues it
        self._expiries = [e for e in self._expiries if e[2].parent is not None]
        heapq.heapify(self._expiries)
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
        if node.priority is None:
            return np.full(len(node.pages), DEFAULT_PRIORITY, dtype=np.int16)
        return effective_priorities(node.priority, node.expiry, node.floor, now)

    def _key(self, node: RadixNode, now: float) -> EvictionKey:
        priority = DEFAULT_PRIORITY
        if node.priority is not None:
            priority = int(node.priority[-1] if node.expiry[-1] > now else node.floor[-1])
        return self.policy.key(priority, node.tick)

    def _push(self, node: RadixNode, now: float, key: EvictionKey | None = None) -> None:
        self._seq += 1
        node.heap_seq = self._seq
        heapq.heappush(self._heap, (self._key(node, now) if key is None else key, self._seq, node))
        if len(self._heap) > 2 * self._num_nodes + 64:
            # Drop superseded entries so touches cannot grow the heap without bound.
            self._heap[:] = [e for e in self._heap if e[1] == e[2].heap_seq]
            heapq.heapify(self._heap)

    def _schedule_expiries(self, node: RadixNode, now: float) -> None:
        if node.expiry is None:
            return
        pending = node.expiry[(node.expiry > now) & (node.expiry < NEVER)]
        for when in np.unique(pending).tolist():
            self._seq += 1
            heapq.heappush(self._expiries, (when, self._seq, node))

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
            self._push(parent, now)

    def _split(self, node: RadixNode, num_pages: int, now: float) -> RadixNode:
        """Cuts `node` after `num_pages` pages; returns the new upper node.

        `node` keeps the lower part, so a lock handle held on it still covers the same path.
        """
        cut = num_pages * self.page_size
        top = RadixNode(node.namespace, node.key, node.tokens[:cut].copy(),
                        node.pages[:num_pages], self.page_size > 1)
        node.tokens, node.pages = node.tokens[cut:].copy(), node.pages[num_pages:]
        if node.priority is not None:
            top.priority, node.priority = node.priority[:num_pages].copy(), node.priority[num_pages:].copy()
            top.expiry, node.expiry = node.expiry[:num_pages].copy(), node.expiry[num_pages:].copy()
            top.floor, node.floor = node.floor[:num_pages].copy(), node.floor[num_pages:].copy()
        top.lock_ref, top.tick, top.inserted_at, top.hits = node.lock_ref, node.tick, node.inserted_at, node.hits
        parent = node.parent
        top.parent = parent
        parent.children[top.key] = top  # same first page, same key: sorted_keys unchanged
        node.key = node.tokens[: self.page_size].tobytes()
        self._attach(top, node)
        self._num_nodes += 1
        self._schedule_expiries(top, now)
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
        """Nodes with a live entry in the eviction heap (for checkers)."""
        return [node for _, seq, node in self._heap if seq == node.heap_seq]

    def histograms(self) -> dict[str, Histogram]:
        """Age of cached KV when hit and when evicted (seconds since insertion, one
        observation per page) and how often each evicted page had been hit."""
        return {"hit_age_seconds": self._hit_age, "evict_age_seconds": self._evict_age,
                "evict_reuse": self._evict_reuse}

    def stats(self) -> dict[str, float]:
        """Counters for metrics: lookups, tokens looked up and hit, page counts, evictions,
        and the sums/counts of the histograms."""
        out = {
            "lookups": self._lookups,
            "lookup_tokens": self._lookup_tokens,
            "hit_tokens": self._hit_tokens,
            "hit_rate": self._hit_tokens / self._lookup_tokens if self._lookup_tokens else 0.0,
            "cached_pages": self._cached,
            "evictable_pages": self.evictable_pages,
            "locked_pages": self._locked,
            "free_pages": self.pool.num_free,
            "evicted_pages": self._evicted,
            "nodes": self._num_nodes,
        }
        for name, hist in self.histograms().items():
            out[f"{name}_sum"] = hist.sum
            out[f"{name}_count"] = hist.count
        return out
