"""A replica's full queue is not the cluster's: the ingress (ClusterEngine, the real one over a
real ClusterView) tries another replica, and the routers skip the replicas a request avoids.
Ray Serve's deployment handle is stood in for; no Ray cluster is needed."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata  # noqa: E402
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402

from radixserve.cluster.engine import ClusterEngine  # noqa: E402
from radixserve.cluster.protocol import Accepted, Refused, ReplicaInfo, ReplicaRequest  # noqa: E402
from radixserve.cluster.router import CacheAwareRouter, not_avoided  # noqa: E402
from radixserve.engine.params import QueueFull, SamplingParams, StreamDelta  # noqa: E402

PAGE = 4
_apps = itertools.count()


class _Stream:
    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._items()

    async def _items(self) -> AsyncIterator[Any]:
        for item in self.items:
            yield item

    def cancel(self) -> None:
        pass


class FullReplicas:
    """Stands in for the engine replicas' handle: the router's choice is the first replica the
    request does not avoid; the replicas in `full` refuse it for a full queue."""

    def __init__(self, replicas: list[str], full: set[str]) -> None:
        self.replicas, self.full = replicas, full
        self.sent: list[tuple[str, tuple[str, ...]]] = []  # (replica, the request's avoid) per call
        self.generate = SimpleNamespace(remote=self._generate)

    def options(self, **_: Any) -> FullReplicas:
        return self

    def _generate(self, request: ReplicaRequest) -> _Stream:
        replica = next((r for r in self.replicas if r not in request.avoid), self.replicas[0])
        self.sent.append((replica, request.avoid))
        if replica in self.full:
            return _Stream([Refused("queue_full", "the waiting queue is full (1 requests)", replica=replica)])
        return _Stream([Accepted(replica), StreamDelta(0, [5], "x", None, "length", 5, 0)])


async def ask(handle: FullReplicas, live: list[str]) -> list[StreamDelta]:
    engine = ClusterEngine(handle, ReplicaInfo("demo", 1024, 1024, PAGE, tokenizer=None),
                           app_name=f"queue-full-{next(_apps)}", deployment="EngineReplica")
    engine.view.set_replicas(live)
    return [delta async for delta in engine.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=1), request_id="r")]


def test_a_full_replica_sends_the_request_to_another_with_room() -> None:
    handle = FullReplicas(["a", "b"], full={"a"})
    deltas = asyncio.run(ask(handle, ["a", "b"]))
    assert [d.token_ids for d in deltas] == [[5]]
    assert handle.sent == [("a", ()), ("b", ("a",))]


def test_the_cluster_is_full_only_when_every_replica_is() -> None:
    handle = FullReplicas(["a", "b"], full={"a", "b"})
    with pytest.raises(QueueFull, match="the waiting queue is full"):
        asyncio.run(ask(handle, ["a", "b"]))
    assert handle.sent == [("a", ()), ("b", ("a",))]  # each tried once; no third call
    alone = FullReplicas(["a"], full={"a"})
    with pytest.raises(QueueFull):
        asyncio.run(ask(alone, ["a"]))
    assert alone.sent == [("a", ())]


def pending(avoid: tuple[str, ...]) -> PendingRequest:
    request = ReplicaRequest("r", list(range(40)), SamplingParams(max_tokens=2), namespace="ns",
                             page_hashes=[1, 2], avoid=avoid)
    return PendingRequest(args=[request], kwargs={},
                          metadata=RequestMetadata(request_id="r", internal_request_id=f"serve-r-{avoid}"))


def test_the_routers_skip_the_replicas_a_request_avoids_while_one_is_left() -> None:
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=r)) for r in ("a", "b", "c")]

    def ids(chosen: list[Any]) -> list[str]:
        return [r.replica_id.unique_id for r in chosen]

    async def scenario() -> None:  # (a PendingRequest's future needs a running loop)
        assert ids(not_avoided(replicas, pending(("a", "c")))) == ["b"]
        assert ids(not_avoided(replicas, pending(("a", "b", "c")))) == ["a", "b", "c"]  # none left: all
        assert ids(not_avoided(replicas, None)) == ["a", "b", "c"]
        router = CacheAwareRouter(deployment_id=DeploymentID(name="engine", app_name="queue-full-router"),
                                  handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state()
        router.view.set_replicas(["a", "b", "c"])
        ranked = [ids(choice) for choice in await router.choose_replicas(replicas, pending(("a",)))]
        assert sorted(ranked) == [["b"], ["c"]]

    asyncio.run(scenario())


def test_the_clusters_queue_bound_is_its_live_replicas_together() -> None:
    """What the ingress refuses a completions batch by (a batch larger can never be queued
    whole: its 503 would have the client retry it for good)."""
    def bound(max_queue: int | None, live: list[str]) -> int | None:
        engine = ClusterEngine(FullReplicas(live, set()), ReplicaInfo("demo", 1024, 1024, PAGE, tokenizer=None,
                                                                      max_queue=max_queue),
                               app_name=f"queue-full-{next(_apps)}", deployment="EngineReplica")
        engine.view.set_replicas(live)
        return engine.max_queue

    assert bound(2, ["a", "b"]) == 4
    assert bound(2, ["a"]) == 2
    assert bound(None, ["a", "b"]) is None
