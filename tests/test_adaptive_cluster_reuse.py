"""What counts as re-seen behind a router: the cluster's reuse history (cache/adaptive.py:
`AdaptiveReuse.observe(cluster_seen=...)`, `expect`; the cluster simulation's router and a
cluster's ingress keep it: benchmark/cluster_sim.py, cluster/duel_pool.py `ClusterReuse`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from radixserve.benchmark.cli_simulate import EVICTION_POLICIES
from radixserve.benchmark.cluster_sim import ClusterSimulator
from radixserve.benchmark.simulate import SimConfig
from radixserve.benchmark.workloads import BenchRequest, Workload
from radixserve.cache.adaptive import MAX_PENDING, AdaptiveReuse
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cache.reuse import ReuseHistory
from radixserve.cluster.duel_pool import WINDOW_KEY, ClusterReuse, expect_seen, with_record

PAGE = 4


def adaptive(window: int = 256) -> AdaptiveReuse:
    return AdaptiveReuse(RadixTree(PagePool(16, PAGE), eviction_policy="adaptive"), window)


def prompt(first: int, pages: int = 6) -> np.ndarray:
    return np.arange(first, first + pages * PAGE)


def test_the_clusters_count_is_what_gets_boosted() -> None:
    rule = adaptive()
    doc = prompt(1000)
    # Never seen here, but the cluster saw its first 4 pages (on another replica).
    assert rule.observe(doc, cluster_seen=4) == 4
    # Its own history still observed the prompt: without a count, its own view answers.
    assert rule.observe(doc) == 6
    # A count is the cluster's view, also when it says less than this replica's own.
    assert rule.observe(doc, cluster_seen=0) == 0
    assert rule.observe(prompt(5000, 2), cluster_seen=9) == 2  # never more than the prompt's pages


def test_an_expected_count_is_used_once_by_the_prompt_it_names() -> None:
    rule = adaptive()
    doc, other = prompt(1000), prompt(2000)
    rule.expect(list(doc), 3)  # as a replica hands it on, before the engine takes the prompt
    assert rule.observe(other) == 0  # another prompt: its own (empty) history
    assert rule.observe(doc) == 3
    assert rule.observe(doc) == 6  # used up: the same prompt again gets its own history's count
    rule.expect(list(doc), 1)
    assert rule.observe(doc, cluster_seen=5) == 5  # a count given directly wins


def test_expected_counts_stay_bounded() -> None:
    rule = adaptive()
    for i in range(MAX_PENDING + 50):  # prompts the engine refused never come to observe
        rule.expect([i], 1)
    assert len(rule._expected) == MAX_PENDING
    assert rule.observe(np.array([MAX_PENDING + 49] * PAGE)) == 0  # not expected: its own view
    rule.expect(list(prompt(7000)), 2)
    assert rule.observe(prompt(7000)) == 2


def doc_twice_workload() -> Workload:
    """One document asked twice, a second apart, then fillers: round robin sends the two
    askings to different replicas."""
    doc = prompt(1000, 8).astype(np.int32)
    requests = [BenchRequest(index=0, prompt_ids=doc, output_len=2, arrival_time=0.0),
                BenchRequest(index=1, prompt_ids=doc.copy(), output_len=2, arrival_time=1.0)]
    return Workload("doc-twice", requests, {})


def test_the_cluster_simulation_boosts_what_another_replica_saw() -> None:
    eviction, retention = EVICTION_POLICIES["adaptive"]
    seen = {}
    for pooled in (True, False):
        cluster = ClusterSimulator(doc_twice_workload(), SimConfig(4000, page_size=PAGE, eviction_policy=eviction),
                                   2, "round-robin", retention=retention, pooled=pooled)
        cluster.run()
        assert cluster.served_by[0] != cluster.served_by[1]
        second = cluster.sims[cluster.served_by[1]].config.retention
        seen[pooled] = second._seen_pages[1]
    assert seen == {True: 8, False: 0}  # pooled, the second replica knows the cluster saw it


def test_the_cluster_history_spans_every_replicas_window() -> None:
    eviction, retention = EVICTION_POLICIES["adaptive"]
    cluster = ClusterSimulator(doc_twice_workload(), SimConfig(4000, page_size=PAGE, eviction_policy=eviction),
                               3, "round-robin", retention=retention)
    windows = [sim.config.retention.window_pages for sim in cluster.sims.values()]
    assert cluster.cluster_reuse.window_pages == sum(windows) > windows[0]
    lru = ClusterSimulator(doc_twice_workload(), SimConfig(4000, page_size=PAGE), 2, "round-robin")
    assert lru.cluster_reuse is None  # other rules keep their replicas' own histories


def engine(policy: str = "adaptive") -> SimpleNamespace:
    tree = RadixTree(PagePool(16, PAGE), eviction_policy=policy)
    history = AdaptiveReuse(tree, 16 * 16) if policy == "adaptive" else ReuseHistory(PAGE, 16 * 16)
    return SimpleNamespace(reuse_history=history)


def test_the_ingress_counts_over_the_sum_of_the_reported_windows() -> None:
    replicas = {"a": engine(), "b": engine(), "c": engine("priority")}
    stats = {name: with_record({"prompt_tokens": 1}, e) for name, e in replicas.items()}
    assert stats["a"][WINDOW_KEY] == 256 and WINDOW_KEY not in stats["c"]
    reuse = ClusterReuse()
    assert reuse.observe([1, 2, 3], {"c": stats["c"]}) is None  # no adaptive replica: no count
    assert reuse.observe([1, 2, 3], stats) == 0
    assert reuse.history.window_pages == 512
    assert reuse.observe([1, 2, 3, 4], stats) == 3
    # 512 page observations later the prompt has left the window of a and b together.
    for i in range(128):
        reuse.observe([10_000 + 4 * i + k for k in range(4)], stats)
    assert reuse.observe([1, 2, 3], stats) == 0


def test_the_replica_hands_the_count_to_its_rule() -> None:
    replica = engine()
    doc = prompt(1000)
    expect_seen(replica, list(doc), None)  # no count: nothing expected
    assert replica.reuse_history._expected == {}
    expect_seen(replica, list(doc), 4)
    assert replica.reuse_history.observe(doc) == 4
    plain = engine("priority")
    expect_seen(plain, list(doc), 4)  # a rule without the adaptive history: nothing to hand to
    assert plain.reuse_history.observe(doc) == 0
