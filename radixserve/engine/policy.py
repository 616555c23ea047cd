"""Scheduling policies: the order in which waiting requests are admitted.

Shared by the engine's scheduler and the benchmark's simulator, so that the hit rates the
simulator reports are those of the policies the engine runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from operator import attrgetter
from typing import Hashable, Protocol, Sequence, TypeVar

import numpy as np

from radixserve.cache.radix import RadixTree


class Schedulable(Protocol):
    """What a policy needs to know about a waiting request."""

    prompt_ids: np.ndarray  # int32 tokens still to be prefilled (prompt + output so far)
    num_tokens: int  # len(prompt_ids), without building the array
    namespace: Hashable
    arrival_time: float
    priority: int  # scheduling priority: higher is admitted first


S = TypeVar("S", bound=Schedulable)


class SchedulePolicy(ABC):
    """Orders the waiting queue once per scheduling round.

    Requests that have waited longer than `max_wait_s` come first, oldest first (aging: a
    cache-aware order must not starve anyone); then higher scheduling priority first; within
    a priority, the policy's own order (`_order`).
    """

    def __init__(self, max_wait_s: float = 30.0) -> None:
        self.max_wait_s = max_wait_s
        self.cached_lengths = CachedLengths()

    def order(self, waiting: Sequence[S], tree: RadixTree, now: float, *,
              keep: Sequence[S] | None = None) -> list[S]:
        """`waiting` in admission order. `keep`: whose cached lengths to keep (`waiting`'s
        by default); a caller that orders the queue a tenant at a time passes the whole
        queue, else each tenant's ordering dropped the others' lengths, to be looked up again."""
        # The scheduler orders every waiting request at every step (thousands, under requests
        # of many samples): one pass, and keys of C (attrgetter), not lambdas.
        self.cached_lengths.keep_only(waiting if keep is None else keep)
        aged: list[S] = []
        fresh: list[S] = []
        max_wait_s = self.max_wait_s
        for r in waiting:
            (aged if now - r.arrival_time > max_wait_s else fresh).append(r)
        aged.sort(key=_ARRIVAL)
        ordered = self._order(fresh, tree)
        # Higher priority first; reverse keeps equals in order (stable): the policy's order within.
        ordered.sort(key=_PRIORITY, reverse=True)
        return aged + ordered

    @abstractmethod
    def _order(self, waiting: list[S], tree: RadixTree) -> list[S]:
        """The policy's order of requests that are neither aged nor of different priority."""


_ARRIVAL = attrgetter("arrival_time")
_PRIORITY = attrgetter("priority")


class FCFS(SchedulePolicy):
    """First come, first served."""

    def _order(self, waiting: list[S], tree: RadixTree) -> list[S]:
        return sorted(waiting, key=_ARRIVAL)


def _cached_len(request: Schedulable, tree: RadixTree) -> int:
    """Prompt tokens cached on either tier (a host hit is loaded back, not recomputed)."""
    prompt = request.prompt_ids
    return tree.match(prompt[: len(prompt) - 1], request.namespace, update=False).cached_tokens


class CachedLengths:
    """Each waiting request's cached prompt length, looked up in the tree again only once the
    tree (its `version`) or the request's tokens have changed since the last lookup.

    The cache-aware orders look every waiting request up at every step, and most steps change
    neither: in a simulation of four replicas on the gsp workload 62% of the lookups came
    with no change to the tree since the previous ordering (a lookup there: 42 us, and the
    engine builds the prompt's array for it). A request's tokens only grow while it waits
    (preempted, with its output); were they rewritten at the same length, only the order
    would suffer, since admission looks the prompt up again. Entries of requests no longer
    waiting are dropped at each ordering.
    """

    def __init__(self) -> None:
        # id(request) -> (request, tree, tree version, token count, cached length)
        self._known: dict[int, tuple[Schedulable, RadixTree, int, int, int]] = {}
        self.lookups = 0  # tree lookups made (the rest were reused)

    def get(self, request: Schedulable, tree: RadixTree) -> int:
        known = self._known.get(id(request))
        if known is not None:
            same_request, same_tree, version, num_tokens, length = known
            if same_request is request and same_tree is tree and version == tree.version \
                    and num_tokens == request.num_tokens:
                return length
        length = _cached_len(request, tree)
        self.lookups += 1
        self._known[id(request)] = (request, tree, tree.version, request.num_tokens, length)
        return length

    def keep_only(self, waiting: Sequence[Schedulable]) -> None:
        """Forgets every request not in `waiting`."""
        if len(self._known) > len(waiting):  # more entries than requests: some left (else pruned later)
            waiting_ids = {id(r) for r in waiting}
            for key in [k for k in self._known if k not in waiting_ids]:
                del self._known[key]


_UNKNOWN = (None, 0)  # a request LongestPrefixMatch has not looked up: no request, length 0
LPM_MATCH_BUDGET = 128  # tree lookups per ordering, whatever the queue length


