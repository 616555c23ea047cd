"""The cluster's pooling of the adaptive rule's evidence (cluster/duel_pool.py): a replica's
record rides out in its stats, the ingress passes every replica's latest on with each
request, and the replica that takes it pools the others' (no Ray needed: the two messages'
contents only)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from radixserve.cache.adaptive import AdaptiveReuse, ReuseHistory
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cluster.duel_pool import STATS_KEY, receive, records_of, with_record

PAGE = 4


def engine(policy: str = "adaptive", rounds: int = 3) -> SimpleNamespace:
    """What the pooling reads of an Engine: its reuse history (AdaptiveReuse under the
    adaptive rule), after a few prompts so that its record is not empty."""
    tree = RadixTree(PagePool(16, PAGE), eviction_policy=policy)
    history = AdaptiveReuse(tree, 16 * 16) if policy == "adaptive" else ReuseHistory(PAGE, 16 * 16)
    for r in range(rounds):
        history.observe(np.arange(8 * PAGE) + 1000 * (r % 2))
    return SimpleNamespace(reuse_history=history)


def test_a_record_goes_out_with_the_stats_and_comes_back_as_the_others_sum() -> None:
    replicas = {name: engine(rounds=rounds) for name, rounds in (("a", 3), ("b", 4), ("c", 6))}
    stats = {name: with_record({"prompt_tokens": 1}, e) for name, e in replicas.items()}
    records = records_of(stats)
    assert set(records) == {"a", "b", "c"}
    receive(replicas["a"], records, "a")
    peers = replicas["a"].reuse_history.duel.peers
    others = [replicas[n].reuse_history.duel.record() for n in ("b", "c")]
    assert peers.to_list() == (others[0] + others[1]).to_list()  # the others', not its own
    assert peers.hits.any()


def test_rules_without_a_duel_neither_report_nor_pool() -> None:
    plain = engine("priority")
    assert STATS_KEY not in with_record({}, plain)
    receive(plain, {"b": engine().reuse_history.duel.record().to_list()}, "a")  # nothing to pool into
    assert records_of({"a": {"prompt_tokens": 1}}) == {}


def test_a_record_of_another_shape_is_ignored() -> None:
    replica = engine()
    good = engine().reuse_history.duel.record().to_list()
    receive(replica, {"b": good[:-1], "c": good}, "a")
    assert replica.reuse_history.duel.peers.to_list() == good
    lone = engine()
    receive(lone, {"a": good}, "a")  # only its own: nothing to pool
    assert lone.reuse_history.duel.peers is None


def test_a_replica_left_alone_decides_on_its_own_record() -> None:
    # Its peer leaves: the ingress passes on only the replica's own record (or only records
    # of another shape, mid-upgrade). The peer's last record no longer decays (only its own
    # traffic decayed it), so keeping it would weigh a departed replica's evidence for good.
    replica = engine()
    peer = engine().reuse_history.duel.record().to_list()
    own = replica.reuse_history.duel.record().to_list()
    receive(replica, {"a": own, "b": peer}, "a")
    assert replica.reuse_history.duel.peers is not None
    receive(replica, {"a": own}, "a")
    assert replica.reuse_history.duel.peers is None
    receive(replica, {"a": own, "b": peer}, "a")
    receive(replica, {"a": own, "b": peer[:-1]}, "a")  # the only other record: of another shape
    assert replica.reuse_history.duel.peers is None
