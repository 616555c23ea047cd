"""Cache views as an attack on a real server (issue 22, item 1): many concurrent event
subscribes and tree requests with distinct max_nodes, over a tree of thousands of nodes, must
not stall an innocent stream; idle event readers must time out; a view's work stops when its
client leaves; and the sliced copy the views are built from, corrected by the events of its
time, is exact however the tree changes in between."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.cache.page_hash import namespace_id
from radixserve.engine.event_stream import PageMirror
from radixserve.engine.tree_copy import (
    NODES_PER_PIECE,
    copy_tree,
    page_hashes,
    run_to_end,
)
from radixserve.server import create_app

ATTACKERS = 8  # and as many benign clients in the comparison runs
REPETITIONS = 5
INNOCENT = {"prompt": "an innocent question", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "temperature": 0}


def _branchy_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Prompts over a 4-token alphabet: at page size 1 they branch everywhere (many nodes)."""
    rng = random.Random(seed)
    return [[rng.randrange(4) + 10 for _ in range(length)] for _ in range(count)]


@pytest.fixture(scope="module")
def big_tree_server() -> Iterator[tuple[AsyncEngine, str]]:
    """A server whose cache holds thousands of nodes at page size 1."""
    engine = Engine(model="demo", page_size=1, num_pages=40_000)
    engine.generate(_branchy_prompts(1500, 14, seed=1), SamplingParams(max_tokens=1, temperature=0))
    assert engine.stats()["cache_nodes"] > 2000
    async_engine = AsyncEngine(engine)
    with running_server(create_app(async_engine)) as url:
        yield async_engine, url


def _innocent_run(url: str) -> tuple[str, float, list[float]]:
    """The innocent stream's text, its time to first token and its gaps between chunks."""
    start = time.perf_counter()
    arrivals: list[float] = []
    text = []
    with httpx.Client(base_url=url, timeout=300) as client, \
            client.stream("POST", "/v1/completions", json=INNOCENT) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    arrivals.append(time.perf_counter())
                    text.append(chunk["choices"][0]["text"])
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return "".join(text), arrivals[0] - start, gaps


CROWD_SCRIPT = """
import sys, threading, httpx
url, count, attack = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "attack"
go = threading.Event()  # set: the clients loop; clear: each parks after its round
lock = threading.Condition()
since_go = [0] * count  # rounds each client finished since the last "go"
parked = [False] * count

def run(i):
    with httpx.Client(base_url=url, timeout=300) as client:
        round_ = 0
        while True:
            if not go.is_set():
                with lock:
                    parked[i] = True
                    lock.notify_all()
                go.wait()
                with lock:
                    parked[i] = False
            round_ += 1
            try:
                if not attack:
                    client.get("/health").raise_for_status()
                elif i % 2:
                    max_nodes = 20 + (97 * i + round_) % 400  # a new value each time: no view to share
                    client.get(f"/v1/cache/tree?max_nodes={max_nodes}&hashes=true").raise_for_status()
                else:
                    with client.stream("GET", "/v1/cache/events") as response:
                        for line in response.iter_lines():
                            if line.startswith("data: "):
                                break  # the snapshot: then leave, and subscribe again
            except httpx.TransportError:  # a kept-alive connection the server closed while parked
                continue
            with lock:
                since_go[i] += 1
                if since_go[i] == 1 and all(since_go):
                    print("ready", flush=True)

for i in range(count):
    threading.Thread(target=run, args=(i,), daemon=True).start()
for command in sys.stdin:
    if command.strip() == "go":
        with lock:
            since_go[:] = [0] * count
        go.set()
    else:  # pause: every client parked, none in a request
        go.clear()
        with lock:
            lock.wait_for(lambda: all(parked))
        print("paused", flush=True)
"""


