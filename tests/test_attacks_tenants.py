"""Tenants as attackers of each other on a real server (issue 22, items 2 and tenancy): real
uvicorn on a real port, real httpx clients, several API keys naming tenants.

The PIN-recovery attack of item 2: a victim chats with a 4-digit PIN under a random salt; an
attacker holding a key (the victim tenant's own key without the salt, or another tenant's)
reads the cache events and the tree and hashes every candidate prompt offline, as the
published spec allows. With the server's secret it must find nothing; with public hashes
(the control, run the same way) the victim tenant's key finds the PIN, so the attack is real,
and another tenant's key still finds nothing, because it sees none of the victim's namespaces.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from functools import cache

import httpx
import msgspec
import numpy as np
import pytest
from server_util import running_server, wait_for

from radixserve import AsyncEngine, Engine
from radixserve.cache.page_hash import namespace_id, namespace_seed, page_hashes
from radixserve.engine.request import namespace_of, tenant_of
from radixserve.server import create_app
from radixserve.server.prompts import ChatRenderer
from radixserve.server.protocol import ChatCompletionRequest
from radixserve.server.tenancy import Caller

PAGE = 4
PIN = 4821
VICTIM, MALLORY, ADMIN = "k-victim", "k-mallory", "k-admin"
KEYS = {VICTIM: Caller("victim", admin=False), MALLORY: Caller("mallory", admin=False)}
MESSAGE = "My PIN is {:04d}, keep it safe."


def _chat_body(pin: int) -> dict:
    return {"messages": [{"role": "user", "content": MESSAGE.format(pin)}]}


def _serve(secret: str | None) -> Iterator[tuple[Engine, str]]:
    engine = Engine(model="demo", page_size=PAGE, num_pages=4096, cache_hash_secret=secret)
    app = create_app(AsyncEngine(engine), tenant_keys=KEYS, admin_api_key=ADMIN)
    with running_server(app) as url:
        yield engine, url


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[Engine, str]]:
    """A server keying its published hashes with a random secret (the CLI's default)."""
    yield from _serve(secrets.token_hex(32))


@pytest.fixture(scope="module")
def public() -> Iterator[tuple[Engine, str]]:
    """The same server publishing the public spec's hashes (--public-cache-hashes)."""
    yield from _serve(None)


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, headers={"Authorization": f"Bearer {key}"})


