"""What eviction rules can reach on the Mooncake trace with one cache of 8.5M tokens (issue 23's
0.5M + 8M target, as one cache), in a page model fast enough to try many rules.

The model: the trace's 512-token blocks are pages (a request's full blocks only, as the tree
caches), one request at a time in arrival order, a hit is the unbroken prefix of cached pages
(token-weighted, over all input tokens, as the trace README counts). The cache evicts leaves
only — a page whose child page is cached stays — as the radix tree does, and among leaves
the smallest key. Each rule is a key: `last use + lead` in requests, with a rule-specific
lead per page. S3-FIFO keeps its own queues (a flat cache, no leaf rule). Oracles that read
the future are included to show where the gap lies; the measured rules see only the past.

This is a model, not the tree: LRU here is 55.36% against the simulator's 55.36% for one
8.5M cache, reuse-boost 57.97% against 58.04%. Figures: docs/benchmark.md, issue-23 section.

    python bench/trace_policy_ceiling.py [--capacity-tokens 8500000]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK = 512
NEVER = 10**9  # the next use of a page never used again


class Trace:
    """The trace as page sequences: each prompt's full blocks, each block's parent block, the
    input tokens (the denominator), and for each page access the request of its next use."""

    def __init__(self, path: Path = TRACE) -> None:
        rows = sorted((json.loads(line) for line in path.open()), key=lambda r: r["timestamp"])
        self.prompts: list[list[int]] = [r["hash_ids"][: r["input_length"] // BLOCK] for r in rows]
        self.input_tokens = sum(r["input_length"] for r in rows)
        self.parent: dict[int, int | None] = {}
        for r in rows:
            for i, h in enumerate(r["hash_ids"]):
                self.parent[h] = r["hash_ids"][i - 1] if i else None
        self.next_use: list[list[int]] = [[NEVER] * len(p) for p in self.prompts]
        later: dict[int, int] = {}
        for t in range(len(self.prompts) - 1, -1, -1):
            for i, h in enumerate(self.prompts[t]):
                self.next_use[t][i] = later.get(h, NEVER)
                later[h] = t


class KeyRule:
    """A rule as a key: `observe` sees each prompt before its pages are keyed, `lead` gives a
    page's lead over its last use (in requests; -inf: evict first)."""

    def observe(self, t: int, prompt: list[int]) -> None:
        """Request `t` arrives with `prompt` (its pages are keyed right after)."""

    def lead(self, t: int, i: int, page: int) -> float:
        """The lead of page `page`, the `i`-th of request `t`'s prompt."""
        return 0.0


def replay(trace: Trace, capacity_pages: int, rule: KeyRule) -> float:
    """The hit rate of `rule` in a leaf-evicting cache of `capacity_pages` pages."""
    key: dict[int, float] = {}
    children: dict[int, int] = {}
    heap: list[tuple[float, int]] = []
    hit_tokens = 0
    for t, prompt in enumerate(trace.prompts):
        hits = 0
        while hits < len(prompt) and prompt[hits] in key:
            hits += 1
        hit_tokens += hits * BLOCK
        rule.observe(t, prompt)
        for i, page in enumerate(prompt):
            if page not in key:
                children[page] = 0
                parent = trace.parent[page]
                if parent is not None and parent in key:
                    children[parent] += 1
            key[page] = t + rule.lead(t, i, page)
        for page in prompt:
            if children[page] == 0:
                heapq.heappush(heap, (key[page], page))
        while len(key) > capacity_pages:
            k, page = heapq.heappop(heap)
            if key.get(page) != k or children[page]:
                continue  # superseded, or no longer a leaf
            del key[page], children[page]
            parent = trace.parent[page]
            if parent is not None and parent in key:
                children[parent] -= 1
                if children[parent] == 0:
                    heapq.heappush(heap, (key[parent], parent))
        if len(heap) > 4 * capacity_pages:
            heap = [(k, p) for p, k in key.items() if children[p] == 0]
            heapq.heapify(heap)
    return hit_tokens / trace.input_tokens


class ReseenLead(KeyRule):
    """Pages of a prompt's prefix seen before (within `window` page accesses) get `lead`; with
    `whole_prompt` every page of a prompt with such a prefix does (a hit on an ancestor
    counts for its descendants)."""

    def __init__(self, lead: float, window: int, whole_prompt: bool = False) -> None:
        self.lead_, self.window, self.whole_prompt = lead, window, whole_prompt
        self.last: dict[int, int] = {}
        self.boosted: set[int] = set()
        self.clock = 0

    def observe(self, t: int, prompt: list[int]) -> None:
        seen = 0
        while seen < len(prompt) and self.clock - self.last.get(prompt[seen], -self.window) < self.window:
            seen += 1
        self.clock += len(prompt)
        for i, page in enumerate(prompt):
            self.last[page] = self.clock
            if i < seen or (self.whole_prompt and seen):
                self.boosted.add(page)

    def lead(self, t: int, i: int, page: int) -> float:
        return self.lead_ if page in self.boosted else 0.0


