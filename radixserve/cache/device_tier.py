"""The device tier of the radix tree: the device pages it holds, which of them are locked,
its eviction queue, and the moves that put a node's pages on the device or take them off.

`DeviceTier` is held by the tree (radix.py), which calls it where a node's device pages
change: a new leaf, a lock, device eviction without a host tier or of a partial leaf
(`evict_tail`), a drop. The
host tier (placement.py) reaches it through the tree's `TreeOps` (`gain_device`,
`lose_device`) when pages are loaded back or leave the device for the host.
"""

from __future__ import annotations

from collections.abc import Callable

from radixserve.cache.event_reporter import TreeEventReporter
from radixserve.cache.events import DEVICE
from radixserve.cache.eviction import EvictionOrder, EvictionQueue
from radixserve.cache.node import RadixNode
from radixserve.cache.pool import PagePool
from radixserve.cache.stats import CacheStats


class DeviceTier:
    """The tree's device pages: counters, eviction queue, and placement on the device."""

    def __init__(self, pool: PagePool, order: EvictionOrder, reporter: TreeEventReporter, stats: CacheStats,
                 clock: Callable[[], float], num_nodes: Callable[[], int]) -> None:
        self.pool = pool
        self.queue: EvictionQueue[RadixNode] = EvictionQueue(order.key, self.is_candidate, num_nodes,
                                                             epoch=order.epoch)
        self._reporter = reporter
        self._stats = stats
        self._clock = clock
        self._cached = 0  # device pages held
        self._locked = 0  # device pages in locked nodes

    @property
    def cached_pages(self) -> int:
        """Device pages held by the tree."""
        return self._cached

    @property
    def locked_pages(self) -> int:
        """Cached device pages in locked nodes."""
        return self._locked

    def is_candidate(self, node: RadixNode) -> bool:
        """A device eviction candidate: unlocked, on the device, no child on the device."""
        return (node.parent is not None and node.device_children == 0 and node.lock_ref == 0
                and len(node.pages) > 0)

    def requeue(self, node: RadixNode, now: float) -> None:
        """Queues `node` for device eviction if it is a candidate (with its current key)."""
        if self.is_candidate(node):
            self.queue.push(node, now)

    def locking(self, node: RadixNode, locked: bool) -> None:
        """`node`'s first lock was taken (`locked`) or its last one released: its device
        pages count as locked or not."""
        self._locked += len(node.pages) if locked else -len(node.pages)

    def add_leaf(self, leaf: RadixNode, now: float) -> None:
        """A new leaf holds its device pages for the tree from now on."""
        self.pool.incref(leaf.page_array)
        self._cached += len(leaf.pages)
        self.queue.push(leaf, now)
        if self._reporter.active:
            self._reporter.stored(leaf, 0, DEVICE)

    def gain(self, node: RadixNode, pages: list[int]) -> None:
        """Host-only `node` now also lives in the device `pages` (held for the tree)."""
        node.pages = pages
        node.parent.device_children += 1
        self._cached += len(pages)
        if node.lock_ref:
            self._locked += len(pages)
        if node.device_children == 0 and node.lock_ref == 0:
            self.queue.push(node, self._clock())
        if self._reporter.active:
            self._reporter.stored(node, 0, DEVICE)

    def lose(self, node: RadixNode) -> int:
        """`node`'s device pages are freed (it stays, on the host); returns pages freed."""
        if self._reporter.active:
            self._reporter.removed(node, 0, DEVICE)
        freed = len(self.pool.decref(node.pages))
        self._cached -= len(node.pages)
        node.pages = []
        node.parent.device_children -= 1
        return freed

    def evict_tail(self, node: RadixNode, count: int, now: float,
                   detach: Callable[[RadixNode, float], None]) -> int:
        """Without a host tier (with one, for a partial leaf only: it never goes to host):
        drops the last `count` pages of a leaf (`detach` removes it once empty); returns
        device pages freed."""
        keep = len(node.pages) - count
        if self._reporter.active:
            self._reporter.removed(node, keep, DEVICE)
        evicted = node.page_array[keep:]
        node.truncate_pages(keep)
        node.cut_tail(keep, self.pool.page_size)
        self._cached -= count
        self._stats.evicted(count, now - node.inserted_at, node.hits)
        freed = self.pool.decref_count(evicted, distinct=True)  # a node lists a page once
        if keep:
            self.queue.push(node, now)
        else:
            node.parent.device_children -= 1  # its pages are gone: it no longer counts as on the device
            detach(node, now)
        return freed

    def release(self, pages: list[int]) -> int:
        """The tree dropped nodes holding device `pages`; returns pages freed in the pool."""
        self._cached -= len(pages)
        return len(self.pool.decref(pages))
