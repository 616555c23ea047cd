"""Cluster event plumbing without Ray: a replica's feed resubscribed after a snapshot, the
ingress's merged event stream across a replica that resubscribes and one that leaves, and
/cluster/replicas behind an admin's key."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.cache.events import AllCleared, BlockRemoved, BlockStored
from radixserve.cluster.event_hub import ClusterEventHub
from radixserve.cluster.feed import EventFeed
from radixserve.cluster.index import CacheIndex
from radixserve.cluster.protocol import EventBatch
from radixserve.cluster.view import ClusterView
from radixserve.server import create_app
from radixserve.server.tenancy import Caller

PAGE = 4
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


async def _drain(stream, index: CacheIndex) -> None:
    """Applies batches until a heartbeat: everything published so far was delivered."""
    while True:
        batch = await asyncio.wait_for(anext(stream), 5)
        if not batch:
            return
        index.apply("r", batch.events)


def test_a_feed_resubscribed_after_its_snapshot_rebuilds_the_cache_exactly() -> None:
    """A subscriber follows a snapshot and events, leaves while the cache changes (inserts,
    evictions, a flush), and subscribes again: the new snapshot, applied over its stale
    state, and the events after it hold exactly the engine's pages."""
    engine = Engine(model="demo", page_size=PAGE, num_pages=24)
    feed = EventFeed(PAGE)
    engine.subscribe_events(feed.publish)
    engine.generate([list(range(10, 30))], PARAMS)

    async def run() -> CacheIndex:
        index = CacheIndex()
        stream = feed.subscribe(batch_interval_s=0.0, heartbeat_s=0.05)
        index.apply("r", (await anext(stream)).events)
        engine.generate([list(range(10, 22)) + [7, 7, 7, 7]], PARAMS)
        await _drain(stream, index)
        assert index.page_set("r") == engine.cache_page_hashes()
        await stream.aclose()
        stale = index.page_set("r")
        engine.flush_cache()  # while away: everything it held goes, new pages come and are evicted
        for start in (300, 400, 500):
            engine.generate([list(range(start, start + 40))], PARAMS)
        assert not stale & engine.cache_page_hashes()
        stream = feed.subscribe(batch_interval_s=0.0, heartbeat_s=0.05)
        index.apply("r", (await anext(stream)).events)  # the snapshot: a clear, then every page
        assert index.page_set("r") == engine.cache_page_hashes()
        engine.generate([list(range(300, 320)) + [5, 5, 5, 5]], PARAMS)
        await _drain(stream, index)
        await stream.aclose()
        return index

    index = asyncio.run(run())
    assert index.page_set("r") == engine.cache_page_hashes() != set()
    assert feed._subscribers == []


def test_a_feed_snapshot_carries_the_host_tier_too() -> None:
    """A conversation's 4 pages cached, offloaded to the host tier, 2 of them freed on the
    device: a router that subscribes afterwards holds what one following all along holds."""
    feed = EventFeed(PAGE)
    events = [BlockStored(seq=1, namespace="ns", tier="device", page_size=PAGE, parent_hash=None, hashes=[1, 2, 3, 4]),
              BlockStored(seq=2, namespace="ns", tier="host", page_size=PAGE, parent_hash=None, hashes=[1, 2, 3, 4]),
              BlockRemoved(seq=3, namespace="ns", tier="device", hashes=[3, 4])]
    for event in events:
        feed.publish(event)
    following = CacheIndex()
    following.apply("r", events)

    async def subscribed() -> CacheIndex:
        index = CacheIndex()
        stream = feed.subscribe(batch_interval_s=0.0, heartbeat_s=0.05)
        index.apply("r", (await anext(stream)).events)
        await stream.aclose()
        return index

    index = asyncio.run(subscribed())
    assert following.tiered_pages("r", "ns", [1, 2, 3, 4]) == (2, 2)
    assert index.tiered_pages("r", "ns", [1, 2, 3, 4]) == (2, 2)
    assert index.page_set("r", "host") == {("ns", h) for h in (1, 2, 3, 4)}


def _stored(seq: int, namespace: str, hashes: list[int]) -> BlockStored:
    return BlockStored(seq=seq, namespace=namespace, tier="device", page_size=PAGE, parent_hash=None, hashes=hashes)


