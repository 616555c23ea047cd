"""The prefix cache: a radix tree from token-id sequences to chains of KV pages.

Edges hold whole pages of tokens and, per tier, the pages holding their K/V (node.py; walk.py
says how a query walks the edges), except a partial leaf: a finished request's last, partly
filled page, device only, never locked or named in events, matched token-deep, superseded by
longer inserts. Recency is a counter (`tick`) stamped on each node a match or insert touches,
so LRU order is exact even when the clock does not move; an operation that ends inside an
edge splits it at a page boundary, so a node's pages share one tick and one hit count.

With a host tier every page is on the device, the host or both, uniformly per node, and
device pages are prefix-closed (a node on the device has its parent there), so a match reads
device pages, then the continuation on the host only (ARCHITECTURE.md §2). This module keeps
the shape (match, insert, split, lock, drop, flush); the jobs around it are objects and
modules of their own: the namespace roots (forest.py), the device tier (device_tier.py), the
host tier (placement.py, through the `TreeOps` seam, under tiers.py's rules and transfer.py's
copies), the eviction order (eviction.py), retention (retention.py), counters (stats.py) and
events (event_reporter.py, events.py, page_hash.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator, Sequence

import numpy as np

from radixserve.cache.device_tier import DeviceTier
from radixserve.cache.event_reporter import TreeEventReporter
from radixserve.cache.page_hash import PageHashing
from radixserve.cache.events import DEVICE, CacheEventHub
from radixserve.cache.eviction import EvictionOrder, make_eviction_policy
from radixserve.cache.forest import Forest
from radixserve.cache.node import MatchResult, RadixNode
from radixserve.cache.placement import HostPlacement, TreeOps
from radixserve.cache.pool import PagePool
from radixserve.cache.transfer import LoadHandle
from radixserve.cache.retention import DEFAULT_PRIORITY, PageRange, PageRetention, Retention, page_ranges, raise_retention
from radixserve.cache.stats import CacheStats, Histogram, PagesFreed
from radixserve.cache.tiers import HostTier
from radixserve.cache.walk import (GivenPages, MatchWalk, as_tokens, best_partial, common_length, key_extending,
                                   partial_prefix_of, retention_path)

__all__ = ["DEFAULT_PRIORITY", "Histogram", "MatchResult", "PagesFreed", "RadixNode", "RadixTree", "Retention"]

RangeRetention = Sequence[tuple[int, int, Retention]]  # (first token, end token, retention)
# Told of every insert: (its full pages' tokens, namespace, retention, page ranges, the tick it stamped).
InsertObserver = Callable[[np.ndarray, Hashable, Retention, list[PageRange], int], None]


class RadixTree:
    """Maps token prefixes to chains of pages in `pool` (and `host.pool`; module docstring).

    The tree holds one reference on every page it caches, on either tier. `match` changes no
    refcount: the caller increfs the device pages it keeps and locks `node` while it uses
    them. Token arguments may be lists or int64 numpy arrays (arrays skip a conversion on
    every call). With `events`, every change of the cached pages is reported to that hub,
    pages named through `hashing` (page_hash.py; default: the public spec).
    """

    def __init__(self, pool: PagePool, *, eviction_policy: str = "priority",
                 clock: Callable[[], float] = time.monotonic,
                 events: CacheEventHub | None = None, host: HostTier | None = None,
                 hashing: PageHashing | None = None) -> None:
        self.pool = pool
        self.page_size: int = pool.page_size
        self.policy = make_eviction_policy(eviction_policy)
        self._order = EvictionOrder(self.policy, self.page_size)
        self.events = events
        self.host = host
        self._clock = clock
        self._tick = 0
        # Bumped by every call that may change what a peek (match with update=False) finds:
        # insert, evict, load_back, reset, end_retention, and match with update (a split, and
        # host copies that may evict host pages). The scheduler's policies reuse a waiting
        # request's lookup while it is unchanged (engine/policy.py).
        self.version = 0
        self._forest = Forest(self.page_size)
        self._stats = CacheStats()
        self._reporter = TreeEventReporter(events, self.page_size, hashing)
        self.hashing = self._reporter.hashing  # how its pages are named in events and views
        self._device = DeviceTier(pool, self._order, self._reporter, self._stats, clock, lambda: self._forest.num_nodes)
        self._queue = self._device.queue  # the device eviction queue
        self._host_tier = None if host is None else HostPlacement(host, self._tier_ops(), self._reporter,
                                                              self._stats, clock)
        # The adaptive rule's ghost caches (adaptive.py) follow what the tree caches, replies
        # included, not only the prompts they see on arrival.
        self.insert_observer: InsertObserver | None = None

    def _tier_ops(self) -> TreeOps:
        """The operations the host tier may use (placement.py's seam)."""
        return TreeOps(pool=self.pool, page_size=self.page_size, order=self._order,
                       num_nodes=lambda: self._forest.num_nodes, split=self._split,
                       drop=lambda node: self._drop(node, report=True), detach=self._detach,
                       after_removal=self._after_removal, requeue=self._requeue,
                       gain_device=self._device.gain, lose_device=self._device.lose)

    # ------------------------------------------------------------------ counters
    cached_pages = property(lambda self: self._device.cached_pages, doc="Device pages held by the tree.")
    locked_pages = property(lambda self: self._device.locked_pages,
                            doc="Cached device pages in locked nodes (in use by some sequence).")
    evictable_pages = property(lambda self: self._device.cached_pages - self._device.locked_pages,
                               doc="Cached device pages that repeated device eviction can free.")
    host_cached_pages = property(lambda self: 0 if self._host_tier is None else self._host_tier.cached_pages,
                                 doc="Host pages held (host-only pages and host copies of device pages).")
    host_only_pages = property(lambda self: 0 if self._host_tier is None else self._host_tier.host_only_pages,
                               doc="Cached pages that live on the host only.")

    # ------------------------------------------------------------------ match
    def match(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable = None, *,
              update: bool = True) -> MatchResult:
        """The longest cached prefix of `tokens`: device pages plus a token-deep partial page,
        or device pages then the pages that continue them on the host only.

        With `update` (the default) the match counts as a use: it splits an edge it ends in
        (so `node` and `host_node` cover exactly `pages` and `pages + host_pages`), refreshes
        recency along the path, records statistics and, under write-through-selective,
        copies pages hit often enough to the host. `update=False` only peeks: nothing
        changes, and `node` / `host_node` are then the deepest nodes whose edges matched in
        full, which may cover fewer pages. A partial page is only taken from the device.
        """
        toks = as_tokens(tokens)
        size = self.page_size
        n = len(toks)
        root = self._forest.root(namespace)
        if update:
            self._tick += 1
            self.version += 1
            self._stats.lookup(n)
        if root is None:
            return MatchResult(0, [], self._forest.new_root(namespace), None, 0)
        tick, now = self._tick, self._clock()
        walk = MatchWalk(root)
        at, pos = root, 0  # where the walk is
        partial_page: int | None = None
        partial_load: LoadHandle | None = None
        partial_tokens = 0
        while True:
            rest = n - pos
            child = at.children.get(toks[pos:pos + size].tobytes()) if rest >= size else None
            if child is None:
                if walk.host_node is None:
                    best, partial_tokens = best_partial(at, toks[pos:pos + size])
                    if best is not None:
                        partial_page, partial_load = best.pages[0], best.unfinished_load()
                        if update and best.partial:  # a partial leaf is used like any leaf
                            self._touch(best, tick, now)
                break
            edge_len = len(child.tokens)
            matched = common_length(child.tokens, toks[pos:pos + min(edge_len, rest)])
            if matched == edge_len:
                if update:
                    self._touch(child, tick, now)
                walk.take(child)
                at, pos = child, pos + edge_len
                continue
            full = matched // size
            if update:
                child = self._split(child, full)  # now covers exactly the matched pages
                self._touch(child, tick, now)
                walk.take(child)
                source, index = next(iter(child.children.values())), 0  # holds the partial page
            else:
                walk.take(child, full)
                source, index = child, full
            if child.pages and matched > full * size:  # partial reuse, from the device only
                partial_page, partial_tokens = source.pages[index], matched - full * size
                partial_load = source.unfinished_load()
            break
        result = walk.result(size, partial_page, partial_tokens, partial_load)
        if update:
            self._stats.hit(result.num_tokens, result.host_tokens)
            if self._host_tier is not None:
                self._host_tier.write_through(result)
        return result

    def _touch(self, node: RadixNode, tick: int, now: float) -> None:
        node.tick = tick
        node.hits += 1
        self._stats.used(now - node.inserted_at, node.num_pages(self.page_size))

    # ------------------------------------------------------------------ insert
    def insert(self, tokens: Sequence[int] | np.ndarray, pages: Sequence[int] | np.ndarray,
               namespace: Hashable = None, retention: Retention | None = None,
               range_retention: RangeRetention = (), *, partial: bool = False) -> list[int]:
        """Caches the `len(tokens) // page_size` full pages of `tokens` (`pages[i]` holds
        tokens `[i*P, (i+1)*P)`); returns the given pages not adopted because the tree held
        those tokens in other device pages already. With `partial`, the last, partly filled
        page (`pages[len(tokens) // P]`) is cached too, as a partial leaf, unless a page
        already starts with its tokens (then it is returned); a shorter partial leaf it or
        the full pages extend is dropped.

        Adopted pages gain the tree's reference; over host-only tokens they become the device
        copy. Each page's retention becomes the max of its effective one and `retention`, and
        of a `range_retention` entry's for pages overlapping its `[start, end)`. Int arrays
        of pages are converted to Python ints only where a new leaf adopts them.
        """
        self.version += 1
        size = self.page_size
        toks = as_tokens(tokens)
        num_full = len(toks) // size
        with_partial = partial and len(toks) > num_full * size
        given = GivenPages(pages, num_full + with_partial)
        if num_full == 0 and not with_partial:
            return []
        retention = retention or Retention()
        ranges = page_ranges(range_retention, size)
        now = self._clock()
        self._tick += 1
        root = self._forest.root_for_insert(namespace)
        node, pos, end = root, 0, num_full * size
        duplicates: list[int] = []
        while pos < end:
            first = pos // size
            key = toks[pos:pos + size].tobytes()
            child = node.children.get(key)
            if child is None:
                self._supersede_partial(node, key)
                node = self._add_leaf(node, key, toks[pos:end], given.leaf(first, num_full), retention, ranges,
                                      first, now)
                break
            matched = common_length(child.tokens, toks[pos:pos + min(len(child.tokens), end - pos)])
            full = matched // size
            if full < child.num_pages(self.page_size):
                child = self._split(child, full)
            if child.pages:
                duplicates += given.duplicates(first, child)
            else:  # on the host only: the given pages become its device copy
                self._host_tier.adopt(child, given.span(first, full))
            child.retention, changed = raise_retention(child.retention, full, first, retention, ranges, now)
            if changed:
                self._schedule_expiries(child, now)
            child.tick = self._tick
            node, pos = child, pos + full * size
        if with_partial:
            duplicates += self._insert_partial(node, toks[end:], given.span(num_full, 1), retention, ranges,
                                               num_full, now)
        if self.insert_observer is not None:
            self.insert_observer(toks[:end], namespace, retention, ranges, self._tick)
        return duplicates

    def _insert_partial(self, parent: RadixNode, tokens: np.ndarray, page: list[int], retention: Retention,
                        ranges: list[PageRange], first_page: int, now: float) -> list[int]:
        """Caches `page`, holding the fewer than page_size `tokens` after `parent`'s edge, as
        a partial leaf; returns it if the tree already holds those tokens in another page."""
        key = tokens.tobytes()
        holder = key_extending(parent, key)
        if holder is not None:  # a full page or a longer partial leaf starts with these tokens
            return [] if holder.pages[:1] == page else page
        self._supersede_partial(parent, key)
        self._add_leaf(parent, key, tokens, (page, None), retention, ranges, first_page, now, partial=True)
        return []

    def _supersede_partial(self, parent: RadixNode, key: bytes) -> None:
        """Drops the partial leaf below `parent` whose tokens the new child under `key` starts
        with: the new page holds them too. (Nothing locks a partial leaf: a match copies its
        page at once and locks only the full pages above it.)"""
        old = partial_prefix_of(parent, key)
        if old is not None:
            self._drop(old, report=False)

    def _add_leaf(self, parent: RadixNode, key: bytes, tokens: np.ndarray,
                  given: tuple[list[int], np.ndarray | None], retention: Retention,
                  ranges: list[PageRange], first_page: int, now: float, *, partial: bool = False) -> RadixNode:
        pages, page_array = given
        leaf = RadixNode(parent.namespace, key, tokens.copy(), pages, self.page_size > 1, page_array)
        leaf.partial = partial
        leaf.tick, leaf.inserted_at = self._tick, now
        if not retention.is_default:
            leaf.retention = PageRetention.of(len(pages), retention, now)
        parent.attach(leaf)
        self._forest.num_nodes += 1
        leaf.retention, _ = raise_retention(leaf.retention, len(pages), first_page, None, ranges, now)
        if leaf.retention is not None:
            self._schedule_expiries(leaf, now)
        self._device.add_leaf(leaf, now)
        return leaf

    def _schedule_expiries(self, node: RadixNode, now: float) -> None:
        times = node.retention.pending_expiries(now)
        self._queue.schedule_expiries(node, times, now)
        if self._host_tier is not None:
            self._host_tier.schedule_expiries(node, times, now)

    def end_retention(self, tokens: Sequence[int] | np.ndarray, namespace: Hashable,
                      priority: int, keep_pages: int = 0) -> None:
        """Ends early the temporary retention at `priority` of the pages along `tokens`: they
        fall back to their floor (for example a closed session's pages). Pages retained
        otherwise — a system prompt another request kept higher — are left as they are, and
        so are the first `keep_pages` pages of the path (another holder still raises them at
        that priority: an open session sharing the prefix). Tokens past the last full page
        end the retention of the page holding them too (a partial leaf, or the full page
        that superseded it): a partial leaf left raised would keep every page above it from
        eviction."""
        self.version += 1
        now = self._clock()
        last: RadixNode | None = None
        ended: list[RadixNode] = []
        start = end = 0  # the path's page index of the node's first page, and past its last
        for node, num_pages in retention_path(self._forest.root(namespace), as_tokens(tokens), self.page_size):
            if node is not last:  # the path may name a node twice: its full pages, then one more
                start = end
            end = start + num_pages
            if end > keep_pages:
                self._end_temporary(node, priority, now, num_pages, max(0, keep_pages - start))
                if not ended or ended[-1] is not node:
                    ended.append(node)
            last = node
        # Keys only shrink here: re-queue now each node that may be a leaf of either queue (not
        # only the path's last: with a host tier, a node whose child is on the host only is a
        # device leaf).
        for node in ended:
            self._requeue(node, now)

    def _end_temporary(self, node: RadixNode, priority: int, now: float, num_pages: int, first: int) -> None:
        """Ends the temporary retention at `priority` of `node`'s pages `first:num_pages`."""
        node.retention = PageRetention.ensure(node.retention, node.num_pages(self.page_size))
        node.retention.end_temporary(priority, now, num_pages, first)

    def _requeue(self, node: RadixNode, now: float) -> None:
        """Queues `node` in each eviction queue it is a candidate of (with its current key)."""
        self._device.requeue(node, now)
        if self._host_tier is not None:
            self._host_tier.requeue(node, now)

    # ------------------------------------------------------------------ locks
    def unlocked_pages(self, node: RadixNode) -> int:
        """Device pages of `node` and its ancestors that no lock holds: counted in
        `evictable_pages` until `lock(node)` takes them out of it."""
        count = 0
        while node is not None and node.lock_ref == 0:  # a locked node's ancestors are locked too
            count += len(node.pages)
            node = node.parent
        return count

    def lock(self, node: RadixNode) -> None:
        """Protects `node` and its ancestors from eviction (on either tier) until `unlock`."""
        if node.parent is None and not node.is_root:
            raise ValueError("lock: the node was evicted (lock it right after match)")
        while node is not None:
            if node.lock_ref == 0:
                self._device.locking(node, True)
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
                self._device.locking(node, False)
                if node.is_root:  # emptied while held (its pages evicted): it goes now
                    self._forest.forget_if_empty(node)
                elif self._device.is_candidate(node) or (self._host_tier is not None
                                                         and self._host_tier.is_candidate(node)):
                    now = self._clock() if now is None else now
                    self._requeue(node, now)
            node = node.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` device pages from unlocked nodes with no child on the
        device, page by page from the tail of the edge, in the policy's order. With a host
        tier the pages leave the device as `HostPlacement.leave_device` says. Returns the
        pages actually freed in the device pool."""
        self.version += 1
        if num_pages <= 0:
            return 0
        now = self._clock()
        self._queue.requeue_expired(now)
        if self._host_tier is None:
            return self._queue.drain(num_pages, now, self._order.tail_run,
                                     lambda node, count, at: self._device.evict_tail(node, count, at, self._detach))
        tier = self._host_tier
        call = tier.begin_eviction()

        def leave(node: RadixNode, count: int, at: float) -> int:
            if node.partial:  # dropped, never offloaded: the host tier holds whole pages only
                self._stats.dropped(1)
                return self._device.evict_tail(node, 1, at, self._detach)
            return tier.leave_device(call, node, count, at)

        freed = self._queue.drain(num_pages, now, self._order.tail_run, leave)
        tier.end_eviction(call, now)
        return freed

    def fence_load(self, load: LoadHandle | None) -> None:
        """Orders the next device work after an unfinished copy from the host (`load`: a
        match's `partial_load`, whose page a caller copies at once rather than waiting)."""
        if load is not None and self._host_tier is not None and not load.done():
            self._host_tier.tier.copier.fence(load)

    def load_back(self, match: MatchResult, max_pages: int | None = None) -> MatchResult:
        """Copies the leading pages of `match`'s host continuation (at most `max_pages`, and
        at most the free device pages: the caller makes room first) into fresh device pages,
        which the tree holds from now on; returns the match as it stands after the copy.

        `match` must come from `match(update=True)`, with `match.host_node` locked by the
        caller (so making room evicts nothing on the path). On CUDA the copy may still be in
        flight: its handle is in the result's `loads`.
        """
        self.version += 1
        if self._host_tier is None:
            return match
        return self._host_tier.load_back(match, max_pages)

    def _drop(self, top: RadixNode, *, report: bool) -> int:
        """Removes `top` and everything below it from the tree, on both tiers (the caller
        tidies its parent); returns the device pages freed."""
        top.parent.unlink(top.key)
        nodes = top.subtree()
        if report and self._reporter.active:
            self._reporter.dropped(nodes)
        if self._host_tier is not None:
            self._host_tier.release(nodes)
        device: list[int] = []
        for node in nodes:
            device += node.pages
            node.parent, node.heap_seq, node.host_heap_seq = None, -1, -1
        self._forest.num_nodes -= len(nodes)
        return self._device.release(device)

    # ------------------------------------------------------------------ flush
    def reset(self) -> PagesFreed:
        """Drops every unlocked cached page on both tiers, and the host copies of the locked
        ones (flush); returns the device pages freed (an int), with the host pages freed as
        its `host`.

        Events: one "cleared", then "stored" for the pages that stayed because they are in use.
        """
        self.version += 1
        free_before = self.pool.num_free
        host_free_before = 0 if self.host is None else self.host.pool.num_free
        for top in self._forest.unlocked_subtrees():
            self._drop(top, report=False)
        self._forest.prune()
        if self._host_tier is not None:
            self._host_tier.reset(node for node, _ in self.nodes())
        # Every node left is locked; unlock re-queues it.
        self._queue.forget(lambda node: node.parent is not None)
        if self._reporter.active:
            self._reporter.flushed(node for node, _ in self.nodes())
        host_freed = 0 if self.host is None else self.host.pool.num_free - host_free_before
        return PagesFreed(self.pool.num_free - free_before, host_freed)

    # ------------------------------------------------------------------ shape
    def _detach(self, node: RadixNode, now: float) -> None:
        """Removes an emptied leaf; its parent may become an eviction candidate."""
        parent = node.parent
        parent.unlink(node.key)
        node.parent, node.heap_seq, node.host_heap_seq = None, -1, -1
        self._forest.num_nodes -= 1
        self._after_removal(parent, now)

    def _after_removal(self, parent: RadixNode, now: float) -> None:
        """A child of `parent` left the tree: an empty root goes, a node may be a candidate now."""
        if parent.is_root:
            self._forest.forget_if_empty(parent)
        elif parent.lock_ref == 0:
            self._requeue(parent, now)

    def _split(self, node: RadixNode, num_pages: int) -> RadixNode:
        """Cuts `node` after `num_pages` pages (`RadixNode.split`); returns the new upper node."""
        top = node.split(num_pages, self.page_size)
        self._forest.num_nodes += 1
        if self._host_tier is not None:
            self._host_tier.track(top)  # both parts of a node on both tiers are
        if top.retention is not None:
            self._schedule_expiries(top, self._clock())
        return top

    # ------------------------------------------------------------------ inspection
    def nodes(self) -> Iterator[tuple[RadixNode, list[int]]]:
        """Every node (namespace roots included, with no pages) and its device pages, for
        checkers (`node.host`: its host pages)."""
        for node in self._forest.nodes():
            yield node, list(node.pages)

    def queued_nodes(self) -> list[RadixNode]:
        """Nodes with a live entry in the device eviction queue (for checkers)."""
        return list(self._queue.queued())

    def host_queued_nodes(self) -> list[RadixNode]:
        """Nodes with a live entry in the host eviction queue (for checkers)."""
        return [] if self._host_tier is None else list(self._host_tier.queued())

    def host_copy_nodes(self) -> set[RadixNode]:
        """Nodes the host tier tracks as maybe holding pages on both tiers (for checkers)."""
        return set() if self._host_tier is None else self._host_tier.tracked_copies()

    def cached_page_hashes(self, tier: str | None = DEVICE) -> set[tuple[str, int]]:
        """(namespace id, page hash) of every cached page on `tier` ("device", the default;
        "host"; None: on either): what an indexer of that tier's events should hold."""
        return self._reporter.page_hashes((node for node, _ in self.nodes()), tier)

    def histograms(self) -> dict[str, Histogram]:
        """Age of cached KV when hit and when evicted (seconds since insertion, one
        observation per page) and how often each evicted page had been hit."""
        return self._stats.histograms()

    def stats(self) -> dict[str, float]:
        """Counters for metrics: lookups, tokens looked up and hit (per tier), page counts,
        evictions and host-tier traffic, and the sums/counts of the histograms."""
        out = self._stats.as_dict()
        out.update(cached_pages=self.cached_pages, evictable_pages=self.evictable_pages,
                   locked_pages=self.locked_pages, free_pages=self.pool.num_free, nodes=self._forest.num_nodes)
        if self._host_tier is not None:
            out.update(self._host_tier.stats())
        return out