def _victim_chats(url: str) -> str:
    """The victim's chat under a random salt (the pages stay cached); returns the salt."""
    salt = secrets.token_hex(16)
    with _client(url, VICTIM) as client:
        response = client.post("/v1/chat/completions", json={**_chat_body(PIN), "cache_salt": salt,
                                                             "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
    return salt


def _snapshot(client: httpx.Client) -> dict:
    """The first message of /v1/cache/events: the snapshot of what this key may see."""
    with client.stream("GET", "/v1/cache/events") as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                message = json.loads(line[len("data: "):])
                assert message["type"] == "snapshot"
                return message
    raise AssertionError("no snapshot")


def _tree_nodes(client: httpx.Client) -> list[dict]:
    response = client.get("/v1/cache/tree", params={"hashes": "true", "max_nodes": 100_000})
    assert response.status_code == 200
    out, stack = [], [response.json()["root"]]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.get("children", ()))
    return out


def _published(client: httpx.Client) -> dict[str, set[int]]:
    """Every (namespace id -> page hashes) this key can read from the events and the tree."""
    out: dict[str, set[int]] = {}
    for block in _snapshot(client)["blocks"]:
        out.setdefault(block["namespace"], set()).update(block["hashes"])
    for node in _tree_nodes(client):
        if node.get("namespace"):
            out.setdefault(node["namespace"], set())
            if node.get("hash"):
                out[node["namespace"]].add(int(node["hash"]))
    return out


@cache
def _candidates() -> list[np.ndarray]:
    """The token ids of every candidate prompt, one per PIN (the server's own renderer: the
    attacker knows the software and the model's tokenizer)."""
    renderer = ChatRenderer(Engine(model="demo", page_size=PAGE, num_pages=64).tokenizer, None)
    rows = []
    for pin in range(10_000):
        body = msgspec.json.decode(json.dumps(_chat_body(pin)).encode(), type=ChatCompletionRequest)
        rows.append(np.asarray(renderer.render(body.messages, None, None)[0], dtype=np.int64))
    return rows


def _recover_pins(url: str, key: str) -> set[int]:
    """The attack: every PIN whose whole prompt hashes, under some published namespace's
    public seed, to a published page hash."""
    with _client(url, key) as client:
        published = _published(client)
    found = set()
    rows = _candidates()
    for ns_id, hashes in published.items():
        seed = namespace_seed(ns_id)
        for pin, row in enumerate(rows):
            if int(page_hashes(row, PAGE, seed)[0][-1]) in hashes:  # the last full page: the chain of all
                found.add(pin)
    return found


def test_the_pin_attack_finds_nothing_against_keyed_hashes(keyed: tuple[Engine, str]) -> None:
    _, url = keyed
    _victim_chats(url)
    assert _recover_pins(url, VICTIM) == set()   # the victim tenant's own key, without the salt
    assert _recover_pins(url, MALLORY) == set()  # another tenant's key
    assert _recover_pins(url, ADMIN) == set()    # even the whole cache's view


def test_the_pin_attack_is_real_against_public_hashes(public: tuple[Engine, str]) -> None:
    """The control: the same attack on public hashes recovers the PIN from the victim tenant's
    view, and still nothing from another tenant's (it sees none of the victim's namespaces)."""
    _, url = public
    _victim_chats(url)
    assert _recover_pins(url, VICTIM) == {PIN}
    assert _recover_pins(url, MALLORY) == set()


def test_published_namespace_ids_are_keyed(keyed: tuple[Engine, str], public: tuple[Engine, str]) -> None:
    """A guessed salt cannot be tested against a published namespace id either: with the
    secret, no id is the public spec's id of the victim's namespace."""
    for (engine, url), keyed_ids in ((keyed, True), (public, False)):
        salt = _victim_chats(url)
        with _client(url, ADMIN) as client:
            ids = set(_published(client))
        guessed = namespace_id(namespace_of(engine.model_name, salt, "victim"))
        assert (guessed in ids) is not keyed_ids


def test_a_tenant_sees_only_its_own_namespaces_in_every_view(keyed: tuple[Engine, str]) -> None:
    engine, url = keyed
    _victim_chats(url)
    with _client(url, MALLORY) as client:
        response = client.post("/v1/completions", json={"prompt": "mallory's own prompt text", "max_tokens": 2,
                                                        "cache_salt": "m"})
        assert response.status_code == 200
    hashing = engine.hashing
    with _client(url, ADMIN) as admin, _client(url, VICTIM) as victim, _client(url, MALLORY) as mallory:
        everything = _published(admin)
        mine = {tenant: _published(client) for tenant, client in (("victim", victim), ("mallory", mallory))}
        stats = {tenant: client.get("/v1/cache/stats").json() for tenant, client in
                 (("victim", victim), ("mallory", mallory))}
        admin_stats = admin.get("/v1/cache/stats").json()
    owner = {ns_id: tenant_of(hashing.namespace_of_id(ns_id)) for ns_id in everything}
    for tenant in ("victim", "mallory"):
        assert mine[tenant], tenant
        assert set(mine[tenant]) == {ns for ns, who in owner.items() if who == tenant}
        for ns_id, hashes in mine[tenant].items():
            assert hashes <= everything[ns_id]
        assert stats[tenant]["tenant"] == tenant and stats[tenant]["requests"] is None
        assert 0 < stats[tenant]["tiers"]["device"]["pages_cached"] < admin_stats["tiers"]["device"]["pages_cached"]
    other_hashes = set().union(*(h for ns, h in everything.items() if owner[ns] != "mallory"))
    assert not other_hashes & set().union(*mine["mallory"].values())


def test_a_tenants_event_stream_carries_only_its_events_numbered_by_what_it_saw(
        keyed: tuple[Engine, str]) -> None:
    engine, url = keyed
    with _client(url, MALLORY) as mallory, mallory.stream("GET", "/v1/cache/events") as stream:
        lines = stream.iter_lines()
        messages = _data(lines, 1)
        assert messages[0]["type"] == "snapshot"
        start = messages[0]["seq"]
        _victim_chats(url)  # someone else's pages first: nothing of them on mallory's stream
        with _client(url, MALLORY) as again:
            assert again.post("/v1/completions", json={"prompt": "a fresh prompt of mallory's own",
                                                       "max_tokens": 2}).status_code == 200
        event = _data(lines, 1)[0]
    assert event["type"] == "stored" and event["seq"] == start + 1  # no gap for the victim's events
    assert tenant_of(engine.hashing.namespace_of_id(event["namespace"])) == "mallory"


def _settled(url: str, finished: int) -> None:
    """Waits until `finished` requests are done and the engine's published stats say so (a
    tree view after that is of a fresh copy: a copy is reused only while the stats stand still)."""
    with _client(url, ADMIN) as admin:
        def done() -> bool:
            requests = admin.get("/v1/cache/stats").json()["requests"]
            return requests["requests_finished"] >= finished and requests["running"] == requests["waiting"] == 0
        assert wait_for(done), "the engine did not settle"


def test_a_tenants_recency_ticks_tell_nothing_of_the_others_traffic(keyed: tuple[Engine, str]) -> None:
    """The tick of a tenant's node was the pool-wide recency counter: a tenant that looked its
    own prompt up twice read from the difference how many lookups and inserts (so requests,
    and roughly how long their prompts were) the other tenants made in between. In its view
    the ticks are ranks among its own nodes shown: the same whether the victim worked or not."""
    _, url = keyed
    with _client(url, ADMIN) as admin:
        finished = admin.get("/v1/cache/stats").json()["requests"]["requests_finished"]

    def probe(prompt: str) -> None:
        nonlocal finished
        with _client(url, MALLORY) as mallory:
            response = mallory.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                             "cache_salt": "ticks"})
            assert response.status_code == 200, response.text
        finished += 1
        _settled(url, finished)

    def ticks(key: str) -> tuple[int, dict[tuple[int, str | None], int]]:
        with _client(url, key) as client:
            tree = client.get("/v1/cache/tree", params={"hashes": "true", "max_nodes": 100_000}).json()
        out, stack = {}, [tree["root"]]
        while stack:
            node = stack.pop()
            stack.extend(node.get("children", ()))
            if node["kind"] == "node":
                out[(node["prefix_tokens"], node.get("hash"))] = node["tick"]
        return tree["recency_tick"], out

    for prompt in ("mallory counts the ticks, one", "mallory counts the ticks, two", "mallory counts"):
        probe(prompt)
    probe("mallory counts the ticks, one")
    quiet = ticks(MALLORY)  # nothing but its own probe since the last one
    for pin in range(3):  # the victim works: several lookups and inserts of its own
        with _client(url, VICTIM) as victim:
            response = victim.post("/v1/chat/completions", json={**_chat_body(pin), "max_tokens": 4})
            assert response.status_code == 200, response.text
        finished += 1
    _settled(url, finished)
    probe("mallory counts the ticks, one")
    busy, (_, admins) = ticks(MALLORY), ticks(ADMIN)
    assert busy == quiet, "the victim's work moved the attacker's ticks"
    recency, mine = busy
    assert sorted(set(mine.values())) == list(range(1, recency + 1)) and len(mine) > 2  # dense ranks
    for a in mine:  # in the admin's order (its raw counter, unchanged)
        for b in mine:
            if a[1] and b[1]:
                assert (mine[a] < mine[b]) == (admins[a] < admins[b]), (a, b)


