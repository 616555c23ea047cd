"""The cache-aware Ray Serve router's reservations, driven as Serve drives it (no cluster)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from cluster_util import require_ray

from radixserve import SamplingParams
from radixserve.cluster.protocol import ReplicaRequest

require_ray()
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402

from radixserve.cluster.router import CacheAwareRouter  # noqa: E402


def pending(request_id: str) -> PendingRequest:
    request = ReplicaRequest(request_id, list(range(40)), SamplingParams(max_tokens=2), namespace="ns",
                             page_hashes=[1, 2])
    return PendingRequest(args=[request], kwargs={},
                          metadata=RequestMetadata(request_id=request_id, internal_request_id=f"serve-{request_id}"))


def test_a_request_cancelled_while_serve_waits_for_room_gives_its_reservation_back() -> None:
    """Serve asks the router again and again while every replica is at its limit; a request
    cancelled meanwhile is reported neither routed nor completed. Its reservation was counted
    in flight on its replica for good (skewing every later ranking); now it is taken back."""

    async def scenario() -> None:
        router = CacheAwareRouter(deployment_id=DeploymentID(name="engine", app_name="reservations-test"),
                                  handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        router.view.set_replicas(["a", "b"])
        replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in ("a", "b")]
        cancelled, served = pending("cancelled"), pending("served")
        for _ in range(3):  # asked again while no replica has room: reserved once
            await router.choose_replicas(replicas, cancelled)
        await router.choose_replicas(replicas, served)
        assert sum(router.view.in_flight_counts().values()) == 2
        cancelled.future.cancel()
        served.future.set_result(replicas[0])  # Serve found it room: it reports it routed and completed
        await asyncio.sleep(0)  # the futures' callbacks run
        assert sum(router.view.in_flight_counts().values()) == 1
        router.view.finished(served.metadata.internal_request_id)
        assert sum(router.view.in_flight_counts().values()) == 0

    asyncio.run(scenario())