class _FakeCluster:
    """What ClusterEventHub reads of a ClusterEngine: the view, the page size, the listener."""

    def __init__(self, replicas: list[str]) -> None:
        self.view = ClusterView()
        self.view.set_replicas(replicas)
        self.engine = SimpleNamespace(page_size=PAGE)
        self.cache_listener = None

    def batch(self, replica: str, events: list) -> None:
        """As ClusterEngine._follow: the view applies a batch, then the listener hears it."""
        self.view.apply(EventBatch(replica, events, {}))
        self.cache_listener(replica, events)

    def leave(self, replica: str) -> None:
        self.view.replica_gone(replica)
        self.cache_listener(replica, None)


def test_the_merged_stream_follows_a_replica_that_resubscribes_and_one_that_leaves() -> None:
    """Replica a's stream breaks and is followed again (its new snapshot: a clear, then its
    pages); replica b leaves. A reader applying the merged stream per replica holds what the
    router's index holds, and a reader joining later gets it as its snapshot."""
    cluster = _FakeCluster(["a", "b"])

    async def run() -> tuple[dict, dict]:
        hub = ClusterEventHub(cluster, capacity=64)  # type: ignore[arg-type]
        cluster.batch("a", [AllCleared(seq=0), _stored(0, "n1", [1, 2])])
        cluster.batch("b", [AllCleared(seq=0), _stored(0, "n1", [5])])
        reader = await hub.open_reader()
        held: dict[str, set[int]] = {}
        messages = [json.loads(m) for m in await reader.next(timeout=1)]
        assert [m["type"] for m in messages] == ["snapshot"]
        for block in messages[0]["blocks"]:
            held.setdefault(block["replica"], set()).update(block["hashes"])
        cluster.batch("a", [_stored(1, "n1", [3]), BlockRemoved(seq=2, namespace="n1", tier="device", hashes=[1])])
        cluster.batch("a", [AllCleared(seq=2), _stored(2, "n1", [2, 3]), _stored(2, "n2", [8])])  # resubscribed
        cluster.leave("b")
        seqs = []
        while True:
            batch = await reader.next(timeout=0.2)
            if not batch:
                break
            for message in map(json.loads, batch):
                seqs.append(message["seq"])
                replica = held.setdefault(message["replica"], set())
                if message["type"] == "cleared":
                    replica.clear()
                elif message["type"] == "stored":
                    replica.update(message["hashes"])
                else:
                    replica.difference_update(message["hashes"])
        assert seqs == list(range(messages[0]["seq"] + 1, messages[0]["seq"] + 1 + len(seqs)))
        late = await hub.open_reader()
        snapshot = json.loads((await late.next(timeout=1))[0])
        await reader.close()
        await late.close()
        hub.close()
        return held, snapshot

    held, snapshot = asyncio.run(run())
    assert {r: h for r, h in held.items() if h} == {"a": {2, 3, 8}}
    assert [(b["replica"], b["namespace"], b["hashes"]) for b in snapshot["blocks"]] == [
        ("a", "n1", [2, 3]), ("a", "n2", [8])]
    assert cluster.cache_listener is None  # the closed hub stopped listening


def test_cluster_replicas_needs_an_admin_key_when_the_server_has_keys() -> None:
    pytest.importorskip("ray")
    from radixserve.cluster.deploy import OpenAIIngress

    ingress = object.__new__(OpenAIIngress)  # its Serve constructor aside: the route alone
    ingress.engine = SimpleNamespace(view=ClusterView(), stats=lambda: {"requests_finished": 0})
    ingress._app = create_app(AsyncEngine(Engine(model="demo", page_size=PAGE, num_pages=16)),
                              tenant_keys={"k-tenant": Caller("acme", admin=False)}, admin_api_key="k-admin")
    ingress._app.router.routes.append(Route("/cluster/replicas", ingress._replicas, methods=["GET"]))
    client = TestClient(ingress._app)
    assert client.get("/cluster/replicas").status_code == 401
    assert client.get("/cluster/replicas", headers={"Authorization": "Bearer k-tenant"}).status_code == 403
    response = client.get("/cluster/replicas", headers={"Authorization": "Bearer k-admin"})
    assert response.status_code == 200 and response.json()["replicas"] == []