def _data(lines: Iterator[str], count: int) -> list[dict]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(json.loads(line[len("data: "):]))
            if len(out) == count:
                break
    return out


def test_only_an_admin_may_flush_and_unknown_keys_get_401(keyed: tuple[Engine, str]) -> None:
    _, url = keyed
    _victim_chats(url)
    with _client(url, MALLORY) as mallory:
        response = mallory.post("/v1/cache/flush")
        assert response.status_code == 403 and response.json()["error"]["code"] == "admin_only"
    with _client(url, VICTIM) as victim:
        assert victim.post("/v1/cache/flush").status_code == 403
        assert victim.get("/v1/cache/stats").json()["tiers"]["device"]["pages_cached"] > 0  # nothing dropped
    with _client(url, "k-nobody") as nobody:
        for path in ("/v1/cache/stats", "/v1/cache/tree", "/v1/models", "/metrics"):
            assert nobody.get(path).status_code == 401
    with httpx.Client(base_url=url) as anonymous:
        assert anonymous.get("/v1/cache/stats").status_code == 401
        # The pool-wide counters, read around another tenant's request, tell its prompt's length.
        assert anonymous.get("/metrics").status_code == 401
        assert anonymous.get("/health").json() == {"status": "ok"}  # tells nothing of anyone's traffic
        for empty in ("Bearer", "bearer"):  # no token at all
            assert anonymous.get("/v1/cache/stats", headers={"authorization": empty}).status_code == 401
    with _client(url, VICTIM) as victim:
        response = victim.get("/metrics")
        assert response.status_code == 403 and response.json()["error"]["code"] == "admin_only"
    with _client(url, ADMIN) as admin:
        assert "radixserve_prompt_tokens_total" in admin.get("/metrics").text
        assert admin.post("/v1/cache/flush").status_code == 200


