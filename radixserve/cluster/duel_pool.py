"""The replicas of one model pool their adaptive rule's evidence (cache/adaptive.py:
DuelRecord): each replica's record rides out with the stats of its event batches
(`STATS_KEY`), the ingress hands every request the latest records of all replicas, and the
replica that takes the request gives its duel the sum of the others' as `peers`.

Why through these two messages: both already flow all the time (event batches whenever a
cache changes, requests whenever one arrives), so pooling adds no call, no loop and no
state at the ingress; a record is a few dozen floats. A replica's view of the others is as
fresh as their last event batch.

Threads: a record is copied on the replica's event loop while the engine thread may be
updating the duel (a copy may mix two updates: one prompt's evidence, at most); `peers` is
replaced whole, which the engine thread reads at its next decision.
"""

from __future__ import annotations

from typing import Any

from radixserve.cache.adaptive import AdaptiveReuse, DuelRecord, LeadDuel

STATS_KEY = "lead_duel"  # a replica's stats: its duel's record (DuelRecord.to_list)


def duel_of(engine: Any) -> LeadDuel | None:
    """The lead duel of an Engine using the adaptive rule, else None."""
    history = getattr(engine, "reuse_history", None)
    return history.duel if isinstance(history, AdaptiveReuse) else None


def with_record(stats: dict[str, Any], engine: Any) -> dict[str, Any]:
    """`stats` plus the engine's duel record under STATS_KEY (unchanged without one)."""
    duel = duel_of(engine)
    if duel is not None:
        stats[STATS_KEY] = duel.record().to_list()
    return stats


def records_of(replica_stats: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """The ingress: every replica's latest record, by replica id, from their latest stats."""
    return {replica: stats[STATS_KEY] for replica, stats in replica_stats.items() if STATS_KEY in stats}


def receive(engine: Any, records: dict[str, list[float]], own: str) -> None:
    """The replica `own`: its duel decides from now on with the sum of the other replicas'
    `records` (its own is left out: the duel has it first-hand). A record of another shape
    (a replica of another version) is ignored."""
    duel = duel_of(engine)
    if duel is None:
        return
    others = []
    for replica, values in records.items():
        if replica == own:
            continue
        try:
            others.append(DuelRecord.from_list(values))
        except ValueError:
            continue
    if others:
        duel.peers = sum(others[1:], others[0])
