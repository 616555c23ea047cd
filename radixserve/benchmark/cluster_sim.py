"""Simulate mode with N replicas: the same routing code as the Ray Serve router, no model.

Each replica is a `Simulator` (its own pool and tree of `capacity_tokens`, its own clock and
serving loop). Its tree reports its cache events to a `CacheIndex` exactly as a served
replica's event stream does, so the router sees the same facts: cached pages per replica,
requests in flight, free pages. A released request is routed at its release time by a
`radixserve.cluster.routing` policy — the classes the served router uses — and handed to
that replica's loop. Replicas advance in parallel: the loop always runs the earliest event,
a release or the step of the replica whose clock is behind.

Requests are released as the workload says (its arrival times; a chat's next turn when the
previous one finished), or, with `concurrency`, as `bench serve`'s closed loop releases them:
that many clients take the requests in order, each waiting for a request's parent first.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from radixserve.benchmark.retention import AdaptiveBoost
from radixserve.benchmark.simulate import SimConfig, SimResult, Simulator, release_plan, simulate
from radixserve.benchmark.suite import make_retention
from radixserve.benchmark.workloads import BenchRequest, Workload
from radixserve.cache.adaptive import share_evidence
from radixserve.cache.events import CacheEventHub
from radixserve.cache.reuse import ClusterHistory
from radixserve.cluster.routing import (
    CacheAwareConfig,
    ClusterState,
    ReplicaReport,
    RouteRequest,
    make_routing_policy,
    prompt_pages,
    replica_imbalance,
)


IMBALANCE_WINDOW = 1000  # requests, in routing order, per window of `windowed_imbalance`


def windowed_imbalance(assignment: Sequence[int], replicas: int, window: int = IMBALANCE_WINDOW) -> float:
    """The worst request imbalance (max / min per replica) over every run of `window`
    consecutive routings (`assignment`: the replica number of each request, in routing
    order); the whole run when it is shorter. Balance over the run alone can hide a
    replica that took most of the traffic for an hour and little after."""
    if not len(assignment):
        return float("nan")
    onehot = np.zeros((len(assignment) + 1, replicas), dtype=np.int64)
    onehot[np.arange(1, len(assignment) + 1), np.asarray(assignment)] = 1
    cumulative = np.cumsum(onehot, axis=0)
    width = min(window, len(assignment))
    counts = cumulative[width:] - cumulative[: len(cumulative) - width]
    lows = counts.min(axis=1)
    if (lows == 0).any():
        return float("inf")
    return float((counts.max(axis=1) / lows).max())


@dataclass
class ClusterSimResult:
    """The aggregate over replicas (hits, TTFT) plus how the router spread the requests and
    how well it predicted what each replica would find cached."""

    result: SimResult
    router: str
    replica_requests: list[int]
    windowed_imbalance: float = float("nan")  # worst max/min over IMBALANCE_WINDOW routings
    predicted_within_page: float = float("nan")  # share of requests whose predicted cached tokens were within a page

    @property
    def replica_imbalance(self) -> float:
        return replica_imbalance(self.replica_requests)

    def to_dict(self) -> dict[str, object]:
        out = self.result.to_dict()
        out.update(replicas=len(self.replica_requests), router=self.router,
                   replica_requests=self.replica_requests, replica_imbalance=self.replica_imbalance,
                   windowed_imbalance=self.windowed_imbalance, imbalance_window=IMBALANCE_WINDOW,
                   predicted_within_page=self.predicted_within_page)
        return out


class ClosedLoop:
    """`bench serve`'s closed loop, in simulated time: `concurrency` clients take the
    workload's requests in order; a client whose request has a parent that has not finished
    waits for it (holding its place), then sends it. Arrival times are ignored."""

    def __init__(self, workload: Workload, concurrency: int) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency: must be >= 1, got {concurrency}")
        self._queue = deque(workload.requests)
        self._done: set[int] = set()
        self._blocked: dict[int, list[BenchRequest]] = {}  # parent index → requests waiting for it
        self._concurrency = concurrency

    def start(self) -> list[tuple[float, int]]:
        """The first releases, at t=0: (time, request index)."""
        return [release for _ in range(self._concurrency) for release in self._take(0.0)]

    def ended(self, request: BenchRequest, now: float) -> list[tuple[float, int]]:
        """`request` finished at `now`: the requests that wait for it go, and its client
        takes the next one."""
        self._done.add(request.index)
        released = [(now, child.index) for child in self._blocked.pop(request.index, [])]
        return released + self._take(now)

    def _take(self, now: float) -> list[tuple[float, int]]:
        if not self._queue:
            return []
        request = self._queue.popleft()
        if request.parent is None or request.parent in self._done:
            return [(now, request.index)]
        self._blocked.setdefault(request.parent, []).append(request)
        return []


class ClusterSimulator:
    """`replicas` Simulators of `config` (capacity per replica) behind one router."""

    def __init__(self, workload: Workload, config: SimConfig, replicas: int, router: str, *,
                 retention: str = "default", seed: int = 0, routing: CacheAwareConfig | None = None,
                 concurrency: int | None = None, speeds: Sequence[float] | None = None,
                 pooled: bool = True) -> None:
        if config.sequential:
            raise ValueError("sequential: a cluster runs the serving loop")
        if replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {replicas}")
        speeds = list(speeds) if speeds is not None else [1.0] * replicas
        if len(speeds) != replicas or min(speeds) <= 0:
            raise ValueError(f"speeds: one positive factor per replica, got {speeds}")
        self.workload = workload
        self.config = config
        self.router = router
        self.state = ClusterState()
        self.policy = make_routing_policy(router, self.state, page_size=config.page_size, seed=seed, config=routing)
        self.sims: dict[str, Simulator] = {}
        for i in range(replicas):
            key = f"replica-{i}"
            hub = CacheEventHub(config.page_size)
            hub.subscribe(lambda event, key=key: self.state.index.apply(key, [event]))
            rule = make_retention(retention, page_size=config.page_size, capacity_tokens=config.capacity_tokens)
            # A replica of speed s runs every step in 1/s of the time (replicas sharing cores).
            timing = dict(decode_step_s=config.decode_step_s / speeds[i],
                          prefill_tokens_per_s=config.prefill_tokens_per_s * speeds[i])
            self.sims[key] = Simulator(workload, replace(config, retention=rule, **timing), events=hub)
            self.state.index.apply(key, [])
        self.served_by: dict[int, str] = {}
        self.order: list[int] = []  # replica number of each request, in routing order
        self.predicted: dict[int, int] = {}  # request index → cached tokens the router predicted
        self.closed_loop = ClosedLoop(workload, concurrency) if concurrency is not None else None
        # The adaptive rule's duels, pooled: before each routing every replica gets the sum of
        # the others' records as they are then (as a cluster's ingress would pass them on).
        rules = [sim.config.retention for sim in self.sims.values()]
        self.pooled = pooled and all(isinstance(rule, AdaptiveBoost) for rule in rules)
        # ... and what counts as re-seen: the router sees every request, so it keeps the
        # cluster's reuse history (over the sum of the replicas' windows), hands each
        # request's count to the replica that takes it and tells the replica that served the
        # prefix last if it lost it (as a cluster's ingress does: cluster/duel_pool.py).
        self.cluster_reuse = ClusterHistory(sum(rule.window_pages for rule in rules)) if self.pooled else None

    def run(self) -> ClusterSimResult:
        start = time.perf_counter()
        requests = self.workload.requests
        if self.closed_loop is not None:
            releases, dependents = self.closed_loop.start(), {}
            heapq.heapify(releases)
        else:
            releases, dependents = release_plan(self.workload)
        while True:
            busy = [(sim.now, key) for key, sim in self.sims.items() if sim.busy]
            next_release = releases[0][0] if releases else math.inf
            next_step = min(busy)[0] if busy else math.inf
            if next_release == next_step == math.inf:
                break
            if next_release <= next_step:
                released_at, index = heapq.heappop(releases)
                self._route(requests[index], released_at)
                continue
            key = min(busy)[1]
            sim = self.sims[key]
            for ended in sim.step(next_release if releases else None):
                # Its events were applied as they happened: it is settled when it finishes.
                self.state.finished(str(ended.index))
                self.state.settled(key, [str(ended.index)])
                if self.closed_loop is not None:
                    for release in self.closed_loop.ended(ended, sim.now):
                        heapq.heappush(releases, release)
                for child in dependents.pop(ended.index, []):
                    heapq.heappush(releases, (max(child.arrival_time, sim.now), child.index))
        return self._result(time.perf_counter() - start)

    def _route(self, request: BenchRequest, released_at: float) -> None:
        if self.pooled:
            duels = [sim.config.retention.duel for sim in self.sims.values()]
            share_evidence([duel for duel in duels if duel is not None])
        for key, sim in self.sims.items():
            self.state.reports[key] = ReplicaReport(pages_free=sim.pool.num_free, pages_total=sim.pool.num_pages,
                                                    waiting=len(sim.waiting), running=len(sim.running))
        namespace, hashes = prompt_pages(request.prompt_ids, self.config.page_size, None)
        route = RouteRequest(str(request.index), namespace, hashes, request.prompt_len)
        # What each replica would report as cached, as its events say before routing: device
        # pages, those continuing them on its host tier (loaded back), and the pages of
        # requests routed there earlier that it is still computing (it waits for them).
        predicted = {key: sum(self.state.index.tiered_pages(key, namespace, hashes, in_flight=True))
                     for key in self.sims}
        key = self.policy.choose(route, list(self.sims))
        if self.cluster_reuse is not None:
            self._pool_reuse(request, namespace, hashes, key)
        self.served_by[request.index] = key
        self.order.append(list(self.sims).index(key))
        self.predicted[request.index] = predicted[key] * self.config.page_size
        self.sims[key].release(request, released_at)

    def _pool_reuse(self, request: BenchRequest, namespace: str, hashes: list[int], key: str) -> None:
        """The cluster's reuse history: `key`, which takes the request, gets the count of
        its pages the cluster saw; the replica that took them last, if it is another one and
        has lost them (as its events say), is told the request went elsewhere."""
        history = self.cluster_reuse
        seen = history.observe_hashes(hashes)
        home = history.took(hashes, seen, key, lambda r: sum(self.state.index.tiered_pages(r, namespace, hashes)))
        self.sims[key].config.retention.expect(request, seen)
        if home is not None:
            self.sims[home].config.retention.elsewhere(request)

    def _result(self, wall_s: float) -> ClusterSimResult:
        sims = list(self.sims.values())
        n = len(self.workload.requests)
        hits = np.zeros(n, dtype=np.int64)
        host_hits = np.zeros(n, dtype=np.int64)
        ttft = np.full(n, np.nan)
        for key, sim in self.sims.items():
            mine = [i for i, k in self.served_by.items() if k == key]
            hits[mine] = sim.hits[mine]
            host_hits[mine] = sim.host_hits[mine]
            ttft[mine] = sim.ttft[mine]
        result = SimResult(f"{self.config.label()} x{len(sims)} {self.router}", self.config, n,
                           self.workload.prompt_tokens, int(hits.sum()), sum(s.skipped for s in sims),
                           sum(int(s.tree.stats()["evicted_pages"]) for s in sims), max(s.now for s in sims),
                           ttft, hits, wall_s)
        result.host_hit_tokens = int(host_hits.sum())
        result.computed_tokens = sum(s.server.scheduler.counters.computed_tokens for s in sims)
        result.recomputed_tokens = sum(s.server.scheduler.counters.recomputed_tokens for s in sims)
        result.preemptions = sum(s.server.scheduler.counters.preemptions for s in sims)
        counts = [sum(1 for k in self.served_by.values() if k == key) for key in self.sims]
        served = [i for i in self.predicted if not np.isnan(ttft[i])]  # skipped requests report nothing
        within = sum(abs(self.predicted[i] - int(hits[i])) <= self.config.page_size for i in served)
        return ClusterSimResult(result, self.router, counts, windowed_imbalance(self.order, len(sims)),
                                within / len(served) if served else float("nan"))


def simulate_cluster(workload: Workload, config: SimConfig, replicas: int, router: str, *,
                     retention: str = "default", seed: int = 0, routing: CacheAwareConfig | None = None,
                     concurrency: int | None = None, speeds: Sequence[float] | None = None,
                     pooled: bool = True) -> ClusterSimResult:
    """Runs `workload` through `replicas` simulated replicas behind `router` (fresh caches;
    each replica its own `retention` rule, by name as in suite.make_retention; the adaptive
    rule's replicas pool their evidence and what counts as re-seen unless not `pooled`:
    cache.adaptive.DuelRecord, `AdaptiveReuse.observe(cluster_seen=...)`); with
    `concurrency`, released by a closed loop of that many clients (`ClosedLoop`); `speeds`:
    each replica's speed relative to `config`'s timings (default: all 1)."""
    return ClusterSimulator(workload, config, replicas, router, retention=retention, seed=seed,
                            routing=routing, concurrency=concurrency, speeds=speeds, pooled=pooled).run()


def run_cluster_suite(workload: Workload, config: SimConfig, replicas: int, routers: list[str], *,
                      retention: str = "default", seed: int = 0, concurrency: int | None = None,
                      speeds: Sequence[float] | None = None,
                      routing: CacheAwareConfig | None = None) -> dict[str, object]:
    """What `bench simulate --replicas N --router R[,R...]` reports at one capacity per replica:
    the first router's figures at the top (`hit_rate`, `replicas`, `router`,
    `replica_imbalance`), every router in `runs`, and the ideal — one replica holding N
    times the memory, at speed 1, released the same way — as `ideal_hit_rate`. `routing`:
    the cache-aware rule's thresholds (default CacheAwareConfig())."""
    big = replace(config, capacity_tokens=config.capacity_tokens * replicas,
                  host_capacity_tokens=config.host_capacity_tokens * replicas)
    if concurrency is None:
        rule = make_retention(retention, page_size=config.page_size, capacity_tokens=big.capacity_tokens)
        ideal = simulate(workload, replace(big, retention=rule))
    else:  # the plain simulator has no closed loop: one replica behind a (trivial) router
        ideal = simulate_cluster(workload, big, 1, "round-robin", retention=retention, concurrency=concurrency).result
    runs = [simulate_cluster(workload, config, replicas, router, retention=retention, seed=seed,
                             concurrency=concurrency, speeds=speeds, routing=routing).to_dict()
            for router in routers]
    main = runs[0]
    return {"workload": workload.name, "workload_params": workload.params, "requests": len(workload.requests),
            "prompt_tokens": workload.prompt_tokens, "page_size": config.page_size,
            "capacity_tokens": config.capacity_tokens, "host_capacity_tokens": config.host_capacity_tokens,
            "replicas": replicas, "router": main["router"],
            "concurrency": concurrency, "replica_speeds": list(speeds) if speeds is not None else None,
            "hit_rate": main["hit_rate"], "replica_imbalance": main["replica_imbalance"],
            "windowed_imbalance": main["windowed_imbalance"], "predicted_within_page": main["predicted_within_page"],
            "ideal_hit_rate": ideal.hit_rate, "ideal": ideal.to_dict(), "runs": runs}