def test_an_innocent_tenants_output_is_unchanged_beside_an_attacker(keyed: tuple[Engine, str]) -> None:
    """Mallory sends the victim's very prompt, under the victim's salt and under none (trying
    to hit, share or poison its cached pages), reads every view and tries to flush: it hits
    nothing of the victim's, and the victim's greedy answer is what it was alone."""
    _, url = keyed
    request = {**_chat_body(1234), "max_tokens": 12, "temperature": 0, "cache_salt": "v-salt"}
    with _client(url, VICTIM) as victim:
        alone = victim.post("/v1/chat/completions", json=request).json()["choices"][0]["message"]["content"]
    with _client(url, MALLORY) as mallory, _client(url, VICTIM) as victim:
        for salt in ("v-salt", None):
            body = {**request, "temperature": 1.0, "seed": 7}
            if salt is None:
                body.pop("cache_salt")
            response = mallory.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            # Its own namespace: not one of the victim's pages is a hit (no timing side channel).
            assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        _published(mallory)
        assert mallory.post("/v1/cache/flush").status_code == 403
        beside = victim.post("/v1/chat/completions", json=request).json()
    assert beside["choices"][0]["message"]["content"] == alone
    assert beside["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # its own pages, not mallory's


def test_a_tenants_raised_retention_is_held_within_its_share() -> None:
    """Retention priorities order every tenant's pages in one pool: prompts at priority 100
    sent with the admin key pin a 64-page pool whole, and the victim's working set is
    recomputed every round (the control: the attack is real). Sent with a tenant's key they
    are answered (no 403) and held within the tenant's share of the raised tokens (half the
    pool), so the victim's working set stays cached, whatever the attacker resends."""
    rng = np.random.default_rng(3)
    victim_prompts = [rng.integers(3, 190, 21).tolist() for _ in range(2)]
    engine = Engine(model="demo", page_size=PAGE, num_pages=64, max_running=1)
    app = create_app(AsyncEngine(engine), tenant_keys=KEYS, admin_api_key=ADMIN)

    def victim_hits(attacker: httpx.Client, victim: httpx.Client, raised: dict) -> list[int]:
        hits = []
        for round_ in range(13):
            body = {"prompt": rng.integers(3, 190, 28).tolist(), "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, **raised}
            response = attacker.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            if round_ >= 8:  # after the first 8 raised prompts: the victim's working set each round
                usage = [victim.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "temperature": 0,
                                                               "ignore_eos": True}).json()["usage"]
                         for prompt in victim_prompts]
                hits.append(sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage))
        return hits[1:]

    with running_server(app) as url, _client(url, VICTIM) as victim:
        with _client(url, ADMIN) as admin:
            assert victim_hits(admin, victim, {"retention_priority": 100}) == [0, 0, 0, 0]
            assert admin.post("/v1/cache/flush").status_code == 200
        with _client(url, MALLORY) as mallory:
            assert victim_hits(mallory, victim, {"retention_priority": 100}) == [40, 40, 40, 40]
            chat = {"messages": [{"role": "system", "content": "pinned system prompt " * 8},
                                 {"role": "user", "content": "pin me"}], "max_tokens": 2}
            for body in ({**chat, "system_retention_priority": 90}, {**chat, "retention_priority": 10}):
                assert mallory.post("/v1/chat/completions", json=body).status_code == 200
        assert 0 < engine.sessions.tenant_tokens("mallory") <= 64 * PAGE // 2
        assert engine.sessions.tenant_tokens("victim") == 0
    engine.check_invariants()


def test_one_tenant_cannot_hold_every_event_stream(monkeypatch: pytest.MonkeyPatch,
                                                   keyed: tuple[Engine, str]) -> None:
    """Event streams are bounded (4 here): a tenant holding them all left every other tenant,
    and the admin, a 503 for as long as it kept them open. Each tenant now has its share of
    the bound among the tenants holding streams."""
    from radixserve.server import cache_routes
    monkeypatch.setattr(cache_routes, "MAX_EVENT_READERS", 4)
    _, url = keyed
    with ExitStack() as stack:
        lines = []  # each open stream's line iterator: dropped, it would close its stream

        def open_stream(key: str) -> int:
            client = stack.enter_context(_client(url, key))
            response = stack.enter_context(client.stream("GET", "/v1/cache/events"))
            if response.status_code == 200:
                lines.append(response.iter_lines())
                assert next(lines[-1]).startswith("data: ")  # the snapshot: the stream is open
            return response.status_code
        assert [open_stream(MALLORY) for _ in range(5)] == [200, 200, 200, 200, 503]
        assert open_stream(VICTIM) == 200  # its share: 2 of 4 between two tenants
        assert open_stream(MALLORY) == 503
        assert open_stream(ADMIN) == 200
