"""The order in which cached pages are evicted.

Eviction takes pages from the tail of unlocked leaves. An `EvictionPolicy` turns a leaf's
tail-page retention priority (see retention.py), its recency and whether it is boosted (a
re-seen page: adaptive.py) into a sort key, smallest evicted first; `EvictionOrder` applies it to tree nodes; an `EvictionQueue` keeps the leaves
in that order and drains them.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar, Generic, Protocol, TypeVar

import numpy as np

from radixserve.cache.adaptive import LeadLearner
from radixserve.cache.node import RadixNode
from radixserve.cache.retention import DEFAULT_PRIORITY

EvictionKey = tuple[int, ...]


class EvictionPolicy(ABC):
    """Orders unlocked leaves for eviction; the smallest key is evicted first.

    `tick` is the tree's recency counter for the leaf (larger = used more recently; every
    leaf has a distinct tick), `priority` the effective priority of the leaf's tail page,
    `boosted` whether that page is boosted (only the adaptive policy reads it).
    """

    name: ClassVar[str]
    epoch: int = 0  # a policy whose keys can change all at once bumps it (queues re-key)

    @abstractmethod
    def key(self, priority: int, tick: int, boosted: bool = False) -> EvictionKey:
        """Sort key of a leaf whose tail page has `priority`."""

    @abstractmethod
    def tail_run(self, priorities: np.ndarray, tick: int, bound: EvictionKey | None,
                 boosted: np.ndarray | None = None) -> int:
        """How many pages from the tail of a leaf (pages `priorities`, in edge order, and
        which of them are `boosted`: None, none) sort before `bound`, the next leaf's key
        (None: no other leaf). At least 1: the caller has already chosen this leaf as the
        minimum."""


def _run_before(priorities: np.ndarray, recency: np.ndarray | float, bound: EvictionKey | None) -> int:
    """How many tail pages, keyed (priority, recency) page by page, sort before `bound`."""
    if bound is None:
        return len(priorities)
    bound_priority, bound_recency = bound
    before = (priorities < bound_priority) | ((priorities == bound_priority) & (recency < bound_recency))
    from_tail = np.broadcast_to(before, priorities.shape)[::-1]
    run = int(from_tail.argmin()) if not from_tail.all() else len(from_tail)
    return max(run, 1)


class PriorityPolicy(EvictionPolicy):
    """Lowest effective priority first, least recently used among equals."""

    name = "priority"

    def key(self, priority: int, tick: int, boosted: bool = False) -> EvictionKey:
        return (priority, tick)

    def tail_run(self, priorities: np.ndarray, tick: int, bound: EvictionKey | None,
                 boosted: np.ndarray | None = None) -> int:
        return _run_before(priorities, tick, bound)


class LRUPolicy(EvictionPolicy):
    """Least recently used first; priorities are ignored."""

    name = "lru"

    def key(self, priority: int, tick: int, boosted: bool = False) -> EvictionKey:
        return (tick,)

    def tail_run(self, priorities: np.ndarray, tick: int, bound: EvictionKey | None,
                 boosted: np.ndarray | None = None) -> int:
        # Every page of a leaf shares its tick, so the whole leaf goes before the next one.
        return len(priorities)


class AdaptivePolicy(EvictionPolicy):
    """Lowest effective priority first; among equals, least recently used, where a boosted
    page counts as used `learner.lead` ticks later than it was (adaptive.py: the lead is
    learned from ghost hits and starts at 0, plain LRU within a priority)."""

    name = "adaptive"

    def __init__(self) -> None:
        self.learner = LeadLearner()

    def key(self, priority: int, tick: int, boosted: bool = False) -> EvictionKey:
        self.learner.saw_tick(tick)
        return (priority, tick + self.learner.lead if boosted else tick)

    def tail_run(self, priorities: np.ndarray, tick: int, bound: EvictionKey | None,
                 boosted: np.ndarray | None = None) -> int:
        recency = tick if boosted is None else tick + self.learner.lead * boosted
        return _run_before(priorities, recency, bound)

    @property
    def epoch(self) -> int:
        """Changes whenever the lead does: queued keys are stale then."""
        return self.learner.epoch


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (AdaptivePolicy, PriorityPolicy, LRUPolicy)}


def make_eviction_policy(name: str) -> EvictionPolicy:
    """The eviction policy called `name` ("adaptive", "priority" or "lru")."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction_policy: unknown {name!r}, expected one of {sorted(POLICIES)}") from None