class LongestPrefixMatch(SchedulePolicy):
    """Longest cached prefix first (SGLang's `lpm`); arrival order among equals.

    A lookup walks the prompt through the tree and the queue is ordered every step, so
    matching every waiting request costs a step time in proportion to the queue. Up to
    `match_budget` waiting requests every request is looked up each time (exact LPM). Beyond
    it each ordering looks up `match_budget` of them — requests never looked up first, oldest
    first, then those whose value is stalest — and orders the rest by the value they had when
    last looked up (0 if never). SGLang instead falls back to first-come-first-served above
    128 waiting requests; stale values keep the cache-aware order at the same bounded cost.
    """

    def __init__(self, max_wait_s: float = 30.0, match_budget: int = LPM_MATCH_BUDGET) -> None:
        super().__init__(max_wait_s)
        self.match_budget = match_budget
        self._known: dict[int, tuple[Schedulable, int]] = {}  # id → (request, cached); stalest first

    def _order(self, waiting: list[S], tree: RadixTree) -> list[S]:
        if len(waiting) <= self.match_budget:
            self._known.clear()
            cached = {id(r): self.cached_lengths.get(r, tree) for r in waiting}
            return sorted(waiting, key=lambda r: (-cached[id(r)], r.arrival_time))
        known = self._known
        waiting_ids = {id(r) for r in waiting}
        for key in [k for k, (r, _) in known.items() if k not in waiting_ids]:
            del known[key]
        # Sorted by arrival once; the filters below keep that order (and a stable sort's
        # order of equals), so each is what sorting its part alone gave.
        by_arrival = sorted(waiting, key=_ARRIVAL)
        new = [r for r in by_arrival if known.get(id(r), _UNKNOWN)[0] is not r]
        refresh = new[: self.match_budget]
        refresh += [r for r, _ in list(known.values())[: self.match_budget - len(refresh)]]
        for r in refresh:
            known.pop(id(r), None)
            known[id(r)] = (r, self.cached_lengths.get(r, tree))  # re-inserted: now the freshest
        return self._by_known_length(by_arrival)

    def _by_known_length(self, by_arrival: list[S]) -> list[S]:
        """`by_arrival` by known cached length, longest first, arrival order among equals.
        Requests known to have a cached prefix are few (at most `match_budget` more each
        ordering) and sorted apart; the rest (length 0 or unknown) keep their arrival order:
        the same order as one sort by (-length, arrival), without a Python key per request."""
        known = self._known
        cached = [r for r in by_arrival if known.get(id(r), _UNKNOWN)[1] > 0]
        cached.sort(key=lambda r: -known[id(r)][1])  # stable: arrival order among equals
        return cached + [r for r in by_arrival if known.get(id(r), _UNKNOWN)[1] == 0]


class DFSWeight(SchedulePolicy):
    """Depth-first over the trie of waiting prompts: cached subtrees first, then heaviest.

    Requests that share a prefix end up adjacent, so the first of them computes the shared
    part and the rest hit it. A subtree whose prefix is already cached goes first (it costs
    least and would otherwise risk eviction before its turn); among equally cached subtrees
    the heavier one goes first, because it amortises more. Ordering by weight alone jumps to
    an uncached group as soon as one request of the current group is admitted (the hit rates
    of both orders: docs/benchmark.md). Lexicographic
    order of the prompts is a DFS order of their trie, and the longest common prefix of
    neighbours in that order gives the trie's branching points without building it.
    """

    def _order(self, waiting: list[S], tree: RadixTree) -> list[S]:
        if len(waiting) < 2:
            return list(waiting)
        # Big-endian bytes of non-negative ids sort like the id sequences themselves.
        items = sorted(waiting, key=lambda r: (repr(r.namespace), r.prompt_ids.astype(">i4").tobytes()))
        cached = [self.cached_lengths.get(r, tree) for r in items]
        # lcp[i] = shared prefix length of items[i-1] and items[i]; -1 across namespaces.
        lcp = [-1] + [_common_prefix(a, b) for a, b in zip(items, items[1:])]
        out: list[S] = []
        self._visit(items, cached, lcp, 0, len(items), out)
        return out

    def _visit(self, items: list[S], cached: list[int], lcp: list[int], lo: int, hi: int,
               out: list[S]) -> None:
        if hi - lo == 1:
            out.append(items[lo])
            return
        split = min(lcp[lo + 1:hi])
        children: list[tuple[int, int]] = []
        start = lo
        for i in range(lo + 1, hi):
            if lcp[i] == split:
                children.append((start, i))
                start = i
        children.append((start, hi))
        children.sort(key=lambda c: (-max(cached[c[0]:c[1]]), -(c[1] - c[0]), c[0]))
        for c_lo, c_hi in children:
            self._visit(items, cached, lcp, c_lo, c_hi, out)


def _common_prefix(a: Schedulable, b: Schedulable) -> int:
    if a.namespace != b.namespace:
        return -1
    return common_prefix_len(a.prompt_ids, b.prompt_ids)


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays, compared at C speed."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


POLICIES: dict[str, type[SchedulePolicy]] = {
    "fcfs": FCFS,
    "lpm": LongestPrefixMatch,
    "dfs-weight": DFSWeight,
}


def make_schedule_policy(name: str, *, max_wait_s: float = 30.0) -> SchedulePolicy:
    """Builds a scheduling policy by name: one of `POLICIES`."""
    try:
        return POLICIES[name](max_wait_s)
    except KeyError:
        raise ValueError(f"unknown schedule policy {name!r}; choose from {sorted(POLICIES)}") from None
