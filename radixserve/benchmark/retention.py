"""Retention rules: which retention priority each cached page gets when a request inserts it.

The tree's eviction order is (effective page priority, recency), so the priority a page is
inserted with *is* the eviction policy above plain LRU. A rule sees the request and how many
of its prompt tokens hit the cache, and returns the tree's `range_retention` entries. These
are the policies the benchmark compares; the engine can apply the same rule where it calls
`RadixTree.insert`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from radixserve.benchmark.workloads import BenchRequest
from radixserve.cache.adaptive import AdaptiveReuse, LeadDuel
from radixserve.cache.radix import RadixTree
from radixserve.cache.retention import Retention
from radixserve.cache.reuse import REUSED_RETENTION, ReuseHistory

RetentionRanges = list[tuple[int, int, Retention]]


class RetentionRule(ABC):
    """Maps an insert to `range_retention` entries for `RadixTree.insert`."""

    name: ClassVar[str]

    def bind(self, tree: RadixTree) -> None:
        """Called once with the simulated server's tree, before any request (a rule that
        reads the cache, such as the adaptive one, keeps it)."""

    def observe(self, request: BenchRequest) -> None:
        """Called when `request` arrives at the server (the engine's `add_request`)."""

    @abstractmethod
    def ranges(self, request: BenchRequest, hit_tokens: int) -> RetentionRanges:
        """Retention ranges (token offsets into the inserted sequence) for this request."""


class DefaultRetention(RetentionRule):
    """Every page at the default priority: the tree's policy alone decides."""

    name = "default"

    def ranges(self, request: BenchRequest, hit_tokens: int) -> RetentionRanges:
        return []


class SharedPrefixRetention(RetentionRule):
    """The workload's marked shared prefix (system prompt, few-shot examples) is kept at a
    higher priority: the usual manual retention setting."""

    name = "system-prompt"

    def __init__(self, priority: int = 80) -> None:
        self.retention = Retention(priority)

    def ranges(self, request: BenchRequest, hit_tokens: int) -> RetentionRanges:
        return [(0, request.shared_len, self.retention)] if request.shared_len else []


class TailDemotion(RetentionRule):
    """The last `tail_tokens` of each prompt stay at the default priority while the body is
    raised, so request-specific tails (the question after a shared document) go first: on
    traces with shared documents a prompt's last page is reused far less often than the
    pages before it (docs/benchmark.md).
    """

    name = "tail-demotion"

    def __init__(self, tail_tokens: int = 512, body_priority: int = 50) -> None:
        self.tail_tokens = tail_tokens
        self.retention = Retention(body_priority)

    def ranges(self, request: BenchRequest, hit_tokens: int) -> RetentionRanges:
        body = request.prompt_len - self.tail_tokens
        return [(0, body, self.retention)] if body > 0 else []


class HitBoost(RetentionRule):
    """Pages that were hit are raised (a two-level frequency policy, like SLRU's protected
    segment); `duration_s` lets the protection lapse so stale hits do not pin the cache."""

    name = "hit-boost"

    def __init__(self, priority: int = 60, duration_s: float | None = 120.0) -> None:
        self.retention = Retention(priority, duration_s)

    def ranges(self, request: BenchRequest, hit_tokens: int) -> RetentionRanges:
        return [(0, hit_tokens, self.retention)] if hit_tokens else []


class ReuseBoost(RetentionRule):
    """Two-level frequency with a ghost history (SLRU/2Q with a ghost list, per page), plus
    declared reuse.

    Pages whose prefix was already seen within the last `window_pages` page insertions
    (hit, or cached earlier and evicted since) are raised to `priority`; pages seen for
    the first time stay at the default and are evicted first. The history outlives
    eviction, which is what a tree-local hit counter lacks: without it a reused document
    that was evicted once looks new again. Pages are identified by a 64-bit hash of their
    whole prefix. A request that belongs to a session (`client_id >= 0`: a chat or agent
    that will send its next turn) has declared its reuse: all its pages are raised, so
    the fresh tail its next turn needs is not the first to go.
    """

    name = "reuse-boost"

    def __init__(self, page_size: int, window_pages: int, priority: int = REUSED_RETENTION.priority, *,
                 boost_sessions: bool = True) -> None:
        self.page_size = page_size
        self.window_pages = window_pages
        self.retention = Retention(priority)
        self.boost_sessions = boost_sessions
        self._history = ReuseHistory(page_size, window_pages)
        self._seen_pages: dict[int, int] = {}

    def observe(self, request: BenchRequest) -> None:
        """Looks the prompt up in the history on arrival, as the engine does."""
        if request.index not in self._seen_pages:
            self._seen_pages[request.index] = self._history.observe(request.prompt_ids)

    def ranges(self, request: BenchRequest, hit_tokens: int) -> RetentionRanges:
        self.observe(request)  # a no-op once observed on arrival
        seen = self._seen_pages[request.index]
        if self.boost_sessions and request.client_id >= 0:
            reply = 0 if request.output_ids is None else len(request.output_ids)
            return [(0, request.prompt_len + reply, self.retention)]
        return [(0, seen * self.page_size, self.retention)] if seen else []


class AdaptiveBoost(ReuseBoost):
    """The engine's default rule (cache/adaptive.py) in the simulator: the pages reuse-boost
    would raise are boosted instead — a lead in recency that the tree's `adaptive` policy
    learns from ghost hits, so they age out — and a session's turn (declared reuse) is
    boosted whole. Needs `bind` (the simulated server calls it) to see the tree."""

    name = "adaptive"

    def __init__(self, page_size: int, window_pages: int, *, boost_sessions: bool = True) -> None:
        super().__init__(page_size, window_pages, boost_sessions=boost_sessions)
        self.retention = AdaptiveReuse.retention
        self._adaptive: AdaptiveReuse | None = None
        self._cluster_seen: dict[int, int] = {}  # request index -> the cluster's count (`expect`)

    def bind(self, tree: RadixTree) -> None:
        self._adaptive = AdaptiveReuse(tree, self.window_pages)

    @property
    def duel(self) -> LeadDuel | None:
        """The lead duel of the tree it is bound to (None before `bind`)."""
        return self._adaptive.duel if self._adaptive is not None else None

    def expect(self, request: BenchRequest, cluster_seen: int) -> None:
        """The cluster's count of `request`'s leading pages seen recently (the router's
        history of every replica's traffic: cache/adaptive.py), used when it arrives."""
        self._cluster_seen[request.index] = cluster_seen

    def elsewhere(self, request: BenchRequest) -> None:
        """The router sent `request` to another replica because this one, which served the
        leading pages of it the cluster saw last, had lost them (cache/adaptive.py)."""
        if self._adaptive is None:
            raise RuntimeError("AdaptiveBoost: bind it to the tree first")
        self._adaptive.elsewhere(request.prompt_ids, None)

    def observe(self, request: BenchRequest) -> None:
        if request.index in self._seen_pages:
            return
        if self._adaptive is None:
            raise RuntimeError("AdaptiveBoost: bind it to the tree first")
        session = self.boost_sessions and request.client_id >= 0
        self._seen_pages[request.index] = self._adaptive.observe(
            request.prompt_ids, boost_all=session, cluster_seen=self._cluster_seen.pop(request.index, None))


class Combined(RetentionRule):
    """Applies several rules; the tree keeps the highest retention per page."""

    name = "combined"

    def __init__(self, *rules: RetentionRule) -> None:
        self.rules = rules

    def ranges(self, request: BenchRequest, hit_tokens: int) -> RetentionRanges:
        return [entry for rule in self.rules for entry in rule.ranges(request, hit_tokens)]
