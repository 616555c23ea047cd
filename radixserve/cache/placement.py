"""Tier placement: how the radix tree moves pages between the device and the host tier.

The rules are in tiers.py (what may move) and `_leave_device` (what one eviction call does);
the data moves through the host tier's `KVCopier` (transfer.py). `TierPlacement` is mixed into
`RadixTree`: it works on the tree's nodes through the shape operations and counters its
annotations list, and the tree calls it where pages change tier — device eviction, host
eviction, load-back, write-through, insert over host-only pages.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from radixserve.cache.eviction import EvictionQueue
from radixserve.cache.events import DEVICE, HOST, CacheEventHub
from radixserve.cache.node import MatchResult, RadixNode
from radixserve.cache.pool import PagePool
from radixserve.cache.stats import CacheStats
from radixserve.cache.tiers import HostTier


class TierPlacement:
    """Offload, host eviction, load-back and write-through over the tree's two tiers."""

    # What the tree provides: pools, policy, queues, counters, events and shape operations.
    pool: PagePool
    host: HostTier | None
    page_size: int
    events: CacheEventHub | None
    _queue: EvictionQueue[RadixNode]
    _host_queue: EvictionQueue[RadixNode]
    _stats: CacheStats
    _cached: int
    _locked: int
    _host_cached: int
    _host_only: int
    _eviction_call: int
    _shielded: int | None
    _clock: Callable[[], float]
    _npages: Callable[[RadixNode], int]
    _split: Callable[[RadixNode, int], RadixNode]
    _drain: Callable[..., int]
    _drop: Callable[..., int]
    _detach: Callable[[RadixNode, float], None]
    _after_removal: Callable[[RadixNode, float], None]
    _requeue: Callable[[RadixNode, float], None]
    _effective: Callable[[RadixNode, float], np.ndarray]
    _report_stored: Callable[[RadixNode, int, str], None]
    _report_removed: Callable[[RadixNode, int, str], None]
    lock: Callable[[RadixNode], None]
    unlock: Callable[[RadixNode], None]

    def _write_through(self, match: MatchResult) -> None:
        """Write-through-selective: copies the matched device pages hit often enough to the
        host, top down, as far as host room can be made (the matched path is locked meanwhile,
        so making room never takes its host pages)."""
        handle = match.host_node or match.node
        path: list[RadixNode] = []
        up: RadixNode | None = match.node
        while up is not None and not up.is_root:
            path.append(up)
            up = up.parent
        self.lock(handle)
        for node in reversed(path):
            if node.host is not None or not self.host.writes_through(node.hits):
                continue
            got = self._host_alloc(self._npages(node))
            if not got:
                break
            if len(got) < self._npages(node):
                node = self._split(node, len(got))
            self.host.copier.offload(node.pages, got)
            self._gain_host(node, got)
            self._stats.written_through(len(got))
        self.unlock(handle)

    def _adopt(self, node: RadixNode, pages: list[int]) -> None:
        """The host-only `node` gets `pages` as its device copy (their holder adds the tree)."""
        self.pool.incref(pages)
        self._gain_device(node, list(pages))

    def _gain_device(self, node: RadixNode, pages: list[int]) -> None:
        """Host-only `node` now also lives in the device `pages` (already held for the tree)."""
        node.pages = pages
        node.parent.device_children += 1
        self._cached += len(pages)
        self._host_only -= len(pages)
        if node.lock_ref:
            self._locked += len(pages)
        if node.device_children == 0 and node.lock_ref == 0:
            self._queue.push(node, self._clock())
        if self.events is not None and self.events.active:
            self._report_stored(node, 0, DEVICE)

    def _gain_host(self, node: RadixNode, host_pages: list[int]) -> None:
        """Device `node` now also lives in `host_pages` (copied, held for the tree)."""
        node.host = host_pages
        self._host_cached += len(host_pages)
        if self.events is not None and self.events.active:
            self._report_stored(node, 0, HOST)

    def _leave_device(self, node: RadixNode, count: int, now: float,
                      leaving: list[tuple[RadixNode, list[int]]], left: list[RadixNode]) -> int:
        """Takes the last `count` pages of `node` off the device; returns device pages freed.

        The rule, per eviction call (all pages it takes off the device, S):
        - a page with a host copy just loses its device copy;
        - a device-only page goes to host if its priority reaches the offload floor and so
          does every page above it in S; the others are dropped, with everything below them;
        - host room for those pages is made from free host pages, then by host eviction of
          pages outside S; if that is not enough, the pages of S compete among themselves
          by the same order (host eviction, leaf first) and the losers are dropped.
        The split makes the run a node of its own; its device pages are freed now and
        copied to host at the end of the call (`_place_on_host`), before anything can reuse
        them.
        """
        keep = self._npages(node) - count
        if keep:
            self._split(node, keep)  # `node` keeps the run, its new parent the rest
        self._stats.evicted(count, now - node.inserted_at, node.hits)
        freed = 0
        if node.host is None:
            qualifies = self._effective(node, now) >= self.host.offload_min_priority
            head = count if qualifies.all() else int(qualifies.argmin())
            if head < count:
                top = self._split(node, head) if head else None
                parent = node.parent
                self._stats.dropped(count - head)
                freed += self._drop(node, report=True)
                if top is None:
                    self._after_removal(parent, now)
                    return freed
                node = top
            leaving.append((node, node.pages))
        else:
            self._host_only += count
            self._settle(node)
        if self.events is not None and self.events.active:
            self._report_removed(node, 0, DEVICE)
        freed += len(self.pool.decref(node.pages))
        self._cached -= len(node.pages)
        node.pages = []
        node.parent.device_children -= 1
        node.left_device_in = self._eviction_call
        left.append(node)
        self._requeue(node.parent, now)  # it may have no child on the device now
        return freed

    def _place_on_host(self, leaving: list[tuple[RadixNode, list[int]]], left: list[RadixNode],
                       now: float) -> None:
        """Copies the device-only pages that left the device in this call to host pages,
        making room as `_leave_device` says."""
        need = sum(self._npages(node) for node, _ in leaving if node.parent is not None)
        short = need - self.host.pool.num_free
        if short > 0:
            short -= self._evict_host(short, now)
        if short > 0:  # the pages of this call compete among themselves now
            self._shielded = None
            for node in left:
                if node.parent is not None and self._is_host_leaf(node):
                    self._host_queue.push(node, now)
            self._evict_host(short, now)
        for node, device_pages in leaving:
            if node.parent is None:
                continue  # dropped since
            count = self._npages(node)
            host_pages = self.host.pool.allocate(count)
            self.host.copier.offload(device_pages[:count], host_pages)
            self._host_only += count
            self._stats.offloaded(count)
            self._gain_host(node, host_pages)

    def _host_alloc(self, num_pages: int) -> list[int]:
        """Up to `num_pages` host pages, evicting from the host to make room."""
        short = num_pages - self.host.pool.num_free
        if short > 0:
            self._evict_host(short, self._clock())
        return self.host.pool.allocate(min(num_pages, self.host.pool.num_free))

    def _evict_host(self, num_pages: int, now: float) -> int:
        """Takes up to `num_pages` pages off the host, from the tail of unlocked host-only
        leaves in the policy's order; returns how many (host pages freed, plus pages that
        were on their way to host and are dropped instead)."""
        self._host_queue.requeue_expired(now)
        return self._drain(self._host_queue, num_pages, now, self._evict_host_tail)

    def _evict_host_tail(self, node: RadixNode, count: int, now: float) -> int:
        keep = self._npages(node) - count
        if node.host is None:  # on its way to host (this eviction call): dropped instead
            self._stats.dropped(count)
        else:
            if self.events is not None and self.events.active:
                self._report_removed(node, keep, HOST)
            self._settle(node)
            evicted = node.host[keep:]
            del node.host[keep:]
            self._host_cached -= count
            self._host_only -= count
            self._stats.host_evicted(count)
            self.host.pool.decref(evicted)
        node.tokens = node.tokens[: keep * self.page_size]
        node.chain = None
        if node.retention is not None:
            node.retention.truncate(keep)
        if keep:
            self._host_queue.push(node, now)
        else:
            self._detach(node, now)
        return count

    def load_back(self, match: MatchResult, max_pages: int | None = None) -> MatchResult:
        """Copies the leading pages of `match`'s host continuation (at most `max_pages`, and
        at most the free device pages: the caller makes room first) into fresh device pages,
        which the tree holds from now on; returns the match as it stands after the copy.

        `match` must come from `match(update=True)`, with `match.host_node` locked by the
        caller (so making room evicts nothing on the path). On CUDA the copy may still be in
        flight: its handle is in the result's `loads`.
        """
        if not match.host_pages:
            return match
        chain: list[RadixNode] = []
        up = match.host_node
        while up is not match.node:
            chain.append(up)
            up = up.parent
        budget = min(len(match.host_pages), self.pool.num_free)
        if max_pages is not None:
            budget = min(budget, max_pages)
        pages, loads, node = list(match.pages), list(match.loads), match.node
        for step in reversed(chain):
            if budget == 0:
                break
            count = self._npages(step)
            if count > budget:
                step = self._split(step, budget)
                count = budget
            device = self.pool.allocate(count)
            handle = self.host.copier.load(step.host, device)
            self._gain_device(step, device)
            if handle is not None:
                step.loading = handle
                loads.append(handle)
            self._stats.loaded(count)
            pages += device
            node = step
            budget -= count
        rest = match.host_pages[len(pages) - len(match.pages):]
        return MatchResult(len(pages) * self.page_size, pages, node, None, 0, rest,
                           match.host_node if rest else None, len(rest) * self.page_size, loads)

    def _settle(self, node: RadixNode) -> None:
        """Before pages of `node` are freed: an unfinished load into it is fenced."""
        if node.loading is not None:
            if not node.loading.done():
                self.host.copier.fence(node.loading)
            node.loading = None

    def _is_host_leaf(self, node: RadixNode) -> bool:
        """A host eviction candidate: an unlocked host-only leaf, unless it left the device
        in the eviction call under way (see `_leave_device`)."""
        return (node.parent is not None and not node.pages and not node.children and node.lock_ref == 0
                and node.left_device_in != self._shielded)
