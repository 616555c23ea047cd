"""Tenants' shares of the requests the server starts at once (server/start_shares.py): the
gate's arithmetic on its own, then a real server (real sockets, two source addresses) whose
engine is paused, so that requests stay starting for as long as the test needs.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import anyio
import httpx
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.start_shares import DEFAULT_CPU_TENANT_STARTS, StartShares, default_tenant_starts

ATTACKER, INNOCENT = "127.0.0.2", "127.0.0.1"
PROMPT = {"prompt": "a prompt", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def granted(slots: list) -> list[bool]:
    return [slot.granted for slot in slots]


def test_a_tenant_alone_is_never_held_and_a_second_shrinks_its_share() -> None:
    starts = StartShares(8)
    alone = [starts.join("a") for _ in range(20)]
    assert all(granted(alone)) and starts.share_of_starts() is None
    newcomer = starts.join("b")
    assert newcomer.granted and starts.share_of_starts() == 4
    waiting = [starts.join("a") for _ in range(3)]
    assert granted(waiting) == [False] * 3 and starts.waiting == 3 and starts.waited == 3
    # "a" starts again only once fewer than 4 of its requests are starting: after 17 of 20.
    for slot in alone[:16]:
        slot.started()
    assert granted(waiting) == [False] * 3
    alone[16].started()
    assert granted(waiting) == [True, False, False]  # in order
    # A request streaming tokens does not count; one that ends while starting frees its start.
    alone[17].leave()
    assert granted(waiting) == [True, True, False]
    assert starts.starting["a"] == 4 and starts.starting["b"] == 1


def test_a_tenant_leaving_grows_the_others_shares_after_its_grace_and_nothing_is_left_behind() -> None:
    clock = SimpleNamespace(now=100.0)
    starts = StartShares(4, grace_s=0.5, clock=lambda: clock.now)
    first = [starts.join(tenant) for tenant in "abc"]  # three tenants: a share of 1 each
    more = [starts.join("a") for _ in range(6)]
    assert starts.share_of_starts() == 1 and not any(granted(more))
    first[1].leave()  # "b" has nothing left to start: two tenants split the limit
    assert starts.share_of_starts() == 2 and granted(more) == [True] + [False] * 5
    first[2].leave()  # "c" has nothing in flight, but a client's think time later it may be back
    assert starts.share_of_starts() == 4 and granted(more) == [True] * 3 + [False] * 3
    clock.now += 0.4
    starts.end_of_grace()
    assert granted(more) == [True] * 3 + [False] * 3
    clock.now += 0.1
    starts.end_of_grace()  # "a" alone now: no limit
    assert all(granted(more)) and starts.share_of_starts() is None
    for slot in [first[0], *more, first[1]]:  # leaving twice is harmless
        slot.leave()
    clock.now += 0.5
    starts.end_of_grace()
    assert not starts.in_flight and not starts.starting and not starts.unstarted and starts.waiting == 0
    assert starts.share_of_starts() is None
    starts.join("a").leave()
    assert all(granted([starts.join("a") for _ in range(8)]))  # back within its grace, and alone


def test_grace_timers_run_on_the_event_loop_one_after_another() -> None:
    async def scenario() -> None:
        starts = StartShares(2, grace_s=0.05)
        others = [starts.join(tenant) for tenant in "bc"]
        holders = [starts.join("a") for _ in range(3)]
        assert granted(holders) == [True, False, False]
        others[0].leave()  # "b" counts for its grace ...
        await anyio.sleep(0.02)
        others[1].leave()  # ... and "c" for its own, ending later: one timer, set again
        assert granted(holders) == [True, True, False]
        with anyio.fail_after(10):
            await holders[2].wait()  # "a" alone once both graces are over
        assert not starts._between

    anyio.run(scenario)


def test_a_tenant_whose_requests_all_stream_takes_no_part_of_the_limit() -> None:
    starts = StartShares(8)
    stream = starts.join("b")
    stream.started()  # "b" streams tokens: it holds the limit for the others, takes none of it
    flood = [starts.join("a") for _ in range(10)]
    assert granted(flood) == [True] * 8 + [False] * 2 and starts.share_of_starts() == 8
    newcomer = starts.join("b")  # "b" starts again: the limit is split in two
    assert newcomer.granted and starts.share_of_starts() == 4
    for slot in flood[:4]:
        slot.started()
    assert granted(flood[8:]) == [False, False]  # "a" starts 4: its share
    flood[4].started()
    assert granted(flood[8:]) == [True, False]
    newcomer.started()  # "b" streams only again: "a" may start 8
    assert granted(flood[8:]) == [True, True] and starts.starting["a"] == 5


def test_giving_up_a_wait_takes_the_request_out_of_the_queue() -> None:
    starts = StartShares(2)
    holder, other = starts.join("a"), starts.join("b")
    queued = [starts.join("a") for _ in range(2)]
    queued[0].leave()  # its client left while it waited
    assert starts.waiting == 1 and starts.in_flight["a"] == 2
    holder.started()
    assert queued[1].granted and starts.waiting == 0
    for slot in (holder, other, queued[1]):
        slot.leave()
    assert not starts.in_flight and not starts.starting


def test_a_cancelled_wait_is_left_whether_or_not_it_was_granted_meanwhile() -> None:
    async def scenario() -> None:
        starts = StartShares(2)
        holder, _other = starts.join("a"), starts.join("b")
        slot = starts.join("a")
        with anyio.move_on_after(0.01):
            await slot.wait()
        assert not slot.granted
        slot.leave()
        holder.started()  # nobody left to grant
        assert starts.in_flight["a"] == 1 and starts.waiting == 0 and not starts.starting.get("a")
        late = starts.join("a")  # "a" has nothing starting: at once
        assert late.granted and await late.wait() is late

    anyio.run(scenario)


def test_no_limit_holds_nobody_and_the_default_follows_the_device() -> None:
    starts = StartShares(0)
    slots = [starts.join(tenant) for tenant in "ab" * 50]
    assert all(granted(slots)) and starts.waited == 0
    with pytest.raises(ValueError, match="limit: must be >= 0"):
        StartShares(-1)
    on = {kind: SimpleNamespace(engine=SimpleNamespace(device=SimpleNamespace(type=kind))) for kind in ("cpu", "cuda")}
    assert default_tenant_starts(on["cpu"]) == DEFAULT_CPU_TENANT_STARTS == 4
    assert default_tenant_starts(on["cuda"]) == 0
    assert default_tenant_starts(SimpleNamespace(engine=SimpleNamespace())) == 0  # a cluster's ingress


# ---------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    engine = AsyncEngine(Engine(model="demo", page_size=16, num_pages=256, max_running=8))
    with running_server(create_app(engine, tenant_starts=2)) as url:
        yield SimpleNamespace(url=url, engine=engine)


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def in_flight(url: str) -> float:
    return metric(url, "radixserve_http_generation_requests_in_flight")


class Posts:
    """Completions posted from threads of their own (each from its `source` address)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.threads: list[threading.Thread] = []
        self.results: list[httpx.Response] = []

    def post(self, source: str, body: dict) -> None:
        def post() -> None:
            with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=120) as client:
                self.results.append(client.post(f"{self.url}/v1/completions", json=body))

        self.threads.append(threading.Thread(target=post, daemon=True))
        self.threads[-1].start()


