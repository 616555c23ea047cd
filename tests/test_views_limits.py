"""Limits of the cache views on a real server: event-stream readers opened all at once are
held to their cap, and a tree view whose clients all left stops (cache_routes.py,
cache_views.py)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
from server_util import running_server, wait_for

from radixserve import AsyncEngine, Engine
from radixserve.server import cache_routes, create_app
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
    again, streams = asyncio.run(_open_streams(keyed_url, MALLORY, 1))
    assert again == {"200": 1}
