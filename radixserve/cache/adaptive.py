"""The adaptive retention rule: how long re-seen prefixes are kept, learned from the cache's
own traffic.

Reuse-boost (reuse.py) raises every page whose prefix was seen recently to a higher
priority for good: small caches gain (one-off prompts go first), large ones lose (re-seen
conversations that are over pin the cache while the live ones' new turns go first). The
adaptive rule keeps the recognition but changes what it buys: a re-seen page is *boosted*
(`Retention.boost`), and the `adaptive` eviction policy (eviction.py) orders a boosted page
as if it had been used `lead` ticks later than it was. A finite lead lets boosted pages age
out; `lead = 0` is plain LRU, an unbounded one reuse-boost. Explicit priorities are
untouched: the boost only reorders pages of equal priority.

The lead is learned from ghost caches, the way ARC (Megiddo and Modha) sizes its segments
from ghost lists and set dueling picks a cache's insertion policy: `LeadDuel` keeps, for each
lead of a geometric ladder (`LEADS`: 0, 8^k ticks, unbounded), a ghost cache — page-prefix
hashes only, no KV — of a spatially hashed sample of the pages (SHARDS, Waldspurger et al.:
pages whose hash falls in 1/R of the space, in a cache of 1/R the size). Every prompt's
sampled pages go through every ghost cache; each counts its hits, decayed so that recent
traffic counts most (a sampled page counts only while every sampled page before it in the
prompt hit too: a prefix cache hits prefixes). The tree uses the lead whose ghost cache hits
most, with hysteresis: it leaves LRU only when that one beats LRU's ghost cache by 5% and
two standard deviations of the sampling noise (the ghost caches are flat and sampled, an
approximation of the tree: the rule leaves LRU only when its own traffic says clearly that
another lead is better), and moves from another lead (back to LRU included) only when the
winner beats it by two standard deviations. A guard watches the tree itself: while it uses
another lead, its own hits on the sampled pages (peeked at arrival) are compared with LRU's
ghost cache, and it returns to LRU as soon as LRU's would have hit more by two standard
deviations (the ghost caches' model of the tree can be wrong; this check is not a model). What makes a lead better is measured, not tuned: no constant here is a property
of a workload (the ladder spans every lead, the margin and decay are statistical).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from radixserve.cache.retention import Retention
from radixserve.cache.reuse import ReuseHistory

if TYPE_CHECKING:  # radix.py imports this module (through eviction.py)
    from radixserve.cache.radix import RadixTree

REUSE_BOOST = Retention(boost=True)  # what a re-seen prefix gets under the adaptive rule
UNBOUNDED = 1e15  # a lead no tick count reaches (reuse-boost's order), exact in a float64
LEADS = (0.0, *(float(8 ** k) for k in range(1, 6)), UNBOUNDED)  # 0, 8 .. 32,768 ticks, unbounded
MIN_GHOST_PAGES = 256   # sample fewer pages only while each ghost cache keeps at least this many
MAX_SAMPLE_RATE = 32    # at most 1 page in 32 sampled
DECAY_TURNOVERS = 2     # hit counts halve after this many ghost-cache capacities of accesses
SWITCH_SIGMAS = 2.0     # another lead must out-hit the current one by two standard deviations
MODEL_MARGIN = 0.05     # ... and LRU by 5% more: a flat sampled ghost cache only approximates the tree


class GhostCache:
    """A page-hash cache of `capacity` entries ordered as the adaptive policy would with
    `lead`: key = last use tick, plus the lead for a boosted page. Counts its hits."""

    def __init__(self, capacity: int, lead: float) -> None:
        self.capacity = capacity
        self.lead = lead
        self.hits = 0.0
        self._keys: dict[int, float] = {}
        self._boosted: set[int] = set()
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._keys)

    def access(self, page: int, tick: int, boost: bool, countable: bool) -> bool:
        """A prompt uses `page` at `tick` (boosted from now on with `boost`); returns whether
        it was cached, and counts a hit if so and `countable` (the pages before it hit too)."""
        keys = self._keys
        present = page in keys
        if present and countable:
            self.hits += 1
        if boost:
            self._boosted.add(page)
        key = tick + self.lead if boost or page in self._boosted else float(tick)
        keys[page] = key
        heap = self._heap
        heapq.heappush(heap, (key, page))
        while len(keys) > self.capacity:
            old_key, old = heapq.heappop(heap)
            if keys.get(old) == old_key:
                del keys[old]
                self._boosted.discard(old)
        if len(heap) > 4 * self.capacity + 64:  # drop superseded entries: bounded state
            self._heap = [(k, p) for p, k in keys.items()]
            heapq.heapify(self._heap)
        return present


class LeadDuel:
    """Ghost caches for every lead of `LEADS` over a hashed sample of the pages of a cache of
    `cache_pages`; `lead` is the winner's (see the module docstring)."""

    def __init__(self, cache_pages: int) -> None:
        self.sample_rate = int(max(1, min(MAX_SAMPLE_RATE, cache_pages // MIN_GHOST_PAGES)))
        capacity = max(1, cache_pages // self.sample_rate)
        self.ghosts = [GhostCache(capacity, lead) for lead in LEADS]
        self.current = 0  # index into LEADS: start as LRU
        self._accesses = 0
        self._decay_every = DECAY_TURNOVERS * capacity
        self.switches = 0
        self.real_hits = 0.0  # the tree's own hits on the sampled pages, decayed alike

    @property
    def lead(self) -> float:
        """The lead the tree should use now."""
        return LEADS[self.current]

    def observe(self, hashes: list[int], boosted: int, tick: int, cached: int) -> bool:
        """A prompt with these page hashes, its first `boosted` pages boosted, of which the
        tree holds the first `cached`, arrives at `tick`; returns whether the lead changed."""
        rate = self.sample_rate
        sampled = [(h, i < boosted) for i, h in enumerate(hashes) if h % rate == 0]
        if not sampled:
            return False
        self.real_hits += sum(1 for i, h in enumerate(hashes[:cached]) if h % rate == 0)
        for ghost in self.ghosts:
            leading = True  # a prefix cache hits a page only if every page before it hits
            for h, boost in sampled:
                leading = ghost.access(h, tick, boost, leading) and leading
        self._accesses += len(sampled)
        if self._accesses >= self._decay_every:
            self._accesses = 0
            for ghost in self.ghosts:
                ghost.hits /= 2
            self.real_hits /= 2
        hits = [g.hits for g in self.ghosts]
        if self.current != 0 and self._beats([hits[0], self.real_hits], 0, 1, 0.0):
            self.current = 0  # the tree itself hits less than LRU would: back to LRU
            self.switches += 1
            return True
        # Most hits; the longer lead on ties: leads longer than the history so far tie, and the
        # longest is the one that stays right as the history grows.
        best = max(range(len(hits)), key=lambda i: (hits[i], i))
        if self.current == 0 and not self._beats(hits, best, 0, MODEL_MARGIN):
            return False  # not clearly better than LRU: stay LRU
        if best != self.current and self._beats(hits, best, self.current, 0.0):
            self.current = best
            self.switches += 1
            return True
        return False

    @staticmethod
    def _beats(hits: list[float], a: int, b: int, margin: float) -> bool:
        """Whether ghost cache `a` hit more than `b` by the relative `margin` plus two standard
        deviations of the sampling noise (Poisson counts: the difference of counts x and y
        has a standard deviation of about sqrt(x + y))."""
        return hits[a] - hits[b] * (1 + margin) > SWITCH_SIGMAS * math.sqrt(hits[a] + hits[b])


class LeadLearner:
    """The lead the `adaptive` eviction policy reads (0 until a duel is attached), and an
    epoch that changes with it: eviction queues re-key their entries when it does."""

    def __init__(self) -> None:
        self.lead = 0.0
        self.epoch = 0
        self.latest_tick = 0  # the largest tick the policy keyed: the tree's clock, roughly

    def saw_tick(self, tick: int) -> None:
        """The policy keyed a leaf with this tick."""
        if tick > self.latest_tick:
            self.latest_tick = tick

    def set_lead(self, lead: float) -> None:
        """Switches to `lead` (a new epoch if it changed)."""
        if lead != self.lead:
            self.lead = lead
            self.epoch += 1


class AdaptiveReuse:
    """The adaptive rule's arrival hook, as the engine and the simulator call it: looks a
    prompt up in the reuse history (its leading pages seen recently will be boosted:
    `retention`), runs it through the lead duel, and hands the winning lead to the learner
    of the tree's `adaptive` policy. Same interface as ReuseHistory."""

    retention = REUSE_BOOST

    def __init__(self, tree: RadixTree, window_pages: int) -> None:
        self.tree = tree
        self.page_size: int = tree.page_size
        cache_pages = tree.pool.num_pages + (tree.host.pool.num_pages if tree.host is not None else 0)
        self.history = ReuseHistory(self.page_size, window_pages)
        self.duel = LeadDuel(cache_pages)
        self.learner: LeadLearner = getattr(tree.policy, "learner", None) or LeadLearner()

    def observe(self, tokens: np.ndarray, namespace: Hashable = None, *, boost_all: bool = False) -> int:
        """Leading pages of `tokens` seen recently (all of them boosted with `boost_all`: a
        session's turn, declared reuse); teaches the tree's policy the lead."""
        hashes = self.history.hashes(tokens, namespace)
        seen = self.history.observe_hashes(hashes)
        cached = self.tree.match(tokens, namespace, update=False).cached_tokens // self.page_size
        if self.duel.observe(hashes, len(hashes) if boost_all else seen, self.learner.latest_tick, cached):
            self.learner.set_lead(self.duel.lead)
        return seen