@contextmanager
def engine_paused(server: SimpleNamespace) -> Iterator[Posts]:
    """The block runs with the engine paused (no request gets a first token: each stays
    starting); then every request posted meanwhile must be answered 200, and every slot left."""
    posts = Posts(server.url)
    server.engine.pause()
    try:
        yield posts
    finally:
        server.engine.resume()
    for thread in posts.threads:
        thread.join(120)
    assert [r.status_code for r in posts.results] == [200] * len(posts.threads)
    wait_until(lambda: in_flight(server.url) == 0)


def test_a_busy_address_waits_for_its_share_and_another_does_not(server: SimpleNamespace) -> None:
    url = server.url
    waited_before = metric(url, "radixserve_http_start_waits_total")
    with engine_paused(server) as posts:
        for _ in range(3):
            posts.post(ATTACKER, PROMPT)
        wait_until(lambda: in_flight(url) == 3)
        # Alone, the address started all three; with another address in flight each may be
        # starting one, so the innocent starts at once and the attacker's fourth waits.
        posts.post(INNOCENT, PROMPT)
        wait_until(lambda: in_flight(url) == 4)
        assert metric(url, "radixserve_http_requests_waiting_to_start") == 0
        posts.post(ATTACKER, PROMPT)
        wait_until(lambda: metric(url, "radixserve_http_requests_waiting_to_start") == 1)
        assert metric(url, "radixserve_http_start_waits_total") == waited_before + 1
        assert metric(url, "radixserve_sequences_waiting") == 4  # the waiting one never reached the engine
    assert len({r.json()["choices"][0]["text"] for r in posts.results}) == 1


