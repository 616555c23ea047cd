"""The ingress's view of the replica set when streams break and replicas come and go: a
ClusterEngine over a real ClusterView, following event streams from a stand-in for Ray
Serve's deployment handle (no Ray cluster). Ray's own error classes are raised as Ray
would raise them."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError, ActorUnavailableError

from radixserve.cache.events import AllCleared, BlockStored
from radixserve.cluster import engine as cluster_engine
from radixserve.cluster.engine import ClusterEngine
from radixserve.cluster.event_hub import ClusterEventHub
from radixserve.cluster.protocol import EventBatch, ReplicaInfo
from radixserve.cluster.routing import RouteRequest

PAGE = 4
_apps = itertools.count()


def _stored(hashes: list[int], tier: str = "device") -> BlockStored:
    return BlockStored(seq=0, namespace="ns", tier=tier, page_size=PAGE, parent_hash=None,
                       hashes=hashes, token_ids=None)


class _EventStream:
    """A replica's event stream: a snapshot of `pages`, then heartbeats, or `error` raised
    right after the snapshot."""

    def __init__(self, replica: str, number: int, pages: list[int], error: Exception | None) -> None:
        self.replica, self.number, self.pages, self.error = replica, number, pages, error

    def __aiter__(self) -> AsyncIterator[EventBatch]:
        return self._batches()

    async def _batches(self) -> AsyncIterator[EventBatch]:
        yield EventBatch(self.replica, [AllCleared(seq=0), _stored(self.pages)], {"pages_free": 10})
        if self.error is not None:
            raise self.error
        while True:
            await asyncio.sleep(0.01)
            yield EventBatch(self.replica, [], {"pages_free": 10})

    def cancel(self) -> None:
        pass


class EventsHandle:
    """Stands in for the engine deployment's handle: `events(replica=...)` streams; the
    first subscription of a replica in `errors` raises that error after its snapshot."""

    def __init__(self, errors: dict[str, Exception]) -> None:
        self.errors = errors
        self.subscriptions: dict[str, int] = {}
        self.events = SimpleNamespace(remote=self._events)

    def options(self, **_: Any) -> EventsHandle:
        return self

    def _events(self, replica: str) -> _EventStream:
        number = self.subscriptions[replica] = self.subscriptions.get(replica, 0) + 1
        return _EventStream(replica, number, [1, 2, 3], self.errors.pop(replica, None))


def _engine(handle: EventsHandle) -> ClusterEngine:
    info = ReplicaInfo("demo", 100, 100, PAGE, None)
    return ClusterEngine(handle, info, app_name=f"router-set-{next(_apps)}", deployment="engines")  # type: ignore[arg-type]


async def _until(holds: Callable[[], bool], timeout: float = 60.0) -> None:
    """Waits for a state the followers reach on their own (never a fixed delay: the machine
    may be loaded)."""
    async with asyncio.timeout(timeout):
        while not holds():
            await asyncio.sleep(0.01)


def _cached(engine: ClusterEngine, replica: str) -> int:
    with engine.view.lock:
        return engine.view.state.index.cached_pages(replica)


def test_a_replica_unavailable_for_a_moment_stays_live_and_is_followed_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_engine, "RESUBSCRIBE_DELAY_S", 0.01)
    handle = EventsHandle({"a": ActorUnavailableError("network blip", None)})
    engine = _engine(handle)

    async def run() -> None:
        engine.view.set_replicas(["a", "b"])
        await engine.start()
        await _until(lambda: handle.subscriptions.get("a") == 2 and _cached(engine, "a") == 3
                     and handle.subscriptions.get("b") == 1)
        try:
            assert engine.view.replicas == {"a", "b"}
            assert handle.subscriptions == {"a": 2, "b": 1}  # a resubscribed once, from a snapshot
            assert sorted(engine.view.replica_stats()) == ["a", "b"]
            assert engine.health() is None
            with engine.view.lock:
                assert engine.view.state.index.cached_pages("a") == 3
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_a_replica_whose_actor_died_is_dropped_until_serve_lists_it_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_engine, "RESUBSCRIBE_DELAY_S", 0.01)
    handle = EventsHandle({"a": ActorDiedError()})
    engine = _engine(handle)

    async def run() -> None:
        engine.view.set_replicas(["a", "b"])
        await engine.start()
        await _until(lambda: engine.view.replicas == {"b"} and handle.subscriptions.get("b") == 1)
        try:
            assert handle.subscriptions == {"a": 1, "b": 1}  # dropped for good: no resubscribing
            assert sorted(engine.view.replica_stats()) == ["b"]
            engine.view.set_replicas(["a", "b"])  # Serve still lists it: followed again
            await _until(lambda: handle.subscriptions.get("a") == 2 and _cached(engine, "a") == 3)
            assert engine.view.replicas == {"a", "b"}
            assert handle.subscriptions == {"a": 2, "b": 1}
            with engine.view.lock:
                assert engine.view.state.index.cached_pages("a") == 3
        finally:
            await engine.shutdown()

    asyncio.run(run())


class SessionsHandle:
    """Stands in for the engine deployment's handle for `close_session`: replica `holder`
    holds the sessions in `open_sessions` ((tenant, session id)); every other replica none."""

    def __init__(self, holder: str, open_sessions: set[tuple[str | None, str]]) -> None:
        self.holder, self.open = holder, open_sessions
        self.close_session = SimpleNamespace(remote=self._close)

    async def _close(self, session_id: str, tenant: str | None, replica: str) -> bool:
        if replica != self.holder or (tenant, session_id) not in self.open:
            return False
        self.open.discard((tenant, session_id))
        return True


def test_closing_a_session_unpins_it_from_its_replica() -> None:
    handle = SessionsHandle("a", {("A", "s1")})
    info = ReplicaInfo("demo", 100, 100, PAGE, None)
    engine = ClusterEngine(handle, info, app_name=f"router-set-{next(_apps)}",  # type: ignore[arg-type]
                           deployment="engines")
    engine.view.set_replicas(["a", "b"])
    for tenant, session in [("A", "s1"), ("B", "s1")]:
        engine.view.routed(RouteRequest(f"{tenant}-{session}", "ns", [1, 2], 8, session, tenant=tenant), "a")

    async def run() -> tuple[bool, bool]:
        return await engine.close_session("s1", "B"), await engine.close_session("s1", "A")

    assert asyncio.run(run()) == (False, True)  # B's was never open on a replica: kept
    with engine.view.lock:
        assert list(engine.view.state.sessions) == [("B", "s1")]


def test_a_replica_that_leaves_and_returns_before_the_loop_runs_is_followed_afresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_engine, "RESUBSCRIBE_DELAY_S", 0.01)
    handle = EventsHandle({})
    engine = _engine(handle)

    async def run() -> None:
        engine.view.set_replicas(["a", "b"])
        await engine.start()
        await _until(lambda: _cached(engine, "a") == 3 and _cached(engine, "b") == 3)
        try:
            engine.view.set_replicas(["b"])  # both before the loop runs the listener
            engine.view.set_replicas(["a", "b"])
            await _until(lambda: handle.subscriptions.get("a") == 2 and _cached(engine, "a") == 3)
            assert handle.subscriptions == {"a": 2, "b": 1}  # a's snapshot again
            with engine.view.lock:
                assert engine.view.state.index.cached_pages("a") == 3
        finally:
            await engine.shutdown()

    asyncio.run(run())


def test_the_merged_event_streams_snapshot_lists_each_tiers_pages() -> None:
    """A reader of a cluster's merged /v1/cache/events starts from the router's index: the
    replicas' host-tier pages are in it, as in a single server's snapshot (it listed the
    device pages only)."""
    engine = _engine(EventsHandle({}))
    hub = ClusterEventHub(engine, capacity=64)
    engine.view.set_replicas(["a"])
    engine.view.apply(EventBatch("a", [AllCleared(seq=0), _stored([1, 2]), _stored([3], tier="host")],
                                 {"pages_free": 10}))

    async def snapshot() -> dict[str, Any]:
        mirror = await hub.current_mirror()
        return msgspec.json.decode(mirror.encoded(msgspec.json.Encoder()))

    blocks = asyncio.run(snapshot())["blocks"]
    assert [(b["replica"], b["tier"], b["hashes"]) for b in blocks] == [("a", "device", [1, 2]), ("a", "host", [3])]
