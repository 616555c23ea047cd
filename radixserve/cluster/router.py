"""Ray Serve request routers for the engine deployment (the `RequestRouter` API).

`CacheAwareRouter` ranks replicas with radixserve.cluster.routing's cache-aware rule over the
ClusterView (every replica's cached pages from its own event stream). The baselines are Ray
Serve's own routers, unchanged in their rule: `PowerOfTwoRouter` (Serve's default,
PowerOfTwoChoicesRequestRouter) and `PrefixAffinityRouter` (Ray Serve LLM's
PrefixCacheAffinityRouter, fed the prompt's tokens as text, see ReplicaRequest.prompt).

All three share `_ClusterHooks`: a call pinned to one replica (keyword `replica=`: its event
stream, closing a session there, flushing it) goes to that replica; the live replica set
and every routed/completed request are reported to the ClusterView.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

from radixserve.cluster.protocol import ReplicaRequest
from radixserve.cluster.routing import CacheAwareConfig, RouteRequest
from radixserve.cluster.view import ClusterView, cluster_view

PIN = "replica"  # keyword argument of a replica method that names the replica it must run on


def route_request(pending_request: PendingRequest | None) -> RouteRequest | None:
    """The routing view of a generate call (None for any other call)."""
    if pending_request is None or not pending_request.args:
        return None
    request = pending_request.args[0]
    if not isinstance(request, ReplicaRequest):
        return None
    return RouteRequest(pending_request.metadata.internal_request_id, request.namespace,
                        request.page_hashes, len(request.prompt_ids), request.session_id,
                        replica_request_id=request.request_id, tenant=request.tenant)


def not_avoided(candidate_replicas: list[RunningReplica],
                pending_request: PendingRequest | None) -> list[RunningReplica]:
    """The candidates but for those a generate call's request avoids (they refused it for a
    full queue: ClusterEngine.generate tries another), unless that leaves none."""
    request = pending_request.args[0] if pending_request is not None and pending_request.args else None
    avoid = request.avoid if isinstance(request, ReplicaRequest) else ()
    return [r for r in candidate_replicas if r.replica_id.unique_id not in avoid] or candidate_replicas


class _ClusterHooks:
    """Pinned calls, and the ClusterView kept up to date; mixed in before a RequestRouter."""

    _deployment_id: Any

    @property
    def view(self) -> ClusterView:
        return cluster_view(self._deployment_id.app_name, self._deployment_id.name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)  # type: ignore[misc]
        self.view.set_replicas([r.replica_id.unique_id for r in replicas])

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)  # type: ignore[misc]
        self.view.replica_gone(replica_id.unique_id)

    def _pinned(self, candidate_replicas: list[RunningReplica],
                pending_request: PendingRequest | None) -> list[list[RunningReplica]] | None:
        """The replica a pinned call must go to (None: the call is not pinned)."""
        pin = pending_request.kwargs.get(PIN) if pending_request is not None else None
        if pin is None:
            return None
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == pin:
                return [[replica]]
        # The pinned replica is gone: any replica answers WrongReplica at once, rather than
        # Serve retrying forever for a replica that will not come back.
        return [candidate_replicas[:1]]

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pinned = self._pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        return await super().choose_replicas(  # type: ignore[misc]
            not_avoided(candidate_replicas, pending_request), pending_request)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)  # type: ignore[misc]
        request = route_request(pending_request)
        if request is not None:
            self.view.routed(request, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)  # type: ignore[misc]
        self.view.finished(internal_request_id)


class CacheAwareRouter(_ClusterHooks, RequestRouter):
    """Ranks replicas by radixserve's cache-aware rule (routing.CacheAwarePolicy): session,
    balance guard, longest prefix really cached, requests in flight and free pages. Its thresholds come
    from `request_router_kwargs` (CacheAwareConfig's fields)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watched: set[asyncio.Future[Any]] = set()  # pending requests whose reservation is watched

    def initialize_state(self, **config: Any) -> None:
        self.view.configure(CacheAwareConfig(**config))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pinned = self._pinned(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        request = route_request(pending_request)
        if request is None:
            return [candidate_replicas]
        by_key = {r.replica_id.unique_id: r for r in not_avoided(candidate_replicas, pending_request)}
        ranked = self.view.rank(request, list(by_key))
        # Reserved now, so that the next request of a burst sees this one in flight and its prefix
        # (Serve confirms or moves it in on_request_routed once the replica accepted).
        self.view.routed(request, ranked[0])
        self._watch(pending_request, request)
        return [[by_key[key]] for key in ranked]

    def _watch(self, pending_request: PendingRequest, request: RouteRequest) -> None:
        """Takes the reservation back if the request is cancelled while Serve waits for a
        replica with room (every one at its limit): Serve then reports neither its routing nor
        its completion, and the reservation counted in flight on its replica for good."""
        future = pending_request.future
        if future in self._watched:
            return
        self._watched.add(future)

        def over(done: asyncio.Future[Any]) -> None:
            self._watched.discard(done)
            if done.cancelled():
                self.view.withdrawn(request)

        future.add_done_callback(over)


class PowerOfTwoRouter(_ClusterHooks, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default rule (two random replicas, the shorter queue), with pinned calls."""


class PrefixAffinityRouter(_ClusterHooks, PrefixCacheAffinityRouter):
    """Ray Serve LLM's PrefixCacheAffinityRouter, unchanged in its rule, with pinned calls."""


ROUTER_CLASSES: dict[str, type[RequestRouter]] = {
    "cache-aware": CacheAwareRouter,
    "power-of-two": PowerOfTwoRouter,
    "prefix-affinity": PrefixAffinityRouter,
}