class Crowd:
    """`count` clients hitting the server in a loop, in a process of their own (so that their
    own work does not compete with the server's threads inside this one): attackers (event
    subscribes and tree views of distinct max_nodes) or benign clients (the health route: as
    many connections and requests, little work; eight clients looping on the stats route
    saturated the event loop, a baseline so slow that no stall of the views could show).
    Started once, parked between the runs it is used for (a process per run cost each run a
    start of Python and httpx): `start` lets it loop until every client has been served once,
    `park` until every client has finished its request and waits."""

    def __init__(self, url: str, count: int, attack: bool) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", CROWD_SCRIPT, url, str(count),
                                         "attack" if attack else "benign"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _say(self, command: str, answer: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline().strip() == answer

    def start(self) -> None:
        self._say("go", "ready")  # every client has been served once

    def park(self) -> None:
        self._say("park", "paused")

    def close(self) -> None:
        self.process.kill()
        self.process.wait(60)


def test_many_views_beside_an_innocent_stream_do_not_stall_it(big_tree_server: tuple[AsyncEngine, str]) -> None:
    engine, url = big_tree_server
    expected, _, _ = _innocent_run(url)
    ttfts: dict[bool, list[float]] = {False: [], True: []}
    gaps: dict[bool, list[float]] = {False: [], True: []}
    crowds = {attack: Crowd(url, ATTACKERS, attack) for attack in (False, True)}
    try:
        for _ in range(REPETITIONS):
            for attack in (False, True):  # alternated, so both see the same machine load
                crowds[attack].start()
                text, ttft, run_gaps = _innocent_run(url)
                crowds[attack].park()
                assert text == expected
                ttfts[attack].append(ttft)
                gaps[attack].extend(run_gaps)
    finally:
        for crowd in crowds.values():
            crowd.close()
    benign_ttft, attack_ttft = (statistics.median(ttfts[k]) for k in (False, True))
    # The 90th percentile of all the runs' gaps: a stall the views caused comes with every
    # view, so in many gaps, where one descheduling of this process is one gap (the longest
    # gap of a run followed those). Views cost something (on 2 cores: 11 ms against 3-4 ms);
    # built whole between steps, as the slicing exists to prevent, 41 ms.
    benign_gap, attack_gap = (statistics.quantiles(gaps[k], n=10)[-1] for k in (False, True))
    print(f"benign ttft {benign_ttft:.3f} p90 gap {benign_gap:.4f}; attack ttft {attack_ttft:.3f} "
          f"p90 gap {attack_gap:.4f}")
    assert attack_ttft <= 3 * benign_ttft + 0.1, ttfts
    assert attack_gap <= 3 * benign_gap + 0.010, (benign_gap, attack_gap)
    # The attackers' views were real, and the events contract held: a reader now agrees with the tree.
    stats = httpx.get(f"{url}/v1/cache/stats").json()
    assert stats["tree_copies"] >= 1 and stats["events"]["snapshot_builds"] >= 1
    # A copy of the tree takes the engine thread in many small pieces, never all at once.
    # A copy finished under 2 s ago serves a cache that has not changed since: a request
    # changes the cache first, so this view needs a fresh copy whatever the timing.
    r = httpx.post(f"{url}/v1/completions", json={"prompt": list(range(900, 950)), "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    pieces = engine.stats()["view_pieces"]
    nodes = httpx.get(f"{url}/v1/cache/tree?max_nodes=3").json()["nodes_total"]
    assert engine.stats()["view_pieces"] - pieces >= nodes // NODES_PER_PIECE > 10
    with httpx.Client(base_url=url, timeout=300) as client:
        with client.stream("GET", "/v1/cache/events") as response:
            snapshot = next(json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: "))
    pages = {(block["namespace"], h) for block in snapshot["blocks"] for h in block["hashes"]}
    assert pages == engine.engine.cache_page_hashes()


def test_idle_event_readers_time_out() -> None:
    engine = AsyncEngine(Engine(model="demo", page_size=16, num_pages=64))
    with running_server(create_app(engine, cache_events_idle_timeout_s=1.0)) as url:
        ended: list[float] = []

        def idle_reader() -> None:
            with httpx.Client(base_url=url, timeout=60) as client:
                with client.stream("GET", "/v1/cache/events") as response:
                    for _ in response.iter_lines():
                        pass  # the snapshot, keep-alives, then the server closes the stream
            ended.append(time.monotonic())

        readers = [threading.Thread(target=idle_reader) for _ in range(3)]
        for thread in readers:
            thread.start()
        for thread in readers:
            thread.join(60)
        assert len(ended) == 3
        events = httpx.get(f"{url}/v1/cache/stats").json()["events"]
        assert events["readers"] == 0 and events["idle_closed"] == 3 and events["idle_timeout_s"] == 1.0


def test_sliced_work_stops_when_its_caller_leaves() -> None:
    """A view whose caller left (its future cancelled) runs no further piece."""
    async def scenario() -> None:
        engine = AsyncEngine(Engine(model="demo", page_size=16, num_pages=64))
        await engine.start()
        pieces = []

        def endless() -> Iterator[None]:
            while True:
                pieces.append(1)
                yield

        try:
            future = engine.run_sliced(endless)
            while len(pieces) < 10:
                await asyncio.sleep(0.01)
            future.cancel()
            await asyncio.sleep(0.1)
            stopped_at = len(pieces)
            await asyncio.sleep(0.3)
            assert len(pieces) == stopped_at
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_sliced_copy_corrected_by_its_events_is_exact(seed: int) -> None:
    """The tree changes between every few nodes copied (inserts, splits, evictions, flushes);
    the copy's page hashes with the events of that time applied equal the tree's pages."""
    engine = Engine(model="demo", page_size=1, num_pages=600)
    params = SamplingParams(max_tokens=2, temperature=0)
    engine.generate(_branchy_prompts(60, 10, seed), params)
    events: list[Any] = []
    engine.subscribe_events(events.append)
    start_seq = engine.cache_events.seq
    work = copy_tree(engine.tree, nodes_per_piece=4)
    rng = random.Random(seed)
    while True:
        try:
            next(work)
        except StopIteration as stop:
            copy = stop.value
            break
        roll = rng.random()
        if roll < 0.03:
            engine.flush_cache()
        elif roll < 0.6:
            engine.generate(_branchy_prompts(rng.randrange(1, 4), rng.randrange(3, 30), rng.randrange(10**6)), params)
    assert len(events) > 20 and any(e.seq > start_seq for e in events)
    pages = run_to_end(page_hashes(copy, namespace_id))
    mirror = PageMirror(pages, seq=start_seq, cursor=0, generation=0, page_size=1)
    mirror.apply([e for e in events if e.seq > start_seq])
    got = {(ns, h) for ns, hashes in mirror.pages["device"].items() for h in hashes}
    assert got == engine.cache_page_hashes()
