"""The replicas of one model pool their adaptive rule's evidence (cache/adaptive.py:
DuelRecord): each replica's record rides out with the stats of its event batches
(`STATS_KEY`), the ingress hands every request the latest records of all replicas, and the
replica that takes the request gives its duel the sum of the others' as `peers`.

They pool what counts as re-seen the same way: each replica reports its reuse window
(`WINDOW_KEY`), the ingress keeps the cluster's reuse history over their sum
(`ClusterReuse`: it sees every request, the router spreads one prefix's requests over the
replicas) and sends each request's count of leading pages seen with it
(`ReplicaRequest.cluster_seen`); the replica hands it to its rule (`expect_seen`), which
boosts those pages instead of the ones its own history saw. When the replica that served a
prompt's seen pages last has lost them and the router sends the prompt elsewhere, the
ingress tells that replica (`ClusterReuse.took`, then the replica's `elsewhere` call: the
one call this adds, only for such prompts; `tell_elsewhere`), whose ghost caches replay the
prompt: a lead that had kept the pages would have drawn the request back, which the ghost
caches cannot see from the traffic the replica gets.

Why through these two messages: both already flow all the time (event batches whenever a
cache changes, requests whenever one arrives), so pooling adds no loop and no call but the
`elsewhere` above, and the ingress keeps one piece of state (the cluster's reuse history:
the page hashes seen within its window, and which replica took each last); a record is a
few dozen floats. A replica's view of the others is as fresh as their last event batch.

Threads: a record is copied on the replica's event loop while the engine thread may be
updating the duel (a copy may mix two updates: one prompt's evidence, at most); `peers` is
replaced whole, and the engine thread reads it once per decision (`LeadDuel._decide`), so a
decision never mixes two replacements. With no other replica's record (the others left, or
send records of another shape) `peers` is cleared.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

from radixserve.cache.adaptive import AdaptiveReuse, DuelRecord, LeadDuel
from radixserve.cache.reuse import ClusterHistory

STATS_KEY = "lead_duel"  # a replica's stats: its duel's record (DuelRecord.to_list)
WINDOW_KEY = "reuse_window"  # ... and its reuse history's window, in page observations


def duel_of(engine: Any) -> LeadDuel | None:
    """The lead duel of an Engine using the adaptive rule, else None."""
    history = getattr(engine, "reuse_history", None)
    return history.duel if isinstance(history, AdaptiveReuse) else None


def with_record(stats: dict[str, Any], engine: Any) -> dict[str, Any]:
    """`stats` plus the engine's duel record under STATS_KEY and its reuse window under
    WINDOW_KEY (unchanged without a duel)."""
    duel = duel_of(engine)
    if duel is not None:
        stats[STATS_KEY] = duel.record().to_list()
        stats[WINDOW_KEY] = engine.reuse_history.history.window_pages
    return stats


def records_of(replica_stats: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """The ingress: every replica's latest record, by replica id, from their latest stats."""
    return {replica: stats[STATS_KEY] for replica, stats in replica_stats.items() if STATS_KEY in stats}


def receive(engine: Any, records: dict[str, list[float]], own: str) -> None:
    """The replica `own`: its duel decides from now on with the sum of the other replicas'
    `records` (its own is left out: the duel has it first-hand). A record of another shape
    (a replica of another version) is ignored. With no other record, the duel decides on its
    own evidence alone: a record is decayed only by its replica's traffic, so one kept from a
    replica that left would count, undecayed, for good."""
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
    duel.peers = sum(others[1:], others[0]) if others else None


class ClusterReuse:
    """The ingress's reuse history of the whole cluster (`ClusterHistory`): its window is
    the sum of the live replicas' reuse windows (as they report them), so it spans as many
    caches' worth of traffic as each replica's own does of its share.

    `enabled=False` (`ClusterOptions.cluster_reuse`, for an A/B) keeps no history: no request
    carries a count and no replica is told a prompt went elsewhere, so each replica's rule
    counts what it saw itself (the pooled duel records still flow). `counts_sent` and
    `elsewhere_sent` count the two messages (requests given a count, replicas told)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.history: ClusterHistory | None = None
        self.counts_sent = 0
        self.elsewhere_sent = 0

    def observe(self, hashes: list[int], replica_stats: dict[str, dict[str, Any]]) -> int | None:
        """Leading pages of a prompt (its routing page hashes, `hashes`) the cluster saw
        recently, recording the prompt as seen; None while no replica runs the adaptive rule
        (no window reported), and always when not `enabled`."""
        if not self.enabled:
            return None
        window = sum(int(stats.get(WINDOW_KEY, 0)) for stats in replica_stats.values())
        if window <= 0:
            return None
        if self.history is None:
            self.history = ClusterHistory(window)
        self.history.window_pages = window
        self.counts_sent += 1
        return self.history.observe_hashes(hashes)

    def took(self, hashes: list[int], seen: int | None, replica: str,
             held: Callable[[str], int], live: Container[str] | None = None) -> str | None:
        """`replica` took the prompt (`seen`: what `observe` returned for it); returns the
        replica to tell that the prompt went elsewhere (`ClusterHistory.took`; `held`: the
        leading pages a replica holds, as its events say), or None. A home not among the
        `live` replicas (when given) is told nothing: it has left, so it holds nothing
        (`held` says 0) and there is no duel to replay the prompt, only a call that fails."""
        if self.history is None or seen is None:
            return None
        home = self.history.took(hashes, seen, replica, held)
        if home is None or (live is not None and home not in live):
            return None
        self.elsewhere_sent += 1
        return home

    def messages(self) -> dict[str, int | bool]:
        """What this history has sent so far (for benchmarks: did the switch take?)."""
        return {"enabled": self.enabled, "counts_sent": self.counts_sent, "elsewhere_sent": self.elsewhere_sent}


def expect_seen(engine: Any, prompt_ids: list[int], cluster_seen: int | None) -> None:
    """The replica: its adaptive rule counts `prompt_ids`' re-seen pages as the cluster's
    `cluster_seen` when the engine takes the prompt (nothing without a count or a duel)."""
    history = getattr(engine, "reuse_history", None)
    if cluster_seen is not None and isinstance(history, AdaptiveReuse):
        history.expect(prompt_ids, cluster_seen)


def tell_elsewhere(engine: Any, prompt_ids: list[int], namespace: Any) -> None:
    """The replica: the router sent this prompt, whose leading pages the cluster saw it
    serve last and it has lost, to another replica; its adaptive rule's ghost caches replay it
    (nothing without a duel)."""
    history = getattr(engine, "reuse_history", None)
    if isinstance(history, AdaptiveReuse):
        history.elsewhere(prompt_ids, namespace)
