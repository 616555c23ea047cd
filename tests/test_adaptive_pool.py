"""The replicas of one model pooling their lead duels' evidence (cache/adaptive.py:
DuelRecord, share_evidence; the cluster simulation passes each replica the others' records
before every routing)."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.benchmark.cli_simulate import EVICTION_POLICIES
from radixserve.benchmark.cluster_sim import ClusterSimulator
from radixserve.benchmark.simulate import SimConfig
from radixserve.benchmark.workloads import make_workload
from radixserve.cache.adaptive import LEADS, DuelRecord, LeadDuel, share_evidence

REPLICAS = 4
ROUNDS = 3  # rounds of evidence each replica sees: too few alone, enough for four together


def play_round(duel: LeadDuel, r: int, tree_hits: bool = True) -> None:
    """A re-seen prompt of 20 pages then 10 fresh ones, for a cache of 24 pages: LRU loses the
    re-seen prompt every round, any lead keeps it (as test_adaptive.replay_rounds)."""
    doc = list(range(1, 21))
    duel.observe(doc, len(doc), 2 * r, len(doc) if tree_hits else 0)
    duel.observe([1000 * (r + 1) + i for i in range(10)], 0, 2 * r + 1, 0)


def replicas(pooled: bool, rounds: int = ROUNDS, tree_hits: bool = True) -> list[LeadDuel]:
    """REPLICAS duels that each see `rounds` rounds, in turn, sharing their records before
    every prompt when `pooled` (as the cluster simulation does before every routing)."""
    duels = [LeadDuel(24, 16 * 24) for _ in range(REPLICAS)]
    for r in range(rounds):
        for duel in duels:
            if pooled:
                share_evidence(duels)
            play_round(duel, r, tree_hits)
    return duels


def test_a_case_too_small_for_one_replica_is_clear_for_the_pool() -> None:
    alone = replicas(pooled=False)
    assert [d.lead for d in alone] == [0.0] * REPLICAS  # each replica's record is under the margin
    pooled = replicas(pooled=True)
    assert pooled[-1].lead == LEADS[-1]  # the last to decide saw every replica's evidence
    assert all(d.peers is not None for d in pooled)


def test_the_pooled_guard_sends_every_replica_back() -> None:
    # The ghosts' case is the pool's, and so is the tree's record against LRU: when the
    # trees miss what LRU's ghost hits, every replica returns to LRU.
    duels = replicas(pooled=True, rounds=ROUNDS + 1, tree_hits=False)
    assert any(d.lead == LEADS[-1] for d in duels)
    recent = [4000 + i for i in range(4)]  # the last round's fresh pages: LRU's ghosts hold them
    for r in range(2):  # two misses per replica: too few for one tree's record, enough for four
        for duel in duels:
            share_evidence(duels)
            duel.observe(recent, 0, 100 + r, 0)
    assert [d.lead for d in duels] == [0.0] * REPLICAS
    assert [d.switches for d in duels] == [2] * REPLICAS  # and none left LRU again on the others' record


def test_records_add_and_travel_as_floats() -> None:
    duel = replicas(pooled=False, rounds=2)[0]
    record = duel.record()
    assert DuelRecord.from_list(record.to_list()).to_list() == record.to_list()
    doubled = record + record
    assert np.array_equal(doubled.diff, 2 * duel._diff) and np.array_equal((doubled - record).hits, record.hits)
    assert record.recent_diff.any() and np.array_equal(doubled.recent_var, 2 * duel._recent_var)
    back = DuelRecord.from_list(record.to_list())
    assert np.array_equal(back.recent_diff, record.recent_diff) and np.array_equal(back.tree, record.tree)
    with pytest.raises(ValueError):
        DuelRecord.from_list(record.to_list()[:-1])


def test_the_recent_record_of_the_pool_sends_a_lead_back() -> None:
    # A lead that no replica's own recent traffic shows behind LRU, but the pool's does.
    duel = LeadDuel(24, 16 * 24)
    duel.current = len(LEADS) - 1
    duel._diff[-1, 0], duel._var[-1, 0] = 10.0, 10.0  # the long record: the lead well ahead
    duel._recent_diff[0, -1], duel._recent_var[0, -1] = 0.8, 1.0  # its own recent record: within a sigma
    assert not duel._decide() and duel.lead == LEADS[-1]
    own = duel.record()
    peers = own - own  # the other replicas: nothing but a recent record with LRU ahead too
    peers.recent_diff[0, -1], peers.recent_var[0, -1] = 1.2, 0.5
    duel.peers = peers
    assert duel._decide() and duel.lead == 0.0  # pooled: 2.0 over sqrt(1.5), LRU ahead by 1.6 sigmas


def test_a_record_is_a_copy() -> None:
    duel = replicas(pooled=False, rounds=2)[0]
    record = duel.record()
    duel._diff[:] = 0.0
    assert record.diff.any()


@pytest.mark.parametrize("pooled", [True, False])
def test_the_cluster_simulation_pools_the_adaptive_rule(pooled: bool) -> None:
    workload = make_workload("gsp", num_groups=8, prompts_per_group=4, system_len=256, question_len=32, output_len=8)
    eviction, retention = EVICTION_POLICIES["adaptive"]
    cluster = ClusterSimulator(workload, SimConfig(2000, page_size=16, eviction_policy=eviction), 3, "round-robin",
                               retention=retention, pooled=pooled)
    cluster.run()
    duels = [sim.config.retention.duel for sim in cluster.sims.values()]
    if not pooled:
        assert all(d.peers is None for d in duels)
        return
    # Every replica was handed the others' evidence: their hits on LRU's ghost, summed.
    own = [d.record().hits[0] for d in duels]
    assert all(d.peers is not None for d in duels)
    assert sum(d.peers.hits[0] for d in duels) > 0 and sum(own) > 0


def test_each_replica_gets_the_sum_of_the_others_records() -> None:
    duels = replicas(pooled=False, rounds=2)
    for i, duel in enumerate(duels):  # different records
        duel._diff *= i + 1
    share_evidence(duels)
    records = [d.record() for d in duels]
    for i, duel in enumerate(duels):
        others = [r for j, r in enumerate(records) if j != i]
        assert duel.peers.to_list() == sum(others[1:], others[0]).to_list()


def test_a_duel_left_alone_drops_the_others_records() -> None:
    # The pool shrinks to one duel: the record it was handed last came from replicas that
    # are gone, which no traffic decays any more; the lone duel decides on its own.
    duels = replicas(pooled=False, rounds=1)
    share_evidence(duels)
    assert duels[0].peers is not None
    share_evidence(duels[:1])
    assert duels[0].peers is None


def test_a_decision_reads_one_peers_record_whole() -> None:
    # A replica's event loop replaces `peers` while the engine thread decides: a decision
    # that read it part by part could test one record's differences against another's
    # variances. Here the swap happens when the first part is read, as a thread switch would.
    zero = LeadDuel(24, 16 * 24).record()
    noisy = zero - zero  # the lead ahead by one sigma: no case
    noisy.diff[1:, 0], noisy.diff[0, 1:], noisy.var[1:, 0], noisy.var[0, 1:] = 10.0, -10.0, 100.0, 100.0
    noisy.hits[1:] = 5
    flat = zero - zero  # no case at all, with a tiny variance
    flat.var[1:, 0] = flat.var[0, 1:] = 0.01
    for peers in (noisy, flat):
        alone = LeadDuel(24, 16 * 24)
        alone.peers = peers
        assert not alone._decide()

    class Swapped:
        """`noisy`, replaced by `flat` on the duel as soon as its differences are read."""

        def __init__(self, duel: LeadDuel) -> None:
            self.duel = duel

        def __getattr__(self, name: str) -> np.ndarray:
            if name == "diff":
                self.duel.peers = flat
            return getattr(noisy, name)

    duel = LeadDuel(24, 16 * 24)
    duel.peers = Swapped(duel)  # type: ignore[assignment]
    assert not duel._decide() and duel.lead == 0.0


def test_a_tree_trailing_at_lru_blocks_no_replica_s_lead() -> None:
    # At LRU each replica's tree misses a few prompts its LRU ghost hits (pages pinned in
    # flight, say): no lead caused that, so it judges no lead, the replica's own (as one duel
    # alone: test_adaptive) nor, pooled, the others'. Then every replica's case for the lead
    # builds, the trees hitting as their lead: each takes it once and keeps it.
    duels = [LeadDuel(24, 16 * 24) for _ in range(REPLICAS)]
    for k in range(6):
        for duel in duels:
            duel.observe([7000, 7001, 7002, 7003], 0, k, 0)
    assert all(not d.record().tree.any() for d in duels)
    doc = list(range(1, 21))
    for r in range(6):
        for duel in duels:
            share_evidence(duels)
            duel.observe(doc, len(doc), 100 + 2 * r, len(doc) if duel.current else 0)
            duel.observe([1000 * (r + 1) + i for i in range(10)], 0, 101 + 2 * r, 0)
    assert [d.lead for d in duels] == [LEADS[-1]] * REPLICAS
    assert [d.switches for d in duels] == [1] * REPLICAS