class FrequencyLead(KeyRule):
    """`lead` per use beyond the first, at most `max_uses` of them (uses remembered forever)."""

    def __init__(self, lead: float, max_uses: int) -> None:
        self.lead_, self.max_uses = lead, max_uses
        self.uses: Counter[int] = Counter()

    def observe(self, t: int, prompt: list[int]) -> None:
        self.uses.update(prompt)

    def lead(self, t: int, i: int, page: int) -> float:
        return self.lead_ * min(self.uses[page] - 1, self.max_uses)


class GapLead(KeyRule):
    """A re-seen page keeps `factor` times the largest gap between its uses so far (a page
    idle for much longer than it ever was is likely dead)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.last: dict[int, int] = {}
        self.gap: dict[int, int] = {}

    def observe(self, t: int, prompt: list[int]) -> None:
        for page in prompt:
            if page in self.last:
                self.gap[page] = max(self.gap.get(page, 0), t - self.last[page])
            self.last[page] = t

    def lead(self, t: int, i: int, page: int) -> float:
        return self.factor * self.gap[page] if page in self.gap else 0.0


def size_class(prompt: list[int]) -> int:
    """A prompt's size class: log2 of its pages."""
    return int(math.log2(max(len(prompt), 1)))


class ClassRateLead(KeyRule):
    """Re-seen pages (any earlier use) get `reseen_lead`; a first-seen page `lead` times a
    reuse rate of its prompt's size class, by `estimate`:
    - "future" (an oracle): the share of the class's first-seen pages the whole trace reuses;
    - "arrivals": the share of the class's arriving pages that were re-seen, so far;
    - "relative": the share of the class's first-seen pages re-seen so far, over twice that
      share for all classes (at most 1): how much likelier than average its pages come back.
    """

    def __init__(self, trace: Trace, lead: float, reseen_lead: float, estimate: str) -> None:
        self.lead_, self.reseen_lead, self.estimate = lead, reseen_lead, estimate
        self.uses: Counter[int] = Counter()
        self.page_class: dict[int, int] = {}
        self.arrived: Counter[int] = Counter()
        self.reseen: Counter[int] = Counter()
        self.first: Counter[int] = Counter()
        self.first_reused: Counter[int] = Counter()
        self.future: dict[int, float] = self._future_rates(trace) if estimate == "future" else {}

    @staticmethod
    def _future_rates(trace: Trace) -> dict[int, float]:
        seen: set[int] = set()
        first: Counter[int] = Counter()
        reused: Counter[int] = Counter()
        for t, prompt in enumerate(trace.prompts):
            for i, page in enumerate(prompt):
                if page not in seen:
                    first[size_class(prompt)] += 1
                    reused[size_class(prompt)] += trace.next_use[t][i] < NEVER
            seen.update(prompt)
        return {c: reused[c] / first[c] for c in first}

    def observe(self, t: int, prompt: list[int]) -> None:
        c = size_class(prompt)
        self.arrived[c] += len(prompt)
        for page in prompt:
            uses = self.uses[page]
            if not uses:
                self.page_class[page] = c
                self.first[c] += 1
            else:
                self.reseen[c] += 1
                if uses == 1:
                    self.first_reused[self.page_class[page]] += 1
        self.uses.update(prompt)

    def _rate(self, c: int) -> float:
        if self.estimate == "future":
            return self.future.get(c, 0.0)
        if self.estimate == "arrivals":
            return self.reseen[c] / self.arrived[c]
        mean = sum(self.first_reused.values()) / sum(self.first.values())
        return min(1.0, self.first_reused[c] / self.first[c] / (2 * mean)) if mean else 0.0

    def lead(self, t: int, i: int, page: int) -> float:
        if self.uses[page] > 1:
            return self.reseen_lead
        return self.lead_ * self._rate(self.page_class[page])


