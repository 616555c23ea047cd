"""The ingress process's view of the replicas, shared by the request router and ClusterEngine.

Ray Serve builds the request router inside the ingress process (one per deployment handle)
and runs it on its own event loop thread; ClusterEngine, which follows every replica's event
stream, runs on the ingress replica's loop. Both reach the same `ClusterView` through a
process-wide registry keyed by the engine deployment, and every access takes its lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from radixserve.cluster.protocol import EventBatch
from radixserve.cluster.routing import (
    CacheAwareConfig,
    ClusterState,
    ReplicaReport,
    RouteRequest,
    RoutingPolicy,
    make_routing_policy,
)


class ClusterView:
    """Thread-safe: the ClusterState, the routing policy over it, the live replica set, the
    replicas' latest stats, and a listener told when the replica set changes."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.state = ClusterState()
        self._policy: RoutingPolicy = make_routing_policy("cache-aware", self.state)
        self._replicas: frozenset[str] = frozenset()
        self._stats: dict[str, dict[str, Any]] = {}
        self._listener: Callable[[], None] | None = None
        # replica → times the view forgot it: a stream followed since before must start over
        # from a snapshot, or its deltas land on an emptied index (see `generation`)
        self._forgotten: dict[str, int] = {}

    def configure(self, config: CacheAwareConfig) -> None:
        """The cache-aware rule's thresholds (from the router's request_router_kwargs)."""
        with self._lock:
            self._policy = make_routing_policy("cache-aware", self.state, config=config)

    # ------------------------------------------------------------------ the replica set
    def set_replicas(self, replicas: Sequence[str]) -> None:
        """The live replicas, as Ray Serve reports them to the router."""
        with self._lock:
            new = frozenset(replicas)
            changed = new != self._replicas
            for gone in self._replicas - new:
                self._forget_locked(gone)
            for joined in new - self._replicas:
                self.state.joined(joined)
            self._replicas = new
            listener = self._listener
        if changed and listener is not None:
            listener()

    def replica_gone(self, replica: str) -> None:
        """A replica died (its stream broke, or Ray reported its actor dead)."""
        with self._lock:
            self._replicas = self._replicas - {replica}
            self._forget_locked(replica)
            listener = self._listener
        if listener is not None:
            listener()

    @property
    def lock(self) -> threading.RLock:
        """Held while reading `state` directly."""
        return self._lock

    @property
    def replicas(self) -> frozenset[str]:
        with self._lock:
            return self._replicas

    def generation(self, replica: str) -> int:
        """How many times the view forgot `replica`. A replica that leaves and comes back
        before the listener runs looks unchanged to it; its generation says it was wiped."""
        with self._lock:
            return self._forgotten.get(replica, 0)

    def listen(self, listener: Callable[[], None] | None) -> None:
        """`listener()` runs (on the caller's thread) whenever the replica set changes."""
        with self._lock:
            self._listener = listener

    # ------------------------------------------------------------------ what replicas report
    def apply(self, batch: EventBatch) -> None:
        """One batch of a replica's event stream: its cache events, the requests they
        settle, and its stats."""
        stats = batch.stats
        with self._lock:
            if batch.replica not in self._replicas:
                return  # a late batch of a replica already removed
            self.state.index.apply(batch.replica, batch.events)
            self.state.settled(batch.replica, batch.settled)
            self.state.batch_applied(batch.replica)
            self.state.reports[batch.replica] = ReplicaReport(
                pages_free=int(stats.get("pages_free", 0)), pages_total=int(stats.get("pages_total", 0)),
                waiting=int(stats.get("waiting", 0)), running=int(stats.get("running", 0)))
            self._stats[batch.replica] = stats

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """The latest stats of every live replica that has reported."""
        with self._lock:
            return {r: s for r, s in self._stats.items() if r in self._replicas}

    def routed_counts(self) -> dict[str, int]:
        """Requests routed to each replica since this view started (live or not)."""
        with self._lock:
            return dict(self.state.routed_total)

    def in_flight_counts(self) -> dict[str, int]:
        """Requests routed to each live replica and not finished."""
        with self._lock:
            return {r: n for r, n in self.state.in_flight.items() if r in self._replicas}

    # ------------------------------------------------------------------ routing
    def rank(self, request: RouteRequest, replicas: Sequence[str]) -> list[str]:
        """`replicas` best first; those the view no longer counts live (Serve has not noticed
        yet) last, in the order given, and never looked up: that would recreate their state."""
        with self._lock:
            live = [r for r in replicas if r in self._replicas]
            gone = [r for r in replicas if r not in self._replicas]
            return (self._policy.rank(request, live) if live else []) + gone

    def routed(self, request: RouteRequest, replica: str) -> None:
        """A request went to `replica`; ignored once the replica left: late reports (Serve
        still routing to a replica that died) recreated its counts and in-flight prompts,
        and nothing removed them again."""
        with self._lock:
            if replica in self._replicas:
                self.state.routed(request, replica)

    def finished(self, request_id: str) -> None:
        with self._lock:
            self.state.finished(request_id)

    def withdrawn(self, request: RouteRequest) -> None:
        """A reserved request was cancelled before Serve sent it to a replica (ClusterState.withdrawn)."""
        with self._lock:
            self.state.withdrawn(request)

    def session_closed(self, session_id: str, tenant: str | None) -> None:
        """A replica closed `tenant`'s session: it pins no more requests."""
        with self._lock:
            self.state.end_session(session_id, tenant)

    def set_session_ttl(self, seconds: float) -> None:
        """The replicas' session TTL (Engine's session_ttl_s): a session idle longer is forgotten."""
        with self._lock:
            self.state.session_ttl_s = seconds

    def _forget_locked(self, replica: str) -> None:
        self._forgotten[replica] = self._forgotten.get(replica, 0) + 1
        self.state.remove(replica)
        self._stats.pop(replica, None)


_VIEWS: dict[tuple[str, str], ClusterView] = {}
_VIEWS_LOCK = threading.Lock()


def cluster_view(app_name: str, deployment: str) -> ClusterView:
    """The process's view of one engine deployment (created on first use)."""
    with _VIEWS_LOCK:
        return _VIEWS.setdefault((app_name, deployment), ClusterView())