def test_a_streaming_request_no_longer_counts_as_starting(server: SimpleNamespace) -> None:
    url = server.url

    async def scenario() -> None:
        transport = httpx.AsyncHTTPTransport(local_address=ATTACKER)
        async with httpx.AsyncClient(timeout=120, transport=transport) as attacker:
            body = {**PROMPT, "max_tokens": 2000, "stream": True}
            async with attacker.stream("POST", f"{url}/v1/completions", json=body) as stream:
                lines = stream.aiter_lines()  # kept: a generator let go of closes the connection
                while not (await anext(lines)).startswith("data: {"):
                    pass  # until its first token is out: it streams, no longer starts
                with engine_paused(server) as posts:
                    posts.post(INNOCENT, PROMPT)
                    await anyio.to_thread.run_sync(lambda: wait_until(lambda: in_flight(url) == 2))
                    # A share of one start each: the attacker's is free, its stream does not count.
                    posts.post(ATTACKER, PROMPT)
                    await anyio.to_thread.run_sync(lambda: wait_until(lambda: in_flight(url) == 3))
                    assert metric(url, "radixserve_http_requests_waiting_to_start") == 0
                    await stream.aclose()  # its work is done (and it could not end while unread)

    anyio.run(scenario)


def test_a_request_whose_client_leaves_while_waiting_leaves_nothing_behind(server: SimpleNamespace) -> None:
    url = server.url
    with engine_paused(server) as posts:
        posts.post(ATTACKER, PROMPT)
        posts.post(INNOCENT, PROMPT)
        wait_until(lambda: in_flight(url) == 2)
        body = b'{"prompt": "a prompt", "max_tokens": 4}'
        leaver = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), source_address=(ATTACKER, 0))
        leaver.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: metric(url, "radixserve_http_requests_waiting_to_start") == 1)
        leaver.close()
        wait_until(lambda: metric(url, "radixserve_http_requests_waiting_to_start") == 0)
        assert in_flight(url) == 2


def test_streams_and_streams_cut_short_leave_their_slots(server: SimpleNamespace) -> None:
    url = server.url

    async def scenario() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {**PROMPT, "max_tokens": 64, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body) as whole:
                lines = [line async for line in whole.aiter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            async with client.stream("POST", f"{url}/v1/completions", json=body) as cut:
                async for line in cut.aiter_lines():
                    if line.startswith("data: {"):
                        break  # leaves mid-stream: the connection is closed

    asyncio.run(scenario())
    wait_until(lambda: in_flight(url) == 0)
    wait_until(lambda: metric(url, "radixserve_sequences_running") == 0)
