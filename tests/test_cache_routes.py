"""The /v1/cache routes over a real server: the SSE event stream rebuilt by an outside indexer,
a slow reader's reset, flush, the key, and what may leave the server."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cache_indexer import PageIndexer, tree_page_hashes
from server_util import running_server

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.engine.event_stream import CacheEventHub
from radixserve.server import cache_routes, create_app

API_KEY = "cache-routes-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PAGE_SIZE = 4


@pytest.fixture(autouse=True)
def quick_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep-alive comments every 0.2 s, not 15: a follower's reading thread, blocked until
    the next line, then notices `close()` at once (and the comments get skipped often)."""
    monkeypatch.setattr(cache_routes, "KEEPALIVE_S", 0.2)


class StreamFollower:
    """Reads /v1/cache/events in a thread and feeds an indexer, message by message."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.indexer = PageIndexer()
        self.messages: list[dict[str, Any]] = []
        self.first = threading.Event()
        self.error: BaseException | None = None
        self._client = httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(60, read=None))
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self.first.wait(60), "no snapshot arrived"

    def _run(self) -> None:
        try:
            with self._client.stream("GET", "/v1/cache/events") as response:
                assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
                for line in response.iter_lines():
                    if self._stop:
                        return
                    if not line or line.startswith(":"):
                        continue
                    assert line.startswith("data: "), line
                    message = json.loads(line[len("data: "):])
                    self.messages.append(message)
                    self.indexer.apply(message)
                    self.first.set()
        except BaseException as exc:  # reported by close()
            if not self._stop:
                self.error = exc
            self.first.set()

    def wait_for_seq(self, seq: int) -> None:
        deadline = time.monotonic() + 60
        while (self.indexer.seq or 0) < seq and self.error is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.error is None and self.indexer.seq == seq, (self.error, self.indexer.seq, seq)

    def close(self) -> None:
        self._stop = True
        self._client.close()
        self._thread.join(timeout=30)
        assert self.error is None, self.error


def first_message(url: str) -> dict[str, Any]:
    """The snapshot a new reader starts with."""
    follower = StreamFollower(url, AUTH)
    try:
        return follower.messages[0]
    finally:
        follower.close()


def idle(client: httpx.Client) -> None:
    for _ in range(1200):
        s = client.get("/v1/cache/stats").json()
        if s["requests"]["running"] == 0 and s["requests"]["waiting"] == 0 and s["tiers"]["device"]["pages_locked"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle: {s}")


@pytest.fixture
def keyed_server(tiny_llama_dir: Path) -> Iterator[tuple[str, Engine]]:
    engine = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=40, debug_checks=True)
    with running_server(create_app(AsyncEngine(engine), api_key=API_KEY)) as url:
        yield url, engine
    engine.check_invariants()


def test_event_stream_indexer_agrees_with_the_tree(keyed_server: tuple[str, Engine]) -> None:
    url, engine = keyed_server
    follower = StreamFollower(url, AUTH)
    assert follower.messages[0] == {"type": "snapshot", "seq": 0, "page_size": PAGE_SIZE, "blocks": []}
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 30))] for _ in range(6)]

    def client_work(worker: int) -> None:
        local = random.Random(worker)
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
            for i in range(20):
                prompt = local.choice(prefixes) + [local.randrange(3, 300) for _ in range(local.randrange(1, 24))]
                body = {"prompt": prompt, "max_tokens": local.randrange(1, 6), "temperature": 0,
                        "ignore_eos": True, "cache_salt": local.choice([None, "tenant"])}
                if i % 10 == 9:  # a client that leaves mid-stream: its request is aborted
                    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                         "max_tokens": 80}) as r:
                        assert r.status_code == 200
                        next(r.iter_lines())
                elif i % 15 == 7:
                    assert client.post("/v1/cache/flush").status_code == 200
                else:
                    assert client.post("/v1/completions", json=body).status_code == 200

    workers = [threading.Thread(target=client_work, args=(w,)) for w in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
        idle(client)
        stats = client.get("/v1/cache/stats").json()
    snapshot = first_message(url)  # a second reader's view of the same moment
    follower.wait_for_seq(snapshot["seq"])
    truth = {(b["namespace"], h) for b in snapshot["blocks"] for h in b["hashes"]}
    assert follower.indexer.pages == truth and snapshot["seq"] > 50
    assert follower.indexer.counts["cleared"] == 2 and follower.indexer.counts["removed"] > 0
    assert stats["evicted_pages"] > 0 and stats["requests"]["requests_aborted"] == 4
    assert all(m.get("token_ids") is None for m in follower.messages)  # not exposed by default
    follower.close()
    assert follower.indexer.pages == tree_page_hashes(engine.tree) == engine.cache_page_hashes()
    for _ in range(200):  # the last reader left: the engine stops hashing
        if not engine.cache_events.active:
            break
        time.sleep(0.05)
    assert not engine.cache_events.active


def test_every_cache_route_needs_the_key(keyed_server: tuple[str, Engine]) -> None:
    url, _ = keyed_server
    with httpx.Client(base_url=url, timeout=60) as client:
        for method, path in [("GET", "/v1/cache/tree"), ("GET", "/v1/cache/stats"),
                             ("POST", "/v1/cache/flush"), ("GET", "/v1/cache/events")]:
            r = client.request(method, path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            r = client.request(method, path, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, path
        assert client.get("/v1/cache/stats", headers=AUTH).status_code == 200
        page = client.get("/dashboard")  # the page holds no data: no key needed
        assert page.status_code == 200 and "dashboard.js" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert client.get("/dashboard/dashboard.js").headers["content-type"].startswith("text/javascript")
        assert client.get("/dashboard/secrets.txt").status_code == 404
        r = client.get("/v1/cache/tree?max_nodes=zero", headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_nodes"
        r = client.get("/v1/cache/tree?max_depth=257", headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_depth"
        r = client.get("/v1/cache/tree?tokens=true", headers=AUTH)
        assert r.status_code == 403 and r.json()["error"]["code"] == "tokens_not_exposed"


def test_flush_answers_pages_freed_and_tokens_only_with_the_flag(tiny_llama_dir: Path) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=64)
    prompt = list(range(10, 31))  # 21 tokens: 5 full pages once computed
    with running_server(create_app(AsyncEngine(engine), expose_cache_tokens=True)) as url:
        follower = StreamFollower(url, {})
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
            idle(client)
            follower.wait_for_seq(1)
            stored = [m for m in follower.messages if m["type"] == "stored"]
            assert len(stored) == 1 and stored[0]["token_ids"] == prompt[:20] and stored[0]["parent_hash"] is None
            tree = client.get("/v1/cache/tree?tokens=true").json()
            (node,) = tree["root"]["children"][0]["children"]
            assert node["token_ids"] == prompt[:20] and node["text"] == engine.tokenizer.decode(prompt[:20])
            r = client.post("/v1/cache/flush")
            # The 5 full pages and the partial page holding the 21st token; no host tier here.
            assert r.json() == {"object": "cache.flush", "pages_freed": 6, "tiers": {"device": 6, "host": 0}}
            follower.wait_for_seq(2)
            assert follower.messages[-1] == {"type": "cleared", "seq": 2, "tier": None}
            assert client.post("/v1/cache/flush").json()["pages_freed"] == 0
        follower.close()


def test_flush_answers_the_pages_freed_on_each_tier(tiny_llama_dir: Path) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=16, host_num_pages=64)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(21)] for _ in range(6)]
    engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))  # pushes pages to host
    device, host = engine.tree.cached_pages, engine.tree.host_cached_pages
    assert device > 0 and host > 0
    with running_server(create_app(AsyncEngine(engine))) as url, httpx.Client(base_url=url, timeout=60) as client:
        r = client.post("/v1/cache/flush")
        assert r.json() == {"object": "cache.flush", "pages_freed": device, "tiers": {"device": device, "host": host}}
        assert engine.tree.cached_pages == engine.tree.host_cached_pages == 0
        assert client.post("/v1/cache/flush").json()["tiers"] == {"device": 0, "host": 0}


def test_a_snapshot_lists_the_pages_of_both_tiers(tiny_llama_dir: Path) -> None:
    """With a host tier the snapshot holds each tier's pages (it held the device's only, so
    an indexer of host pages that joined late never learnt those cached before it): the
    first reader's from a copy of the tree, a later reader's from the mirror the events
    kept since."""
    engine = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=16, host_num_pages=64)
    rng = random.Random(5)

    def traffic() -> None:  # pushes pages to the host tier
        prompts = [[rng.randrange(3, 250) for _ in range(21)] for _ in range(6)]
        engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))

    def by_tier(snapshot: dict[str, Any]) -> dict[str, set[tuple[str, int]]]:
        tiers: dict[str, set[tuple[str, int]]] = {"device": set(), "host": set()}
        for block in snapshot["blocks"]:
            tiers[block["tier"]] |= {(block["namespace"], h) for h in block["hashes"]}
        return tiers

    traffic()
    with running_server(create_app(AsyncEngine(engine), api_key=API_KEY)) as url:
        first = StreamFollower(url, AUTH)
        assert engine.cache_page_hashes("host")
        assert by_tier(first.messages[0]) == {tier: engine.cache_page_hashes(tier) for tier in ("device", "host")}
        with httpx.Client(base_url=url, headers=AUTH, timeout=60) as client:
            for _ in range(3):
                body = {"prompt": [rng.randrange(3, 250) for _ in range(21)], "max_tokens": 2, "temperature": 0}
                assert client.post("/v1/completions", json=body).status_code == 200
            idle(client)
        later = first_message(url)
        assert later["seq"] > first.messages[0]["seq"]
        assert by_tier(later) == {tier: engine.cache_page_hashes(tier) for tier in ("device", "host")}
        first.close()


def test_a_reader_that_falls_behind_gets_a_reset_then_a_snapshot(tiny_llama_dir: Path) -> None:
    """The engine produces more events than the ring holds while the reader does not read
    (they are all made inside one engine-thread command), so the outcome is certain."""
    engine = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=40)
    prompts = [[7] * 8 + list(range(20 + i, 40 + i)) for i in range(6)]

    async def scenario() -> None:
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        hub = CacheEventHub(async_engine, capacity=3)
        try:
            reader = await hub.open_reader()
            (snapshot,) = await reader.next()
            assert json.loads(snapshot) == {"type": "snapshot", "seq": 0, "page_size": PAGE_SIZE, "blocks": []}
            params = SamplingParams(max_tokens=1, temperature=0)
            await async_engine.call(lambda: engine.generate(prompts, params))
            assert engine.cache_events.seq > 3  # more than the ring holds
            reset, fresh = [json.loads(m) for m in await reader.next()]
            assert reset == {"type": "reset", "seq": 0, "buffer": 3, "reason": "slow_reader"}
            assert fresh["type"] == "snapshot" and fresh["seq"] == engine.cache_events.seq
            indexer = PageIndexer()
            indexer.apply(fresh)
            assert indexer.pages == engine.cache_page_hashes() and len(indexer.pages) > 6
            # From there on it is an ordinary reader again.
            await async_engine.call(lambda: engine.generate([[9] * 12], params))
            for message in await reader.next():
                indexer.apply(json.loads(message))
            assert indexer.pages == engine.cache_page_hashes() and reader.resets == 1
            assert await reader.next(timeout=0.01) == []  # nothing new
            await reader.close()
            assert not engine.cache_events.active
        finally:
            hub.close()
            await async_engine.shutdown()

    asyncio.run(scenario())


def test_a_tenants_reader_is_not_reset_by_another_tenants_burst(tiny_llama_dir: Path) -> None:
    """A tenant's reader that falls behind only by events it may not see (another tenant's
    burst, larger than the ring) skips them: no reset, no snapshot, nothing that tells it of
    the burst; when events of its own were lost, it gets its reset as any reader."""
    from radixserve.engine.request import tenant_of

    engine = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=80)
    params = SamplingParams(max_tokens=1, temperature=0)

    def burst(tenant: str, first: int, count: int, salted: bool = False) -> None:
        for i in range(count):
            engine.add_request([first] * 8 + list(range(20 + i, 40 + i)), params, tenant=tenant,
                               cache_salt=f"salt {i}" if salted else None)
        while engine.has_work():
            engine.step()

    def victims(namespace_id: str) -> bool:
        return tenant_of(engine.hashing.namespace_of_id(namespace_id)) == "victim"

    async def scenario() -> None:
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        hub = CacheEventHub(async_engine, capacity=3)
        try:
            reader = await hub.open_reader(victims)
            (snapshot,) = await reader.next()
            assert json.loads(snapshot)["type"] == "snapshot"
            seq = engine.cache_events.seq
            await async_engine.call(lambda: burst("mallory", 7, 6))
            assert engine.cache_events.seq - seq > 3  # the ring lost some of mallory's events
            assert await reader.next(timeout=0.05) == [] and reader.resets == 0
            await async_engine.call(lambda: burst("victim", 9, 1))
            mine = [json.loads(m) for m in await reader.next()]
            assert [m["type"] for m in mine] == ["stored"] * len(mine) and mine[0]["seq"] == 1
            assert all(victims(m["namespace"]) for m in mine)
            await async_engine.call(lambda: burst("victim", 11, 6))  # its own events lost
            reset, fresh = [json.loads(m) for m in await reader.next()]
            assert reset["type"] == "reset" and fresh["type"] == "snapshot" and reader.resets == 1
            assert {b["namespace"] for b in fresh["blocks"]} and all(victims(b["namespace"]) for b in fresh["blocks"])
            # What the hub remembers of dropped events stays bounded, however many namespaces.
            await async_engine.call(lambda: burst("mallory", 13, 8, salted=True))
            assert len(hub._dropped) <= hub.capacity and hub._forgotten > 0
            await reader.close()
        finally:
            hub.close()
            await async_engine.shutdown()

    asyncio.run(scenario())