class Belady(KeyRule):
    """The offline optimum: the page used again last goes first."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def lead(self, t: int, i: int, page: int) -> float:
        return -self.trace.next_use[t][i] - t


class DeadFirst(KeyRule):
    """LRU plus `reseen_lead` for re-seen pages, except that pages never used again (the
    future) go first, among `which` pages: "all", "first-seen" or "re-seen" ones."""

    def __init__(self, trace: Trace, which: str, reseen_lead: float = 0.0) -> None:
        self.trace, self.which, self.reseen_lead = trace, which, reseen_lead
        self.uses: Counter[int] = Counter()

    def observe(self, t: int, prompt: list[int]) -> None:
        self.uses.update(prompt)

    def lead(self, t: int, i: int, page: int) -> float:
        reseen = self.uses[page] > 1
        applies = self.which == "all" or (self.which == "re-seen") == reseen
        if applies and self.trace.next_use[t][i] == NEVER:
            return -math.inf
        return self.reseen_lead if reseen else 0.0


def s3fifo(trace: Trace, capacity_pages: int, small_share: float, ghost_share: float) -> float:
    """S3-FIFO (Yang et al., SOSP 2023), flat (no leaf rule): new pages enter a small FIFO and
    leave it for a ghost list unless used again there; a ghost hit enters the main FIFO, which
    gives pages used since their last pass another round (up to 3). A prompt's pages enter
    deepest first, so that a queue drops a prompt's tail before its prefix."""
    small: OrderedDict[int, None] = OrderedDict()
    main: OrderedDict[int, None] = OrderedDict()
    ghost: OrderedDict[int, None] = OrderedDict()
    freq: dict[int, int] = {}
    small_cap = max(1, int(capacity_pages * small_share))
    main_cap, ghost_cap = capacity_pages - small_cap, int(capacity_pages * ghost_share)

    def evict_main() -> None:
        while True:
            page, _ = main.popitem(last=False)
            if freq[page] > 0:
                freq[page] -= 1
                main[page] = None
            else:
                del freq[page]
                return

    def evict_small() -> None:
        while small:
            page, _ = small.popitem(last=False)
            if freq[page] > 0:
                freq[page] = 0
                main[page] = None
                while len(main) > main_cap:
                    evict_main()
            else:
                del freq[page]
                ghost[page] = None
                while len(ghost) > ghost_cap:
                    ghost.popitem(last=False)
                return

    hit_tokens = 0
    for prompt in trace.prompts:
        hits = 0
        while hits < len(prompt) and (prompt[hits] in small or prompt[hits] in main):
            hits += 1
        hit_tokens += hits * BLOCK
        for page in reversed(prompt):  # a prompt's deepest page enters first, so leaves first
            if page in small or page in main:
                freq[page] = min(freq[page] + 1, 3)
            elif page in ghost:
                del ghost[page]
                freq[page] = 0
                main[page] = None
                while len(main) > main_cap:
                    evict_main()
            else:
                freq[page] = 0
                small[page] = None
                while len(small) > small_cap:
                    evict_small()
    return hit_tokens / trace.input_tokens


def lhd_class(uses: int, prompt: list[int]) -> int:
    """LHD's class of a page: its uses so far (1, 2, 3 or more: remembered after it leaves)
    and its prompt's size class (log2 of its pages, at most 15)."""
    return 16 * (min(uses, 3) - 1) + min(size_class(prompt), 15)


