"""What counts as re-seen behind a router: the cluster's reuse history (cache/adaptive.py:
`AdaptiveReuse.observe(cluster_seen=...)`, `expect`; the cluster simulation's router and a
cluster's ingress keep it: benchmark/cluster_sim.py, cluster/duel_pool.py `ClusterReuse`),
and prompts sent elsewhere after their last replica lost them (`AdaptiveReuse.elsewhere`,
`LeadDuel.observe_elsewhere`, reuse.py `ClusterHistory.took`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from radixserve.benchmark.cli_simulate import EVICTION_POLICIES
from radixserve.benchmark.cluster_sim import ClusterSimulator
from radixserve.benchmark.simulate import SimConfig
from radixserve.benchmark.workloads import BenchRequest, Workload
from radixserve.cache.adaptive import LEADS, MAX_PENDING, AdaptiveReuse, LeadDuel
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cache.reuse import ClusterHistory, ReuseHistory
from radixserve.cluster.duel_pool import WINDOW_KEY, ClusterReuse, expect_seen, tell_elsewhere, with_record

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


# ---------------------------------------------------------------- prompts sent elsewhere


def test_a_prompt_sent_elsewhere_is_ghost_evidence_only() -> None:
    duel = LeadDuel(24, 16 * 24)
    doc = list(range(1, 21))
    duel.observe(doc, len(doc), 0, 0)
    for r in range(8):  # fresh pages push the document out of LRU's ghost, not out of a lead's
        duel.observe([1000 * (r + 1) + i for i in range(10)], 0, 2 * r + 1, 0)
        tree = duel.tree_record.copy()
        duel.observe_elsewhere(doc, 2 * r + 2)
        assert np.array_equal(duel.tree_record, tree)  # the tree never saw it
    assert duel._diff[-1, 0] > 0  # the unbounded lead's ghost kept it, LRU's did not
    assert duel.lead == LEADS[-1]


def test_a_replay_boosts_no_copy_its_ghost_had_lost() -> None:
    """The prompt is served and cached where it was sent: a replay's copies of pages a ghost
    no longer held come back unboosted, so a lead's ghost lets them go first (boosted, they
    stayed in the unbounded lead's ghost for good, in place of the replica's own traffic);
    pages a ghost still held keep their boost."""
    duel = LeadDuel(24, 16 * 24)
    unbounded = duel.ghosts[-1]
    kept, lost = list(range(1, 5)), list(range(100, 110))
    duel.observe(kept, len(kept), 0, 0)  # boosted in every ghost
    duel.observe_elsewhere(lost, 1)  # never here: plain copies
    duel.observe_elsewhere(kept, 1)  # still held: still boosted
    assert set(kept) <= unbounded._boosted and not set(lost) & unbounded._boosted
    duel.observe([1000 + i for i in range(20)], 0, 2, 0)  # the replica's own traffic, plain
    assert set(kept) <= set(unbounded._keys) and not set(lost) & set(unbounded._keys)
    assert all(1000 + i in unbounded._keys for i in range(20))


def test_prompts_sent_elsewhere_wait_for_the_engine_thread() -> None:
    rule = adaptive()
    before = rule.duel.record()
    rule.elsewhere(prompt(1000), None)  # from a replica's event loop: queued only
    assert rule.duel.record().to_list() == before.to_list()
    rule.observe(prompt(9000, 1))  # the engine thread's next prompt replays it first
    assert rule.duel.ghosts[-1].hits == 0 and len(rule.duel.ghosts[-1]) >= 6
    assert not rule._elsewhere
    for i in range(MAX_PENDING + 10):
        rule.elsewhere([i], None)
    assert len(rule._elsewhere) == MAX_PENDING


def test_the_history_tells_the_home_that_lost_the_prompt() -> None:
    history = ClusterHistory(1000)
    doc = [1, 2, 3, 4]
    assert history.took(doc, history.observe_hashes(doc), "a", lambda r: 0) is None  # never seen: no home
    seen = history.observe_hashes(doc)
    assert seen == 4 and history.home(doc, seen) == "a"
    assert history.took(doc, seen, "b", lambda r: 4) is None  # a still holds it: routed away for balance
    seen = history.observe_hashes(doc)
    assert history.took(doc, seen, "a", lambda r: 2) == "b"  # b served it last and lost half of it
    seen = history.observe_hashes(doc)
    assert history.took(doc, seen, "a", lambda r: 0) is None  # its home took it again


def evicting_workload() -> Workload:
    """A document, a filler, a filler that evicts the document from the first replica, the
    document again, one more filler: round robin sends them a, b, a, b, a."""
    doc = prompt(1000, 8).astype(np.int32)
    fillers = [prompt(10_000 * (i + 1), 14).astype(np.int32) for i in range(3)]
    prompts = [doc, fillers[0], fillers[1], doc.copy(), fillers[2]]
    return Workload("evict", [BenchRequest(index=i, prompt_ids=p, output_len=1, arrival_time=float(i))
                              for i, p in enumerate(prompts)], {})


def test_the_cluster_simulation_tells_the_replica_that_lost_it() -> None:
    eviction, retention = EVICTION_POLICIES["adaptive"]
    told = {}
    for pooled in (True, False):
        cluster = ClusterSimulator(evicting_workload(), SimConfig(16 * PAGE, page_size=PAGE, eviction_policy=eviction),
                                   2, "round-robin", retention=retention, pooled=pooled)
        first = cluster.sims["replica-0"].config.retention
        calls: list[int] = []
        tell = first.elsewhere
        first.elsewhere = lambda request: (calls.append(request.index), tell(request))[1]
        replayed: list[list[int]] = []
        replay = first.duel.observe_elsewhere
        first.duel.observe_elsewhere = lambda hashes, tick: (replayed.append(list(hashes)), replay(hashes, tick))[1]
        cluster.run()
        assert [cluster.served_by[i] for i in range(5)] == ["replica-0", "replica-1"] * 2 + ["replica-0"]
        told[pooled] = calls
        if pooled:  # its ghosts replayed the document at its next prompt
            assert replayed == [first._adaptive.history.hashes(evicting_workload().requests[0].prompt_ids)]
    assert told == {True: [3], False: []}


def test_the_ingress_and_the_replica_pass_it_on() -> None:
    reuse = ClusterReuse()
    assert reuse.took([1, 2], None, "a", lambda r: 0) is None  # no count: no history
    stats = {"a": {WINDOW_KEY: 100}, "b": {WINDOW_KEY: 100}}
    reuse.took([1, 2], reuse.observe([1, 2], stats), "a", lambda r: 0)
    assert reuse.took([1, 2], reuse.observe([1, 2], stats), "b", lambda r: 0) == "a"
    replica = engine()
    tell_elsewhere(replica, list(prompt(1000)), None)
    assert len(replica.reuse_history._elsewhere) == 1
    plain = engine("priority")
    tell_elsewhere(plain, list(prompt(1000)), None)  # no adaptive rule: nothing to tell