class EvictionOrder:
    """A tree's eviction order over its nodes, shared by both tiers' queues: a leaf's key,
    its pages' effective priorities, and how many of its tail pages go before the next leaf."""

    def __init__(self, policy: EvictionPolicy, page_size: int) -> None:
        self.policy = policy
        self.page_size = page_size

    def epoch(self) -> int:
        """The policy's epoch (queues re-key their entries when it changes)."""
        return self.policy.epoch

    def key(self, node: RadixNode, now: float) -> EvictionKey:
        """The policy's key of `node` as a leaf (its tail page's priority, its recency)."""
        if node.retention is None:
            return self.policy.key(DEFAULT_PRIORITY, node.tick)
        return self.policy.key(node.retention.tail_priority(now), node.tick, node.retention.tail_boosted)

    def effective(self, node: RadixNode, now: float) -> np.ndarray:
        """The effective retention priority of each of `node`'s pages at `now`."""
        if node.retention is None:
            return np.full(node.num_pages(self.page_size), DEFAULT_PRIORITY, dtype=np.int16)
        return node.retention.effective(now)

    def tail_run(self, node: RadixNode, now: float, bound: EvictionKey | None) -> int:
        """How many tail pages of a popped leaf sort before `bound`, the next leaf's key."""
        boosted = None if node.retention is None else node.retention.boosted
        return self.policy.tail_run(self.effective(node, now), node.tick, bound, boosted)


class Queueable(Protocol):
    """What the queue needs of a node: slots for the sequence numbers of its live entry and
    of its live expiry times (`heap_seq` and `expiry_seq`, or the attributes named by the
    queue's `slot` and `expiry_slot`: a node in two queues, one per tier, has two per queue)."""

    heap_seq: int
    expiry_seq: int


N = TypeVar("N", bound=Queueable)