def cluster_table(results: list[dict[str, object]]) -> str:
    """Markdown: hit rate, imbalance (whole run and worst window of IMBALANCE_WINDOW
    requests), the share of requests whose predicted cached tokens were within a page of
    the replica's, and the recomputed share, per router, per capacity, next to the ideal."""
    lines = ["| capacity per replica | router | hit rate | of ideal | imbalance | imbalance per "
             f"{IMBALANCE_WINDOW:,} | predicted within a page | recomputed | TTFT mean (sim) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        ideal = result["ideal_hit_rate"]
        capacity = f"{result['capacity_tokens']:,}" + (f" + host {result['host_capacity_tokens']:,}"
                                                       if result.get("host_capacity_tokens") else "")
        lines.append(f"| {capacity} | 1 replica, {result['replicas']}x memory (ideal) | "
                     f"{ideal:.1%} | 100% | – | – | – | {result['ideal']['recomputed_share']:.1%} | "
                     f"{result['ideal']['sim_ttft_mean_s']:.2f} s |")
        for run in result["runs"]:
            lines.append(f"| {capacity} | {result['replicas']} x {run['router']} | "
                         f"{run['hit_rate']:.1%} | {run['hit_rate'] / ideal:.0%} | "
                         f"{run['replica_imbalance']:.2f} | {run['windowed_imbalance']:.2f} | "
                         f"{run['predicted_within_page']:.0%} | {run['recomputed_share']:.1%} | "
                         f"{run['sim_ttft_mean_s']:.2f} s |")
    return "\n".join(lines)
