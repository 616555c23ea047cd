"""Simulate mode: the real prefix cache and scheduling policies, with no model.

A `RadixTree` over a `PagePool(num_layers=0)` of `capacity_tokens // page_size` pages sees
exactly the match/lock/insert/evict calls a serving engine makes, so the hit rate it reports
is the cache's, not a model of it. Only compute is modelled, as a step cost
(`decode_step_s` per forward plus `1 / prefill_tokens_per_s` per prefilled token), to give
trace timestamps, waiting and aging a meaning.

Two loops:
- `sequential`: requests one at a time in arrival order, nothing else in memory (the setting
  of the Mooncake trace's reference figures).
- serving (default): continuous batching like the engine's scheduler. Each step running
  sequences get their next prefill chunk or decode token within `max_batch_tokens`, then
  waiting requests are admitted in the schedule policy's order: match (at most len-1
  tokens), lock, take pages (evicting if short), prefill in chunks, each chunk's full pages
  inserted and the lock moved there, decode. A request that shares a prefix with one still
  prefilling waits for it (in-batch sharing) unless it has aged. Pages for the prompt and
  the output are taken at admission, so nothing is ever preempted. A finished request
  inserts its prompt and, when the workload knows them, its reply tokens.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from radixserve.benchmark.retention import DefaultRetention, RetentionRule
from radixserve.benchmark.workloads import BenchRequest, Workload
from radixserve.cache.events import CacheEventHub
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixNode, RadixTree
from radixserve.engine.policy import common_prefix_len, make_policy


@dataclass
class SimConfig:
    """One simulated configuration."""

    capacity_tokens: int
    page_size: int = 16
    schedule_policy: str = "lpm"
    eviction_policy: str = "lru"
    retention: RetentionRule = field(default_factory=DefaultRetention)
    use_cache: bool = True
    sequential: bool = False
    max_running: int = 64
    max_batch_tokens: int = 8192
    prefill_tokens_per_s: float = 100_000.0
    decode_step_s: float = 0.02
    max_wait_s: float = 30.0

    @property
    def num_pages(self) -> int:
        """Pages in the simulated pool."""
        return self.capacity_tokens // self.page_size

    def label(self, retention_name: str | None = None) -> str:
        """Short name, e.g. "lpm/priority+reuse-boost" (`retention_name` overrides the rule's)."""
        if not self.use_cache:
            return "no-cache"
        mode = "sequential" if self.sequential else self.schedule_policy
        rule = retention_name or self.retention.name
        return f"{mode}/{self.eviction_policy}" + ("" if rule == DefaultRetention.name else f"+{rule}")


@dataclass
class SimResult:
    """Outcome of one simulated run. Times are simulated seconds except `wall_s`."""

    label: str
    config: SimConfig
    requests: int
    prompt_tokens: int
    hit_tokens: int
    skipped: int
    evicted_pages: int
    makespan_s: float
    ttft_s: np.ndarray
    per_request_hits: np.ndarray
    wall_s: float

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens (SGLang's definition)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary (no per-request arrays)."""
        ttft = self.ttft_s[~np.isnan(self.ttft_s)] if len(self.ttft_s) else self.ttft_s
        return {
            "label": self.label, "hit_rate": self.hit_rate, "hit_tokens": self.hit_tokens,
            "requests": self.requests, "prompt_tokens": self.prompt_tokens, "skipped": self.skipped,
            "schedule_policy": None if self.config.sequential else self.config.schedule_policy,
            "eviction_policy": self.config.eviction_policy, "retention": self.config.retention.name,
            "use_cache": self.config.use_cache, "sequential": self.config.sequential,
            "evicted_pages": self.evicted_pages, "sim_makespan_s": self.makespan_s,
            "sim_ttft_mean_s": float(ttft.mean()) if len(ttft) else None,
            "sim_ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
            "sim_ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
            "wall_s": self.wall_s,
        }


class _Waiting:
    """A released request in the waiting queue (the `Schedulable` the policies order)."""

    __slots__ = ("request", "prompt_ids", "namespace", "arrival_time", "priority")

    def __init__(self, request: BenchRequest, released_at: float) -> None:
        self.request = request
        self.prompt_ids = request.prompt_ids
        self.namespace: Hashable = None
        self.arrival_time = released_at
        self.priority = 0


class _Running:
    """A sequence holding pages: its block table, lock and progress."""

    __slots__ = ("request", "released_at", "pages", "lock_node", "locked_tokens", "computed",
                 "cached", "decode_left")

    def __init__(self, request: BenchRequest, released_at: float, pages: list[int],
                 lock_node: RadixNode | None, locked_tokens: int, cached: int) -> None:
        self.request = request
        self.released_at = released_at
        self.pages = pages
        self.lock_node = lock_node
        self.locked_tokens = locked_tokens
        self.computed = cached
        self.cached = cached
        self.decode_left = max(request.output_len, 1)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.request.prompt_len


class Simulator:
    """Runs one `SimConfig` over one workload; see the module docstring."""

    def __init__(self, workload: Workload, config: SimConfig, events: CacheEventHub | None = None) -> None:
        if config.num_pages < 1:
            raise ValueError(f"capacity_tokens: {config.capacity_tokens} holds no page of {config.page_size}")
        self.workload = workload
        self.config = config
        self.now = 0.0
        self.pool = PagePool(config.num_pages, config.page_size)
        self.tree = RadixTree(self.pool, eviction_policy=config.eviction_policy, clock=lambda: self.now,
                              events=events)
        self.policy = make_policy(config.schedule_policy, max_wait_s=config.max_wait_s)
        n = len(workload.requests)
        self.hits = np.zeros(n, dtype=np.int64)
        self.ttft = np.full(n, np.nan)
        self.skipped = 0
        self.waiting: list[_Waiting] = []
        self.running: list[_Running] = []

    def run(self) -> SimResult:
        """Simulates the whole workload and returns its result."""
        start = time.perf_counter()
        if self.config.sequential:
            self._run_sequential()
        else:
            self._run_serving()
        return SimResult(self.config.label(), self.config, len(self.workload.requests),
                         self.workload.prompt_tokens, int(self.hits.sum()), self.skipped,
                         int(self.tree.stats()["evicted_pages"]), self.now, self.ttft, self.hits,
                         time.perf_counter() - start)

    # ------------------------------------------------------------------ sequential
    def _run_sequential(self) -> None:
        size = self.config.page_size
        for request in sorted(self.workload.requests, key=lambda r: (r.arrival_time, r.index)):
            self.now = max(self.now, request.arrival_time)
            tokens = _inserted_tokens(request)
            pages, node, cached = self._take_prefix(request)
            needed = math.ceil(len(tokens) / size) - len(pages)
            if not self._make_room(needed):
                self._release(pages, node)
                self.skipped += 1
                continue
            pages += self.pool.allocate(needed)
            self.hits[request.index] = cached
            if self.config.use_cache:
                full = len(tokens) // size
                self.tree.insert(tokens[: full * size], pages[:full],
                                 range_retention=self.config.retention.ranges(request, cached))
            self._release(pages, node)

    # ------------------------------------------------------------------ serving
    def _run_serving(self) -> None:
        requests = self.workload.requests
        releases, dependents = release_plan(self.workload)
        while releases or self.waiting or self.running:
            while releases and releases[0][0] <= self.now:
                released_at, index = heapq.heappop(releases)
                self.waiting.append(_Waiting(requests[index], released_at))
            if not self.waiting and not self.running:
                self.now = releases[0][0]
                continue
            for ended in self.step(releases[0][0] if releases else None):
                self._finish_dependents(ended, dependents, releases)

    @property
    def busy(self) -> bool:
        """Whether requests wait or run (the serving loop has a step to take)."""
        return bool(self.waiting or self.running)

    def release(self, request: BenchRequest, released_at: float) -> None:
        """Hands a released request to the serving loop (a cluster's router calls this)."""
        if not self.busy:
            self.now = max(self.now, released_at)
        self.waiting.append(_Waiting(request, released_at))

    def step(self, next_release: float | None) -> list[BenchRequest]:
        """One serving step at `now` (waiting or running must not be empty); returns the
        requests that ended in it (finished, or skipped because they never fit)."""
        waiting, running, cfg = self.waiting, self.running, self.config
        budget = cfg.max_batch_tokens
        chunks: list[tuple[_Running, int]] = []
        for seq in running:  # admission order = arrival order of the running set
            if budget <= 0:
                break
            n = min(seq.request.prompt_len - seq.computed, budget) if seq.prefilling else 1
            chunks.append((seq, n))
            budget -= n
        blocked = False
        if budget > 0 and waiting and len(running) < cfg.max_running:
            admitted, blocked = self._admit(waiting, running, budget)
            chunks.extend(admitted)
        if not chunks:
            # Nothing runs and the first waiting request does not fit an empty cache.
            self.skipped += 1
            first = self.policy.order(waiting, self.tree, self.now)[0]
            waiting.remove(first)
            return [first.request]
        steps = 1
        if all(not seq.prefilling for seq, _ in chunks) and (
                not waiting or blocked or len(running) >= cfg.max_running):
            # Pure decode and nothing can be admitted: run until the next event at once.
            steps = min(seq.decode_left for seq in running)
            if next_release is not None:
                steps = min(steps, max(1, math.ceil((next_release - self.now) / cfg.decode_step_s)))
        prefill_tokens = sum(n for seq, n in chunks if seq.prefilling)
        self.now += steps * cfg.decode_step_s + prefill_tokens / cfg.prefill_tokens_per_s
        for seq, n in chunks:
            if seq.prefilling:
                seq.computed += n
                if not seq.prefilling:
                    self.ttft[seq.request.index] = self.now - seq.released_at
                    seq.decode_left -= 1
                if cfg.use_cache:
                    self._cache_computed(seq)
            else:
                seq.decode_left -= steps
        done = [seq for seq in running if seq.decode_left == 0]
        for seq in done:
            running.remove(seq)
            self._finish(seq)
        return [seq.request for seq in done]

    def _admit(self, waiting: list[_Waiting], running: list[_Running], budget: int
               ) -> tuple[list[tuple[_Running, int]], bool]:
        """Admits waiting requests in policy order; returns their first chunks and whether
        admission stopped for lack of memory."""
        cfg = self.config
        admitted: list[tuple[_Running, int]] = []
        taken: set[int] = set()
        blocked = False
        for item in self.policy.order(waiting, self.tree, self.now):
            if budget <= 0 or len(running) >= cfg.max_running:
                break
            request = item.request
            aged = self.now - item.arrival_time > self.policy.max_wait_s
            if cfg.use_cache and not aged and self._shares_prefill_in_flight(request, running):
                continue
            pages, node, cached = self._take_prefix(request)
            locked_tokens = len(pages) * cfg.page_size
            needed = math.ceil((request.prompt_len + max(request.output_len, 1)) / cfg.page_size) - len(pages)
            if not self._make_room(needed):
                self._release(pages, node)
                blocked = True
                break
            pages += self.pool.allocate(needed)
            self.hits[request.index] = cached
            seq = _Running(request, item.arrival_time, pages, node, locked_tokens, cached)
            running.append(seq)
            taken.add(id(item))
            n = min(request.prompt_len - cached, budget)
            admitted.append((seq, n))
            budget -= n
        if taken:
            waiting[:] = [w for w in waiting if id(w) not in taken]
        return admitted, blocked

    def _shares_prefill_in_flight(self, request: BenchRequest, running: list[_Running]) -> bool:
        """In-batch sharing, as the engine does: wait while a running sequence is still
        computing a prefix this request could hit once it is cached."""
        prompt = request.prompt_ids
        cached = self.tree.match(prompt[: len(prompt) - 1], update=False).num_tokens
        for other in running:
            if other.prefilling:
                shared = common_prefix_len(prompt[: len(prompt) - 1], other.request.prompt_ids)
                if shared >= cached + self.config.page_size:
                    return True
        return False

    def _cache_computed(self, seq: _Running) -> None:
        """Inserts the sequence's computed full prompt pages and moves its lock there; where
        the tree already held those tokens, switches to the tree's pages."""
        size = self.config.page_size
        full = seq.computed // size
        if full * size <= seq.locked_tokens:
            return
        tokens = seq.request.prompt_ids[: full * size]
        self.tree.insert(tokens, seq.pages[:full],
                         range_retention=self.config.retention.ranges(seq.request, seq.cached))
        match = self.tree.match(tokens, update=False)
        for i, page in enumerate(match.pages):
            if seq.pages[i] != page:
                self.pool.incref([page])
                self.pool.decref([seq.pages[i]])
                seq.pages[i] = page
        self.tree.lock(match.node)
        if seq.lock_node is not None:
            self.tree.unlock(seq.lock_node)
        seq.lock_node = match.node
        seq.locked_tokens = full * size

    def _finish(self, seq: _Running) -> None:
        request = seq.request
        if self.config.use_cache and request.output_ids is not None:
            tokens = _inserted_tokens(request)
            full = len(tokens) // self.config.page_size
            self.tree.insert(tokens[: full * self.config.page_size], seq.pages[:full],
                             range_retention=self.config.retention.ranges(request, seq.cached))
        self._release(seq.pages, seq.lock_node)

    def _finish_dependents(self, request: BenchRequest, dependents: dict[int, list[BenchRequest]],
                           releases: list[tuple[float, int]]) -> None:
        for child in dependents.pop(request.index, []):
            heapq.heappush(releases, (max(child.arrival_time, self.now), child.index))

    # ------------------------------------------------------------------ pages
    def _take_prefix(self, request: BenchRequest) -> tuple[list[int], RadixNode | None, int]:
        """Matches, locks and increfs the cached prefix (at most len-1 tokens); a partial
        page's tokens count as hits (copy-on-partial-reuse) but its page is not shared."""
        if not self.config.use_cache:
            return [], None, 0
        prompt = request.prompt_ids
        match = self.tree.match(prompt[: len(prompt) - 1])
        self.tree.lock(match.node)
        self.pool.incref(match.pages)
        return list(match.pages), match.node, match.num_tokens

    def _make_room(self, needed: int) -> bool:
        short = needed - self.pool.num_free
        if short > 0:
            self.tree.evict(short)
        return self.pool.num_free >= needed

    def _release(self, pages: list[int], node: RadixNode | None) -> None:
        self.pool.decref(pages)
        if node is not None:
            self.tree.unlock(node)


def release_plan(workload: Workload) -> tuple[list[tuple[float, int]], dict[int, list[BenchRequest]]]:
    """A heap of (release time, index) of the requests without a parent, and each parent's
    dependents (released when it finishes)."""
    dependents: dict[int, list[BenchRequest]] = {}
    releases: list[tuple[float, int]] = []
    for r in workload.requests:
        if r.parent is None:
            releases.append((r.arrival_time, r.index))
        else:
            dependents.setdefault(r.parent, []).append(r)
    heapq.heapify(releases)
    return releases, dependents


def _inserted_tokens(request: BenchRequest) -> np.ndarray:
    """The tokens a finished request leaves cacheable: its prompt plus any known reply."""
    if request.output_ids is None:
        return request.prompt_ids
    return np.concatenate([request.prompt_ids, request.output_ids])


def simulate(workload: Workload, config: SimConfig) -> SimResult:
    """Runs `config` over `workload` (a fresh cache each call)."""
    return Simulator(workload, config).run()