class EvictionQueue(Generic[N]):
    """Evictable leaves in policy order: a heap validated lazily, plus retention expiries.

    Keys only grow while a node is queued (a touch raises its tick, a retention raise its
    priority), so a stale entry is detected when popped and pushed again with its current
    key. Keys that shrink (a temporary priority decaying) are pushed eagerly: each pending
    expiry time is kept in a second heap and `requeue_expired` re-queues its node.

    `key_of(node, now)` gives a node's current key; `is_candidate(node)` whether it may be
    evicted now (an unlocked leaf still in the tree); `num_nodes()` how many nodes exist, to
    bound both heaps (superseded entries are dropped once they outnumber the nodes). `slot`
    names the node attribute holding the sequence number of its live entry, `expiry_slot` the
    one of its live expiry times (each scheduling gives all of a node's pending times and
    supersedes the times given before). When `epoch()`
    changes (the adaptive policy changed its lead, which can shrink keys), every live entry
    is re-keyed before the next pop.
    """

    def __init__(self, key_of: Callable[[N, float], EvictionKey], is_candidate: Callable[[N], bool],
                 num_nodes: Callable[[], int], slot: str = "heap_seq", expiry_slot: str = "expiry_seq",
                 epoch: Callable[[], int] = lambda: 0) -> None:
        self._key_of = key_of
        self._is_candidate = is_candidate
        self._num_nodes = num_nodes
        self._slot = slot
        self._expiry_slot = expiry_slot
        self._epoch = epoch
        self._keyed_in = epoch()
        self._heap: list[tuple[EvictionKey, int, N]] = []
        self._expiries: list[tuple[float, int, N]] = []
        self._seq = 0

    def push(self, node: N, now: float, key: EvictionKey | None = None) -> None:
        """Queues `node` with its current key (or `key`), superseding its older entry."""
        self._seq += 1
        setattr(node, self._slot, self._seq)
        heapq.heappush(self._heap, (self._key_of(node, now) if key is None else key, self._seq, node))
        if len(self._heap) > 2 * self._num_nodes() + 64:
            # Drop superseded entries so repeated touches cannot grow the heap without bound.
            slot = self._slot
            self._heap[:] = [e for e in self._heap if e[1] == getattr(e[2], slot)]
            heapq.heapify(self._heap)

    def schedule_expiries(self, node: N, times: list[float], now: float) -> None:
        """Remembers that `node`'s key may drop at each of `times`: all its pending expiries
        after `now`, superseding those given before. (A retention raised by every request,
        a shared system prompt's, gave one more entry a request for as long as nothing was
        evicted: the superseded ones go once they outnumber the nodes.)"""
        # Times already past are acted on first, so that every superseded entry left is in the future:
        # its time is among `times` if some page still decays then, and means nothing if none does.
        self.requeue_expired(now)
        self._seq += 1
        generation = self._seq
        setattr(node, self._expiry_slot, generation)
        for when in times:
            heapq.heappush(self._expiries, (when, generation, node))
        if len(self._expiries) > 2 * self._num_nodes() + 64:
            slot = self._expiry_slot
            self._expiries[:] = [e for e in self._expiries if e[1] == getattr(e[2], slot)]
            heapq.heapify(self._expiries)

    def requeue_expired(self, now: float) -> None:
        """Re-queues the candidates whose retention decayed by `now`."""
        while self._expiries and self._expiries[0][0] <= now:
            _, _, node = heapq.heappop(self._expiries)
            if self._is_candidate(node):
                self.push(node, now)

    def pop(self, now: float) -> tuple[N, EvictionKey, EvictionKey | None] | None:
        """The next leaf to evict, its key, and the key of the leaf after it (None: none
        queued); None when nothing is evictable. The leaf leaves the queue."""
        if self._epoch() != self._keyed_in:
            self._rekey(now)
        heap, slot = self._heap, self._slot
        while heap:
            key, seq, node = heapq.heappop(heap)
            if seq != getattr(node, slot):
                continue
            setattr(node, slot, -1)
            if not self._is_candidate(node):
                continue
            current = self._key_of(node, now)
            if current != key:  # touched or raised since it was queued
                self.push(node, now, current)
                continue
            return node, key, heap[0][0] if heap else None
        return None

    def _rekey(self, now: float) -> None:
        """Recomputes the key of every live entry (the policy's keys changed at once)."""
        self._keyed_in = self._epoch()
        slot = self._slot
        self._heap[:] = [(self._key_of(node, now), seq, node) for _, seq, node in self._heap
                         if seq == getattr(node, slot)]
        heapq.heapify(self._heap)

    def drain(self, num_pages: int, now: float, tail_run: Callable[[N, float, EvictionKey | None], int],
              take: Callable[[N, int, float], int]) -> int:
        """Pops leaves in order and lets `take(node, count, now)` remove the run of tail pages
        that sort before the next leaf (`tail_run(node, now, next key)` pages), until `take`
        has counted `num_pages`; returns the count."""
        done = 0
        while done < num_pages:
            popped = self.pop(now)
            if popped is None:
                break
            node, _, bound = popped
            done += take(node, min(tail_run(node, now, bound), num_pages - done), now)
        return done

    def forget(self, keep: Callable[[N], bool]) -> None:
        """Drops every entry (nodes left must be re-pushed when they become candidates) and
        the expiries of nodes for which `keep` is false."""
        self._heap.clear()
        self._expiries = [e for e in self._expiries if keep(e[2])]
        heapq.heapify(self._expiries)

    def queued(self) -> Iterator[N]:
        """Nodes with a live entry (for checkers)."""
        slot = self._slot
        return (node for _, seq, node in self._heap if seq == getattr(node, slot))

    def __len__(self) -> int:
        """Heap entries, superseded ones included."""
        return len(self._heap)