def lhd(trace: Trace, capacity_pages: int, samples: int = 64, ghost: bool = False, seed: int = 0) -> float:
    """LHD (hit density, Beckmann et al., NSDI 2018) in the leaf-evicting cache: each page's
    expected hits per unit of space-time at its age, from what its class (`lhd_class`) did
    so far: hits and evictions counted per class and age (age since last use, in 1/32 of a
    cache turnover of page accesses, 256 ages), the density at age a being the hits after
    age a over the space-time (events times ages) after it, re-estimated every cache's worth
    of page accesses with older counts decayed by 0.9 (the paper's EWMA). An eviction takes
    the lowest density among `samples` random leaves (the oldest on ties). With `ghost`, a
    page that comes back after its eviction turns that eviction into a hit at its reuse age
    (the class's reuse ages beyond what the cache keeps, which LHD alone never sees)."""
    ages, width = 256, max(1, capacity_pages // 32)
    hits, ends = np.zeros((64, ages)), np.zeros((64, ages))
    density = np.zeros((64, ages))
    last: dict[int, int] = {}
    klass: dict[int, int] = {}
    uses: Counter[int] = Counter()
    gone: dict[int, tuple[int, int, int]] = {}
    children: dict[int, int] = {}
    leaves: list[int] = []
    where: dict[int, int] = {}
    rng = random.Random(seed)
    clock = since = hit_tokens = 0

    def age(page: int) -> int:
        return min((clock - last[page]) // width, ages - 1)

    def add_leaf(page: int) -> None:
        if page not in where:
            where[page] = len(leaves)
            leaves.append(page)

    def drop_leaf(page: int) -> None:
        i = where.pop(page, None)
        if i is not None:
            moved = leaves.pop()
            if moved != page:
                leaves[i], where[moved] = moved, i

    for prompt in trace.prompts:
        cached = 0
        while cached < len(prompt) and prompt[cached] in last:
            cached += 1
        hit_tokens += cached * BLOCK
        for page in prompt:
            clock += 1
            since += 1
            if page in last:
                hits[klass[page], age(page)] += 1
            else:
                if ghost and page in gone:
                    c, a, used = gone.pop(page)
                    ends[c, a] -= 1
                    hits[c, min((clock - used) // width, ages - 1)] += 1
                children[page] = 0
                parent = trace.parent[page]
                if parent is not None and parent in last:
                    children[parent] += 1
                    drop_leaf(parent)
                add_leaf(page)
            uses[page] += 1
            last[page] = clock
            klass[page] = lhd_class(uses[page], prompt)
        while len(last) > capacity_pages:
            candidates = [leaves[rng.randrange(len(leaves))] for _ in range(samples)]
            victim = min(candidates, key=lambda p: (density[klass[p], age(p)], last[p]))
            ends[klass[victim], age(victim)] += 1
            if ghost:
                gone[victim] = (klass[victim], age(victim), last[victim])
            drop_leaf(victim)
            del last[victim], children[victim], klass[victim]
            parent = trace.parent[victim]
            if parent is not None and parent in last:
                children[parent] -= 1
                if children[parent] == 0:
                    add_leaf(parent)
        if since >= capacity_pages:
            since = 0
            after = np.cumsum((hits + ends)[:, ::-1], axis=1)[:, ::-1]     # events at age >= a
            space_time = np.cumsum(after[:, ::-1], axis=1)[:, ::-1]        # their ages beyond a
            hits_after = np.cumsum(hits[:, ::-1], axis=1)[:, ::-1]
            density = np.where(space_time > 0, np.maximum(hits_after, 0) / np.maximum(space_time, 1e-12), 0.0)
            hits *= 0.9
            ends *= 0.9
    return hit_tokens / trace.input_tokens


def rules(trace: Trace, capacity_pages: int) -> list[tuple[str, Callable[[], float]]]:
    """Every rule of the study, by name, as a function giving its hit rate."""
    window = 16 * capacity_pages  # the engine's reuse window
    keyed: list[tuple[str, Callable[[], KeyRule]]] = [("LRU", KeyRule)]
    keyed += [(f"re-seen lead {lead:g}", lambda lead=lead: ReseenLead(lead, window))
              for lead in (300, 1000, 3000)]
    keyed += [("reuse-boost (unbounded lead)", lambda: ReseenLead(1e15, window))]
    keyed += [(f"re-seen lead {lead:g}, whole prompt when its prefix is re-seen",
               lambda lead=lead: ReseenLead(lead, window, whole_prompt=True)) for lead in (1000, 3000)]
    keyed += [(f"lead {lead:g} per use, at most {most}", lambda lead=lead, most=most: FrequencyLead(lead, most))
              for lead in (300, 1000) for most in (2, 4)]
    keyed += [(f"re-seen: {factor:g} x its longest gap", lambda factor=factor: GapLead(factor))
              for factor in (2, 4, 8)]
    keyed += [(f"first-seen: size-class reuse rate ({estimate}), lead {lead:g}",
               lambda lead=lead, estimate=estimate: ClassRateLead(trace, lead, lead, estimate))
              for estimate in ("arrivals", "relative") for lead in (1000, 2000, 3000)]
    keyed += [(f"oracle: first-seen: size-class reuse rate (future), lead {lead:g}",
               lambda lead=lead: ClassRateLead(trace, lead, lead, "future")) for lead in (2000, 3000)]
    keyed += [("oracle: never-used-again first (all pages)", lambda: DeadFirst(trace, "all")),
              ("oracle: never-used-again first-seen pages first", lambda: DeadFirst(trace, "first-seen")),
              ("oracle: never-used-again re-seen pages first, lead 1000", lambda: DeadFirst(trace, "re-seen", 1000)),
              ("offline optimum (Belady)", lambda: Belady(trace))]
    out: list[tuple[str, Callable[[], float]]] = [
        (name, lambda make=make: replay(trace, capacity_pages, make())) for name, make in keyed]
    out += [(f"S3-FIFO, small {small:g}, ghost {g:g} (flat)", lambda small=small, g=g: s3fifo(trace, capacity_pages, small, g))
            for small in (0.1, 0.2, 0.4) for g in (1.0, 4.0)]
    out += [(f"LHD, {samples} samples{', ghost reuse ages' if ghost else ''}",
             lambda samples=samples, ghost=ghost: lhd(trace, capacity_pages, samples, ghost))
            for samples in (64, 8) for ghost in (False, True)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity-tokens", type=int, default=8_500_000)
    parser.add_argument("--only", default="", help="the rules whose name starts with this (default: all)")
    args = parser.parse_args()
    trace = Trace()
    capacity = args.capacity_tokens // BLOCK
    print(f"| rule ({args.capacity_tokens:,} tokens, {capacity:,} pages) | hit rate |\n|---|---|")
    for name, rate in rules(trace, capacity):
        if not name.startswith(args.only):
            continue
        print(f"| {name} | {100 * rate():.2f}% |", flush=True)


if __name__ == "__main__":
    main()
