"""Limits of the cache views on a real server: event-stream readers opened all at once are
held to their cap, and a tree view whose clients all left stops (cache_routes.py,
cache_views.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from typing import Any

import httpx
import pytest
from server_util import running_server, wait_for
from starlette.applications import Starlette

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.cache import page_hash
from radixserve.engine.request import namespace_of
from radixserve.server import cache_routes, create_app
from radixserve.server.cache_routes import CacheRoutes
from radixserve.server.tenancy import Caller

VICTIM, MALLORY, ADMIN = "k-victim", "k-mallory", "k-admin"
KEYS = {VICTIM: Caller("victim", admin=False), MALLORY: Caller("mallory", admin=False)}


@pytest.fixture
def keyed_url() -> Iterator[str]:
    """A server with two tenants' keys and an admin's."""
    engine = Engine(model="demo", page_size=4, num_pages=1024)
    with running_server(create_app(AsyncEngine(engine), tenant_keys=KEYS, admin_api_key=ADMIN)) as url:
        yield url


def _readers(url: str) -> int:
    stats = httpx.get(f"{url}/v1/cache/stats", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    return stats.json()["events"]["readers"]


async def _open_streams(url: str, key: str, count: int) -> tuple[Counter[str], list[asyncio.StreamWriter]]:
    """Opens `count` connections first, then sends every request at once (no await between
    them), so the server handles them together; the status of each and the open writers."""
    host, port = url.removeprefix("http://").split(":")
    connections = [await asyncio.open_connection(host, int(port)) for _ in range(count)]
    request = f"GET /v1/cache/events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
    for _, writer in connections:
        writer.write(request)
    statuses = Counter([(await reader.readline()).split()[1].decode() for reader, _ in connections])
    return statuses, [writer for _, writer in connections]


def test_event_readers_opened_at_once_are_held_to_their_share(monkeypatch: pytest.MonkeyPatch,
                                                              keyed_url: str) -> None:
    """The readers were counted only once their stream started, after the handler's check:
    requests arriving together all passed it (300 at once were all admitted, and every other
    tenant, the admin too, got a 503). The slot is now taken in the handler."""
    monkeypatch.setattr(cache_routes, "MAX_EVENT_READERS", 4)

    async def attack() -> None:
        statuses, held = await _open_streams(keyed_url, MALLORY, 32)
        assert statuses == {"200": 4, "503": 28}  # one tenant alone: its share is the whole 4
        assert _readers(keyed_url) == 4
        victim, victim_streams = await _open_streams(keyed_url, VICTIM, 16)
        assert victim == {"200": 2, "503": 14}  # two tenants hold streams: 2 of 4 each
        admin, admin_streams = await _open_streams(keyed_url, ADMIN, 1)
        assert admin == {"200": 1}
        for writer in held + victim_streams + admin_streams:
            writer.close()

    asyncio.run(attack())
    # Closed streams give their slots back, whether or not they had started.
    assert wait_for(lambda: _readers(keyed_url) == 0)

    async def one_more() -> dict[str, int]:
        statuses, streams = await _open_streams(keyed_url, MALLORY, 1)
        for writer in streams:  # (left open, it held the server's shutdown for 5 s)
            writer.close()
        return statuses

    assert asyncio.run(one_more()) == {"200": 1}


def _tree_routes(app: Starlette) -> CacheRoutes:
    return next(route.endpoint.__self__ for route in app.routes if getattr(route, "path", "") == "/v1/cache/tree")


def test_a_tree_view_whose_clients_all_left_stops() -> None:
    """Each view was built in a shielded task that went on after its clients had left (100
    abandoned views ran 23,777 pieces on the engine thread and held a live view up 28-fold).
    The engine thread is held by a piece of work of our own while the clients come and go, so
    nothing of theirs can run before they leave: afterwards, none of it runs at all."""
    engine = Engine(model="demo", page_size=2, num_pages=2048)
    engine.generate([[group, 7, 8, 9, branch, 1] for group in range(1, 9) for branch in range(1, 9)],
                    SamplingParams(max_tokens=1, temperature=0))
    async_engine = AsyncEngine(engine)
    app = create_app(async_engine)
    views = _tree_routes(app).views
    holding, release = threading.Event(), threading.Event()

    def hold() -> Generator[None, None, None]:
        holding.set()
        release.wait(timeout=300)  # the engine thread runs nothing else meanwhile
        return
        yield

    with running_server(app) as url:
        port = int(url.rsplit(":", 1)[1])
        loop = async_engine._loop
        held = asyncio.run_coroutine_threadsafe(_run_sliced(async_engine, hold), loop)
        assert holding.wait(timeout=300)
        try:
            pieces = async_engine.stats()["view_pieces"]
            clients = []
            for max_nodes in range(100, 110):  # ten distinct views, one client each
                client = socket.create_connection(("127.0.0.1", port))
                client.sendall(f"GET /v1/cache/tree?max_nodes={max_nodes} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                clients.append(client)
            assert wait_for(lambda: len(views._inflight) == 10)
            builds = [getattr(build, "future", build) for build in views._inflight.values()]
            for client in clients:
                client.close()
            # Each build is cancelled once the server has seen its client leave.
            assert wait_for(lambda: all(build.cancelling() or build.done() for build in builds))
        finally:
            release.set()  # whatever happened, the engine thread goes on
        held.result(timeout=300)
        assert wait_for(lambda: not views._inflight and all(build.done() for build in builds))
        assert [build.cancelled() for build in builds] == [True] * 10
        # Not one piece of theirs ran: the shared copy they waited for was dropped with them.
        assert async_engine.stats()["view_pieces"] == pieces
        # A view asked for now is built as ever.
        tree = httpx.get(f"{url}/v1/cache/tree", timeout=300).json()
        assert tree["nodes_total"] == engine.stats()["cache_nodes"] == 72


async def _run_sliced(async_engine: AsyncEngine, make_work: Callable[[], Generator[None, None, None]]) -> None:
    await async_engine.run_sliced(make_work)


def test_page_hashing_remembers_a_bounded_number_of_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every namespace ever named stayed in PageHashing's tables, long after it had left the
    cache (a distinct cache_salt per request: about 0.7 KB each). They now hold the most
    recently named or looked up; a namespace named again gets the same id."""
    monkeypatch.setattr(page_hash, "MAX_NAMESPACES", 8, raising=False)
    engine = Engine(model="demo", page_size=4, num_pages=512, cache_hash_secret="secret")
    events: list[Any] = []
    engine.subscribe_events(events.append)  # as an open event stream does: events name namespaces
    hashing = engine.hashing
    live = namespace_of(engine.model_name, "kept", "acme")
    for salt in range(40):
        engine.add_request([1, 2, 3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=1, temperature=0),
                           cache_salt=f"salt-{salt:04d}", tenant="acme")
        while engine.has_work():
            engine.step()
        engine.flush_cache()
        kept_id = hashing.namespace_id(live)  # a namespace in use all along
    assert len(hashing._namespaces) == len(hashing._named) == 8
    assert hashing.namespace_of_id(kept_id) == live
    forgotten = namespace_of(engine.model_name, "salt-0000", "acme")
    assert hashing.namespace_of_id(events[0].namespace) is None  # its first event's id: forgotten
    assert hashing.namespace_id(forgotten) == events[0].namespace  # named anew: the same id
    assert hashing.namespace_of_id(events[0].namespace) == forgotten and len(hashing._namespaces) == 8
