"""Grammar compiles shared between tenants (server/fair_slots.py): the slots go round the
tenants, so one tenant's flood of slow schemas delays another's compile by one compile, not
by the flood; a spec compiled already takes no slot at all. Unit tests of FairSlots, then the
attack on a real server (real sockets, two tenants' keys)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import anyio
import httpx
import pytest
from server_util import running_server, wait_for

from radixserve import AsyncEngine, Engine
from radixserve.grammar import GrammarSpec, Grammars
from radixserve.server import create_app
from radixserve.server.fair_slots import FairSlots
from radixserve.server.grammar_compiles import GRAMMAR_COMPILES
from radixserve.server.tenancy import Caller


async def _holders(slots: FairSlots, plan: list[str], gates: dict[int, anyio.Event],
                   order: list[tuple[str, int]]) -> None:
    """Starts one holder per entry of `plan` (its tenant), in order; each records when it gets
    its slot and holds it until its gate opens."""

    async def holder(tenant: str, index: int) -> None:
        async with slots.hold(tenant):
            order.append((tenant, index))
            await gates[index].wait()

    async with anyio.create_task_group() as group:
        for index, tenant in enumerate(plan):
            group.start_soon(holder, tenant, index)
            await anyio.sleep(0)  # each queued before the next: arrival order is plan order
        await anyio.sleep(0.01)
        for index in range(len(plan)):  # free the slots one at a time
            gates[index].set()
            await anyio.sleep(0.01)


def test_a_freed_slot_goes_to_the_tenant_holding_fewest_not_to_the_floods_queue() -> None:
    slots = FairSlots(2)
    plan = ["mallory"] * 6 + ["victim", "victim"]
    gates = {i: anyio.Event() for i in range(len(plan))}
    order: list[tuple[str, int]] = []

    async def run() -> None:
        await _holders(slots, plan, gates, order)

    anyio.run(run)
    # mallory's first two hold both slots; the first slot freed goes to the victim (it holds
    # none), which then keeps one of the two while mallory's queue takes turns in the other.
    assert order == [("mallory", 0), ("mallory", 1), ("victim", 6), ("mallory", 2), ("mallory", 3),
                     ("mallory", 4), ("mallory", 5), ("victim", 7)]
    assert slots.held("mallory") == slots.held("victim") == 0 and slots._free == 2


def test_the_reserved_slot_goes_only_to_a_tenant_holding_none() -> None:
    """With one of 4 slots reserved, mallory's flood holds 3 at most, and the victim arriving
    behind the flood's queue gets the fourth at once, before any of mallory's ends."""
    slots = FairSlots(4, reserve=1)
    order: list[str] = []
    release = anyio.Event()

    async def holder(tenant: str) -> None:
        async with slots.hold(tenant):
            order.append(tenant)
            await release.wait()

    async def run() -> None:
        async with anyio.create_task_group() as group:
            for _ in range(6):
                group.start_soon(holder, "mallory")
            await anyio.sleep(0.01)
            assert order == ["mallory"] * 3 and slots.waiting("mallory") == 3
            group.start_soon(holder, "victim")
            await anyio.sleep(0.01)
            assert order == ["mallory"] * 3 + ["victim"]  # no slot was freed meanwhile
            release.set()

    anyio.run(run)
    assert order.count("mallory") == 6 and slots._free == 4
    alone: list[tuple[str, int]] = []
    anyio.run(_holders, FairSlots(4, reserve=1), ["a"] * 4, {i: anyio.Event() for i in range(4)}, alone)
    assert alone == [("a", i) for i in range(4)]


def test_one_tenant_is_served_first_come_first_served() -> None:
    slots = FairSlots(1)
    plan = ["a"] * 5
    order: list[tuple[str, int]] = []
    anyio.run(_holders, slots, plan, {i: anyio.Event() for i in range(5)}, order)
    assert order == [("a", i) for i in range(5)]


def test_new_tenants_do_not_go_before_a_waiting_tenant_served_before_and_idle_ones_are_forgotten() -> None:
    """Without keys a tenant is an address: a client served once, then waiting behind one job,
    goes next, not after every new address that came after it (an attacker's many addresses);
    a tenant that holds and waits for nothing leaves no state behind."""
    slots = FairSlots(1)
    order: list[str] = []

    async def job(tenant: str, gate: anyio.Event | None = None) -> None:
        async with slots.hold(tenant):
            order.append(tenant)
            if gate is not None:
                await gate.wait()

    async def run() -> None:
        await job("victim")  # served once: stamped
        gate = anyio.Event()
        async with anyio.create_task_group() as group:
            group.start_soon(job, "attacker-0", gate)
            await anyio.sleep(0.01)
            group.start_soon(job, "victim")
            await anyio.sleep(0.01)
            for i in range(1, 21):
                group.start_soon(job, f"attacker-{i}")
            await anyio.sleep(0.01)
            gate.set()

    anyio.run(run)
    assert order[:3] == ["victim", "attacker-0", "victim"]
    assert order[3:] == [f"attacker-{i}" for i in range(1, 21)]  # the new ones in the order they came
    assert not slots._served and not slots._held and not slots._waiting


def test_a_waiter_cancelled_leaves_the_queue_and_a_granted_one_gives_its_slot_back() -> None:
    slots = FairSlots(1)

    async def run() -> None:
        gate = anyio.Event()
        got: list[str] = []

        async def holder(tenant: str) -> None:
            async with slots.hold(tenant):
                got.append(tenant)
                await gate.wait()

        async with anyio.create_task_group() as group:
            group.start_soon(holder, "a")
            await anyio.sleep(0)
            with anyio.move_on_after(0.01):  # waits behind "a", then gives up
                await holder("b")
            group.start_soon(holder, "c")
            await anyio.sleep(0.01)
            gate.set()
        assert got == ["a", "c"]
        # Granted and cancelled before it ran: the slot comes back.
        async with slots.hold("x"):
            async with anyio.create_task_group() as group:
                group.start_soon(holder, "y")
                await anyio.sleep(0.01)
                group.cancel_scope.cancel()
        assert slots._free == 1 and not slots._waiting

    anyio.run(run)
    with pytest.raises(ValueError):
        FairSlots(0)


VICTIM, MALLORY = "k-victim", "k-mallory"
FLOOD = 12
FLOOD_MARK = "flood-"  # in the property name of every flood schema: the gate holds their compiles


class CompileGate:
    """Holds the compiles of the specs `held` picks in their compile threads, their slots held,
    until the test lets each go: a compile as slow as the test needs, with no seconds of CPU
    spent on it (real slow schemas took 0.7-2.3 s of CPU each here, and the order they ended
    in was a race against the victim's requests). `entered`: one event per held compile, in
    the order they got their slots; setting it lets that compile run."""

    def __init__(self, grammars: Grammars, monkeypatch: pytest.MonkeyPatch,
                 held: Callable[[GrammarSpec], bool]) -> None:
        self.entered: list[threading.Event] = []
        self._lock = threading.Lock()
        self._opened = False
        compile_spec = grammars.compile

        def gated(spec: GrammarSpec, *args: object, **kwargs: object) -> object:
            if held(spec) and not grammars.is_cached(spec):  # (a compiled one is only looked up)
                gate = threading.Event()
                with self._lock:
                    if self._opened:
                        gate.set()
                    self.entered.append(gate)
                assert gate.wait(120), "a held compile was never let go"
            return compile_spec(spec, *args, **kwargs)

        monkeypatch.setattr(grammars, "compile", gated)

    def open(self) -> None:
        """Lets every held compile go, and those to come."""
        with self._lock:
            self._opened = True
            for gate in self.entered:
                gate.set()

    def release_in_turn(self, count: int, answered: Callable[[], int]) -> None:
        """Lets the held compiles go one at a time, in the order they got their slots, each
        once the request before it was answered (`answered`: how many requests were): the
        flood's compiles end one after another, as slow ones do, whatever the machine's load."""
        for i in range(count):
            assert wait_for(lambda: len(self.entered) > i, timeout=120), f"held compile {i} never came"
            before = answered()
            self.entered[i].set()
            assert wait_for(lambda: answered() > before, timeout=120), f"held compile {i}'s request never answered"


def _flooded(spec: GrammarSpec) -> bool:
    return FLOOD_MARK in spec.source


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    engine = Engine(model="demo", page_size=16, num_pages=256)
    app = create_app(AsyncEngine(engine), tenant_keys={VICTIM: Caller("victim", False),
                                                        MALLORY: Caller("mallory", False)})
    with running_server(app) as url:
        yield SimpleNamespace(url=url, slots=app.state.server.grammar_compiles.slots,
                              compiles=app.state.server.grammar_compiles, starts=app.state.server.starts,
                              grammars=engine.grammars)


def _body(schema: dict) -> dict:
    return {"prompt": "x", "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def _flood_schema(i: int) -> dict:
    return {"type": "object", "properties": {f"{FLOOD_MARK}{i}": {"type": "string", "pattern": "^.{0,16}$"}}}


def test_a_flood_of_slow_schemas_delays_another_tenants_compile_by_one_compile(
        server: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mallory sends FLOOD schemas that compile slowly (held by the gate); the victim's new
    schema is compiled after the compiles in progress (at most GRAMMAR_COMPILES, and one more
    freed meanwhile), not after the flood; its schema compiled already (an earlier request)
    takes no slot."""
    headers = {v: {"Authorization": f"Bearer {v}"} for v in (VICTIM, MALLORY)}
    cached = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    done: list[str] = []
    gate = CompileGate(server.grammars, monkeypatch, _flooded)

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as client:
            first = await client.post("/v1/completions", headers=headers[VICTIM], json=_body(cached))
            assert first.status_code == 200, first.text

            async def send(key: str, body: dict, name: str) -> None:
                response = await client.post("/v1/completions", headers=headers[key], json=body)
                assert response.status_code == 200, response.text
                done.append(name)

            flood = [asyncio.create_task(send(MALLORY, _body(_flood_schema(i)), "mallory")) for i in range(FLOOD)]
            # Every flood request holds a slot or waits for one before the victim comes.
            assert await asyncio.to_thread(
                wait_for, lambda: server.slots.held("mallory") + server.slots.waiting("mallory") == FLOOD)
            await send(VICTIM, _body(cached), "victim cached")  # while no compile of the flood can end
            releases = asyncio.create_task(asyncio.to_thread(gate.release_in_turn, FLOOD, lambda: len(done)))
            await send(VICTIM, _body({"type": "object", "properties": {"v": {"type": "integer"}}}), "victim new")
            await asyncio.gather(*flood, releases)

    asyncio.run(run())
    # It took no slot: it came back while every compile of the flood was held; behind the
    # FIFO of before, it would have waited for FLOOD - GRAMMAR_COMPILES of them; waiting for a
    # slot however fairly, for one.
    assert done.index("victim cached") == 0, done
    # Behind the compiles that held the slots when it came, not behind the flood's queue.
    assert done.index("victim new") <= GRAMMAR_COMPILES + 2, done
    assert len(done) == FLOOD + 2 and server.slots.held("mallory") == server.slots.waiting("mallory") == 0
    assert threading.active_count() < 100  # no compile thread left behind


def test_a_wave_of_one_new_schema_compiles_it_once_per_tenant(server: SimpleNamespace,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Six requests of one tenant with the same new schema at once wait for one compile
    instead of taking four slots and compiling it four times; another tenant's same schema is
    its own (grammars are scoped per tenant), compiled once more. The compiles are held until
    every request has come to the compiles or waits for its start (start_shares.py: the
    tenants' shares of starts let two of each at once while both have requests in flight; the
    others come after the compile and find it cached): a request that came after the compile
    ended would find it cached, two compiles whatever the timing, and nothing tested."""
    schema = {"type": "object", "properties": {"wave": {"type": "string", "pattern": "^.{0,16}$"}}}
    grammars = server.grammars
    before = grammars.compiles
    gate = CompileGate(grammars, monkeypatch, lambda spec: '"wave"' in spec.source)
    arrived = []  # the requests that came to the compiles (each then waits for one, or starts it)
    compile_for_request = server.compiles.compile

    async def counted(*args: object, **kwargs: object) -> object:
        arrived.append(1)
        return await compile_for_request(*args, **kwargs)

    monkeypatch.setattr(server.compiles, "compile", counted)

    def release_once_all_came() -> None:
        assert wait_for(lambda: len(arrived) + server.starts.waiting == 7 and len(gate.entered) >= 2,
                        timeout=120), (len(arrived), server.starts.waiting, len(gate.entered))
        assert len(arrived) >= 3, arrived  # a request of the victim's waits for the other's compile
        gate.open()

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            async def send(key: str) -> int:
                response = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                             json=_body(schema))
                return response.status_code
            releases = asyncio.create_task(asyncio.to_thread(release_once_all_came))
            answers = list(await asyncio.gather(*[send(VICTIM) for _ in range(6)], send(MALLORY)))
            await releases
            return answers

    assert asyncio.run(run()) == [200] * 7
    assert grammars.compiles - before == 2 and len(gate.entered) == 2


def test_a_popular_schema_queued_behind_one_clients_flood_does_not_hold_another_client_back(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without keys, clients share a spec's compile (the scope is the cache salt) while the
    slots go round their addresses. Mallory floods slow schemas (held by the gate), then sends
    a popular one, queued behind her flood; the victim's request for it must not wait for her
    turn: a compile is shared only once it holds its slot (it waited for the flood before)."""
    engine = Engine(model="demo", page_size=16, num_pages=256)
    app = create_app(AsyncEngine(engine))
    slots = app.state.server.grammar_compiles.slots
    mallory, victim = ("address", "127.0.0.2"), ("address", "127.0.0.3")
    popular = {"type": "object", "properties": {"popular": {"type": "integer"}}}
    done: list[str] = []
    gate = CompileGate(engine.grammars, monkeypatch, _flooded)

    async def run(url: str) -> None:
        clients = {who: httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=64),
                                          transport=httpx.AsyncHTTPTransport(local_address=who[1]))
                   for who in (mallory, victim)}

        async def send(who: tuple[str, str], body: dict, name: str) -> None:
            response = await clients[who].post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            done.append(name)

        flood = [asyncio.create_task(send(mallory, _body(_flood_schema(i)), "mallory")) for i in range(FLOOD)]
        assert await asyncio.to_thread(wait_for, lambda: slots.held(mallory) + slots.waiting(mallory) == FLOOD)
        flood.append(asyncio.create_task(send(mallory, _body(popular), "mallory popular")))
        assert await asyncio.to_thread(wait_for, lambda: slots.held(mallory) + slots.waiting(mallory) == FLOOD + 1)
        releases = asyncio.create_task(asyncio.to_thread(gate.release_in_turn, FLOOD, lambda: len(done)))
        await send(victim, _body(popular), "victim popular")
        await asyncio.gather(*flood, releases)
        for client in clients.values():
            await client.aclose()

    with running_server(app) as url:
        asyncio.run(run(url))
    assert done.index("victim popular") <= GRAMMAR_COMPILES + 2, done
    assert len(done) == FLOOD + 2
