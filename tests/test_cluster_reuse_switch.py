"""The switch that turns the cluster's reuse history off (`ClusterOptions.cluster_reuse`,
`ClusterEngine(cluster_reuse=...)`, duel_pool.py `ClusterReuse(enabled=...)`), for an A/B
of what it is worth on a served cluster (bench/cluster_routers.py `--cluster-reuse`).

On, the ingress sends each request the count of its leading pages the cluster saw
(`ReplicaRequest.cluster_seen`) and tells a replica that lost a prompt it served last that
the prompt went elsewhere (its `elsewhere` call); off, neither message is sent. The
ClusterEngine here is the real one over a real ClusterView; only Ray Serve's deployment
handle is stood in for (it records what the ingress sends and answers as a replica would),
so no Ray cluster is needed."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("ray.serve")

from radixserve.cache.adaptive import AdaptiveReuse
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cluster.deploy import ClusterOptions
from radixserve.cluster.duel_pool import WINDOW_KEY, ClusterReuse, with_record
from radixserve.cluster.engine import ClusterEngine
from radixserve.cluster.protocol import Accepted, EventBatch, ReplicaInfo, ReplicaRequest
from radixserve.engine.params import SamplingParams

PAGE = 4
_apps = itertools.count()


class _Stream:
    """A replica's generate stream as a handle returns it: Accepted, then (here) nothing."""

    def __init__(self, replica: str) -> None:
        self.replica = replica

    def __aiter__(self) -> AsyncIterator[Accepted]:
        return self._items()

    async def _items(self) -> AsyncIterator[Accepted]:
        yield Accepted(self.replica)

    def cancel(self) -> None:
        pass


class _Method:
    def __init__(self, remote: Any) -> None:
        self.remote = remote


class ServeHandle:
    """Stands in for Ray Serve's DeploymentHandle of the engine replicas: requests go to the
    replicas of `route` in turn; records every ReplicaRequest and every `elsewhere` call."""

    def __init__(self, route: list[str]) -> None:
        self.route = iter(route)
        self.requests: list[ReplicaRequest] = []
        self.told: list[str] = []  # the replica of each `elsewhere`
        self.generate = _Method(self._generate)
        self.elsewhere = _Method(self._elsewhere)

    def options(self, **_: Any) -> ServeHandle:
        return self

    def _generate(self, request: ReplicaRequest) -> _Stream:
        self.requests.append(request)
        return _Stream(next(self.route))

    async def _elsewhere(self, prompt_ids: list[int], cache_salt: str | None, tenant: str | None,
                         replica: str) -> None:
        self.told.append(replica)


def adaptive_stats() -> dict[str, Any]:
    """The stats a replica running the adaptive rule sends with its event batches."""
    replica = SimpleNamespace(reuse_history=AdaptiveReuse(RadixTree(PagePool(16, PAGE), eviction_policy="adaptive"),
                                                         16 * 16))
    return with_record({"pages_total": 16, "pages_free": 16}, replica)


async def serve_doc_twice(cluster_reuse: bool, a_leaves: bool = False) -> tuple[ServeHandle, ClusterEngine]:
    """One document asked twice: first on replica a, then (a holding none of it, as its
    events say, or gone with `a_leaves`) on replica b."""
    handle = ServeHandle(["a", "b"])
    info = ReplicaInfo("demo", 1024, 1024, PAGE, tokenizer=None)
    engine = ClusterEngine(handle, info, app_name=f"reuse-switch-{next(_apps)}", deployment="EngineReplica",
                           cluster_reuse=cluster_reuse)
    engine.view.set_replicas(["a", "b"])
    for replica in ("a", "b"):
        engine.view.apply(EventBatch(replica, [], adaptive_stats()))
    doc = list(range(100, 100 + 3 * PAGE))
    for i, question in enumerate((7, 8)):
        if i == 1 and a_leaves:
            engine.view.set_replicas(["b"])
        async for _ in engine.generate(doc + [question], SamplingParams(max_tokens=1), request_id=f"r{i}"):
            pass
    await asyncio.gather(*engine._telling)  # the `elsewhere` call runs in the background
    return handle, engine


def test_on_the_replicas_get_the_clusters_count_and_the_elsewhere_call() -> None:
    handle, engine = asyncio.run(serve_doc_twice(cluster_reuse=True))
    assert [r.cluster_seen for r in handle.requests] == [0, 3]  # b learns the cluster saw the doc's 3 pages
    assert handle.told == ["a"]  # a served it last and lost it: its ghosts replay it
    assert engine.reuse.messages() == {"enabled": True, "counts_sent": 2, "elsewhere_sent": 1}


def test_off_neither_message_is_sent() -> None:
    handle, engine = asyncio.run(serve_doc_twice(cluster_reuse=False))
    assert [r.cluster_seen for r in handle.requests] == [None, None]
    assert handle.told == []
    assert engine.reuse.history is None
    assert engine.reuse.messages() == {"enabled": False, "counts_sent": 0, "elsewhere_sent": 0}
    # What else the requests carry is unchanged: the replicas' pooled duel records.
    assert all(set(r.duel_records) == {"a", "b"} for r in handle.requests)


def test_the_switch_is_on_by_default() -> None:
    assert ClusterOptions().cluster_reuse is True
    assert ClusterReuse().enabled is True
    stats = {"a": {WINDOW_KEY: 100}}
    off = ClusterReuse(enabled=False)
    assert off.observe([1, 2], stats) is None and off.observe([1, 2], stats) is None
    assert off.took([1, 2], 2, "a", lambda r: 0) is None  # even handed a count, it has no history


def test_a_home_that_left_is_not_told() -> None:
    # The replica that served the document last has left: the view says so, and nothing is
    # sent to it (the call would only fail: no replica, no duel to replay the prompt).
    handle, engine = asyncio.run(serve_doc_twice(cluster_reuse=True, a_leaves=True))
    assert [r.cluster_seen for r in handle.requests] == [0, 3]  # the cluster's count still goes to b
    assert handle.told == []
    assert engine.reuse.messages() == {"enabled": True, "counts_sent": 2, "elsewhere_sent": 0}
