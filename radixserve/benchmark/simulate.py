"""Simulate mode: the engine's own scheduler and cache replay a workload, with no model.

Each configuration runs a `SimServer` (sim_server.py): the engine's `Scheduler` over a real
`RadixTree` and `PagePool(num_layers=0)` of `capacity_tokens // page_size` pages, plus a host
tier of `host_capacity_tokens` when given, with a model-free runner and a simulated clock. So
the hit rates reported are those of the code that serves — admission, in-batch sharing,
partial-page reuse, chunked prefill, preemption, host offload and load-back included — and
only compute is modelled: a step costs `decode_step_s` plus its prefill tokens /
`prefill_tokens_per_s`, a load from the host `1 / load_tokens_per_s` per token.

Two loops:
- serving (default): requests are released at their arrival time (a chat turn once its
  parent has finished) and the server steps continuously, as the engine does;
- `sequential`: one request at a time in arrival order, prompts only, at no simulated cost
  (the setting of the Mooncake trace's reference figures).

A request the engine would refuse (prompt and output exceed the pool) is skipped.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np

from radixserve.benchmark.retention import DefaultRetention, RetentionRule
from radixserve.benchmark.sim_server import ServerSpec, SimRequest, SimServer, reply_tokens
from radixserve.benchmark.workloads import BenchRequest, Workload
from radixserve.cache.events import CacheEventHub
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cache.tiers import DEFAULT_OFFLOAD_MIN_PRIORITY, WRITE_BACK

SEQUENTIAL_BATCH_TOKENS = 1 << 31  # a whole prompt per step


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
    host_capacity_tokens: int = 0
    host_write_policy: str = WRITE_BACK
    host_offload_min_priority: int = DEFAULT_OFFLOAD_MIN_PRIORITY
    load_tokens_per_s: float = 1_000_000.0
    tag: str = ""  # appended to the label (a variant of the main configuration)
    window: int | None = None  # a model with this sliding window on every layer
    # Also cache a finished request's last, partly filled page (the engine's default); off by
    # default here so that simulated tables stay comparable with the ones already published.
    cache_partial_pages: bool = False
    # The engine's step caps (engine.py): None (off), as in the published tables; the engine
    # caps mixed steps on a CPU and runs the short lane (128) everywhere by default.
    mixed_prefill_tokens: int | None = None
    short_prompt_tokens: int | None = None

    @property
    def num_pages(self) -> int:
        """Pages in the simulated device pool."""
        return self.capacity_tokens // self.page_size

    @property
    def host_num_pages(self) -> int:
        """Pages in the simulated host tier (0: none)."""
        return self.host_capacity_tokens // self.page_size if self.use_cache else 0

    def label(self, retention_name: str | None = None) -> str:
        """Short name, e.g. "lpm/priority+reuse-boost" (`retention_name` overrides the rule's)."""
        if not self.use_cache:
            return "no-cache"
        mode = "sequential" if self.sequential else self.schedule_policy
        rule = retention_name or self.retention.name
        # A rule named as its eviction policy ("adaptive": both halves of one rule) is named once.
        label = f"{mode}/{self.eviction_policy}" + ("" if rule in (DefaultRetention.name, self.eviction_policy)
                                                    else f"+{rule}")
        if self.host_num_pages and self.host_write_policy != WRITE_BACK:
            label += f" {self.host_write_policy}"
        if self.window:
            label += f", window {self.window}"
        if self.cache_partial_pages:
            label += ", partial pages"
        return label + (f", {self.tag}" if self.tag else "")

    def server_spec(self) -> ServerSpec:
        """The simulated server this configuration describes."""
        sequential = self.sequential
        return ServerSpec(
            num_pages=self.num_pages, page_size=self.page_size,
            schedule_policy="fcfs" if sequential else self.schedule_policy,
            eviction_policy=self.eviction_policy, use_cache=self.use_cache,
            max_running=1 if sequential else self.max_running,
            max_batch_tokens=SEQUENTIAL_BATCH_TOKENS if sequential else self.max_batch_tokens,
            max_wait_s=self.max_wait_s,
            decode_step_s=0.0 if sequential else self.decode_step_s,
            prefill_tokens_per_s=math.inf if sequential else self.prefill_tokens_per_s,
            host_num_pages=self.host_num_pages, host_write_policy=self.host_write_policy,
            host_offload_min_priority=self.host_offload_min_priority,
            load_s_per_page=0.0 if sequential else self.page_size / self.load_tokens_per_s,
            cache_partial_pages=self.cache_partial_pages,
            window=self.window, mixed_prefill_tokens=self.mixed_prefill_tokens,
            short_prompt_tokens=self.short_prompt_tokens)


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
    host_hit_tokens: int = 0
    offloaded_tokens: int = 0
    loaded_tokens: int = 0
    preemptions: int = 0
    computed_tokens: int = 0     # tokens run through the (simulated) model
    recomputed_tokens: int = 0   # of those, tokens computed again after a preemption
    cached_pages: int = 0        # pages the tree holds at the end
    held_pages_mean: float = 0.0  # pages running sequences kept from being freed, per step
    held_pages_peak: int = 0

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens (either tier) / prompt tokens (SGLang's definition)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        """The part of the hit rate loaded back from the host tier."""
        return self.host_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict[str, object]:
        """JSON-ready summary (no per-request arrays)."""
        ttft = self.ttft_s[~np.isnan(self.ttft_s)] if len(self.ttft_s) else self.ttft_s
        return {
            "label": self.label, "hit_rate": self.hit_rate, "hit_tokens": self.hit_tokens,
            "device_hit_rate": self.hit_rate - self.host_hit_rate, "host_hit_rate": self.host_hit_rate,
            "requests": self.requests, "prompt_tokens": self.prompt_tokens, "skipped": self.skipped,
            "schedule_policy": None if self.config.sequential else self.config.schedule_policy,
            "eviction_policy": self.config.eviction_policy, "retention": self.config.retention.name,
            "use_cache": self.config.use_cache, "sequential": self.config.sequential,
            "capacity_tokens": self.config.num_pages * self.config.page_size,
            "host_capacity_tokens": self.config.host_num_pages * self.config.page_size,
            "host_write_policy": self.config.host_write_policy if self.config.host_num_pages else None,
            "evicted_pages": self.evicted_pages, "offloaded_tokens": self.offloaded_tokens,
            "loaded_tokens": self.loaded_tokens, "preemptions": self.preemptions,
            "computed_tokens": self.computed_tokens, "recomputed_tokens": self.recomputed_tokens,
            "recomputed_share": self.recomputed_tokens / self.computed_tokens if self.computed_tokens else 0.0,
            "window": self.config.window, "cached_pages": self.cached_pages,
            "held_pages_mean": self.held_pages_mean, "held_pages_peak": self.held_pages_peak,
            "sim_makespan_s": self.makespan_s,
            "sim_ttft_mean_s": float(ttft.mean()) if len(ttft) else None,
            "sim_ttft_p50_s": float(np.percentile(ttft, 50)) if len(ttft) else None,
            "sim_ttft_p99_s": float(np.percentile(ttft, 99)) if len(ttft) else None,
            "wall_s": self.wall_s,
        }


class Simulator:
    """Runs one `SimConfig` over one workload on one `SimServer`; see the module docstring.

    The serving loop is also driven from outside (a cluster of simulated replicas behind a
    router, cluster_sim.py): `release` hands it a request, `step` runs one scheduling step and
    returns the requests that ended (finished, or skipped because the engine would refuse
    them), `busy` says whether it has a step to take. With `events`, its tree reports cache
    events to that hub.
    """

    def __init__(self, workload: Workload, config: SimConfig, events: CacheEventHub | None = None) -> None:
        if config.num_pages < 1:
            raise ValueError(f"capacity_tokens: {config.capacity_tokens} holds no page of {config.page_size}")
        self.workload = workload
        self.config = config
        self.server = SimServer(config.server_spec(), config.retention, events=events)
        n = len(workload.requests)
        self.hits = np.zeros(n, dtype=np.int64)
        self.host_hits = np.zeros(n, dtype=np.int64)
        self.ttft = np.full(n, np.nan)
        self.skipped = 0
        self._ended: list[BenchRequest] = []  # skipped at release, reported by the next step

    @property
    def pool(self) -> PagePool:
        """The server's device pool."""
        return self.server.pool

    @property
    def tree(self) -> RadixTree:
        """The server's tree."""
        return self.server.tree

    @property
    def now(self) -> float:
        """The server's simulated time."""
        return self.server.now

    @property
    def waiting(self) -> list:
        """The scheduler's waiting sequences."""
        return self.server.scheduler.waiting

    @property
    def running(self) -> list:
        """The scheduler's running sequences."""
        return self.server.scheduler.running

    @property
    def busy(self) -> bool:
        """Whether the serving loop has a step to take."""
        return self.server.has_work() or bool(self._ended)

    def run(self) -> SimResult:
        """Simulates the whole workload and returns its result."""
        start = time.perf_counter()
        if self.config.sequential:
            self._run_sequential()
        else:
            self._run_serving()
        return self.result(time.perf_counter() - start)

    def result(self, wall_s: float) -> SimResult:
        """The run's figures so far."""
        stats = self.tree.stats()
        size = self.config.page_size
        return SimResult(self.config.label(), self.config, len(self.workload.requests),
                         self.workload.prompt_tokens, int(self.hits.sum()), self.skipped,
                         int(stats["evicted_pages"]), self.server.now, self.ttft, self.hits, wall_s,
                         host_hit_tokens=int(self.host_hits.sum()),
                         offloaded_tokens=int(stats["offloaded_pages"] + stats["written_through_pages"]) * size,
                         loaded_tokens=int(stats["loaded_pages"]) * size,
                         preemptions=self.server.scheduler.counters.preemptions,
                         computed_tokens=self.server.scheduler.counters.computed_tokens,
                         recomputed_tokens=self.server.scheduler.counters.recomputed_tokens,
                         cached_pages=self.tree.cached_pages,
                         held_pages_mean=self.server.held_pages_sum / max(self.server.steps, 1),
                         held_pages_peak=self.server.held_pages_peak)

    def _record(self, req: SimRequest) -> None:
        index = req.bench.index
        self.hits[index] = req.cached_tokens or 0
        self.host_hits[index] = req.host_cached_tokens
        self.ttft[index] = req.first_token_at - req.arrival_time

    # ------------------------------------------------------------------ sequential
    def _run_sequential(self) -> None:
        server = self.server
        for request in sorted(self.workload.requests, key=lambda r: (r.arrival_time, r.index)):
            server.advance_to(request.arrival_time)
            req = server.submit(request, reply_tokens(request, prompt_only=True))
            if req is None:
                self.skipped += 1
                continue
            while server.has_work():
                server.step()
            self._record(req)

    # ------------------------------------------------------------------ serving
    def release(self, request: BenchRequest, released_at: float) -> None:
        """Hands a released request to the server (an idle server's clock moves to
        `released_at`)."""
        if not self.server.has_work():
            self.server.advance_to(released_at)
        if self.server.submit(request, reply_tokens(request, prompt_only=False)) is None:
            self.skipped += 1
            self._ended.append(request)

    def step(self, next_release: float | None) -> list[BenchRequest]:
        """One scheduling step at `now`; returns the requests that ended since the last one.
        When nothing can run (every running sequence waits for a copy from the host), the
        clock moves to the next copy's end or `next_release`, whichever comes first."""
        ended, self._ended = self._ended, []
        if not self.server.has_work():
            return ended
        ran, finished = self.server.step()
        for req in finished:
            self._record(req)
            ended.append(req.bench)
        if not ran:
            waits = [t for t in (self.server.next_load_done(), next_release) if t is not None]
            if not waits:
                raise RuntimeError("simulated server stalled: nothing runs, loads or arrives")
            self.server.advance_to(min(waits))
        return ended

    def _run_serving(self) -> None:
        requests = self.workload.requests
        releases, dependents = release_plan(self.workload)
        while releases or self.busy:
            while releases and releases[0][0] <= self.now:
                released_at, index = heapq.heappop(releases)
                self.release(requests[index], released_at)
            if not self.busy:
                self.server.advance_to(releases[0][0])
                continue
            for ended in self.step(releases[0][0] if releases else None):
                for child in dependents.pop(ended.index, []):
                    heapq.heappush(releases, (max(child.arrival_time, self.now), child.index))


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


def simulate(workload: Workload, config: SimConfig) -> SimResult:
    """Runs `config` over `workload` (a fresh cache each call)."""
    return Simulator(workload, config).run()
