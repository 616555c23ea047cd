"""Pacing of client addresses whose requests keep being refused (server/refusal_pacing.py):
the debt's arithmetic on a fake clock, then a real server (real sockets, two source
addresses): an address past its burst of 4xx is held, another is not, and a held request
still gets its answer.

Times are only ever bounded from below (a hold lasts at least its debt's drain; a loaded
machine only makes it longer).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.connections import uvicorn_options, with_deadlines
from radixserve.server.refusal_pacing import RefusalPacer, with_refusal_pacing

ATTACKER, INNOCENT = "127.0.0.2", "127.0.0.1"
QUITTER = "127.0.0.4"  # gives up on its requests
BAD = {"prompt": "x", "max_tokens": -1}  # a 400: max_tokens must be positive
GOOD = {"prompt": "the innocent's prompt", "max_tokens": 4, "temperature": 0, "ignore_eos": True}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_debt_grows_by_each_refusal_and_drains_at_the_rate() -> None:
    clock = FakeClock()
    pacer = RefusalPacer(rate=2.0, burst=3.0, clock=clock)
    assert pacer.wait_s("10.0.0.1") == 0.0  # never refused
    for _ in range(3):
        pacer.refused("10.0.0.1")
    assert pacer.wait_s("10.0.0.1") == 0.0  # at the burst, not over it
    pacer.refused("10.0.0.1")
    assert pacer.wait_s("10.0.0.1") == pytest.approx(0.5)  # one over, drained at 2 a second
    assert pacer.wait_s("10.0.0.2") == 0.0  # another address owes nothing
    clock.now += 0.25
    assert pacer.wait_s("10.0.0.1") == pytest.approx(0.25)
    clock.now += 10
    assert pacer.wait_s("10.0.0.1") == 0.0
    pacer.refused("10.0.0.1")  # drained to 0, not below: one refusal is one again
    assert pacer.wait_s("10.0.0.1") == 0.0
    pacer.refused(None)  # a Unix socket: not paced
    assert pacer.wait_s(None) == 0.0
    assert RefusalPacer(rate=10.0).burst == 50.0  # five seconds of the rate
    with pytest.raises(ValueError):
        RefusalPacer(rate=0.0)


def test_addresses_past_the_bound_are_forgotten_least_indebted_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.server import refusal_pacing

    monkeypatch.setattr(refusal_pacing, "MAX_ADDRESSES", 4)
    clock = FakeClock()
    pacer = RefusalPacer(rate=1.0, burst=1.0, clock=clock)
    for i in range(4):  # address i refused i + 1 times
        for _ in range(i + 1):
            pacer.refused(f"10.0.0.{i}")
    pacer.refused("10.0.0.9")  # a fifth address: the two least indebted are forgotten
    assert set(pacer._debts) == {"10.0.0.2", "10.0.0.3", "10.0.0.9"}
    assert pacer.wait_s("10.0.0.3") == pytest.approx(3.0)
    clock.now += 2.5  # drained: 10.0.0.2 and .9 to nothing, .3 to 1.5
    pacer.refused("10.0.0.8")
    pacer.refused("10.0.0.7")  # past the bound again: the drained ones go first
    assert set(pacer._debts) == {"10.0.0.3", "10.0.0.8", "10.0.0.7"}


@pytest.fixture(scope="module", params=["httptools", "h11"])
def server(request: pytest.FixtureRequest) -> Iterator[SimpleNamespace]:
    """A real server whose pacer allows 2 refusals a second past a burst of 3, on either of
    uvicorn's protocols (they queue pipelined requests differently)."""
    pacer = RefusalPacer(rate=2.0, burst=3.0)
    engine = Engine(model="demo", page_size=16, num_pages=64, max_running=4)
    options = uvicorn_options(pacer=pacer)
    if request.param == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        options["http"] = with_refusal_pacing(with_deadlines(H11Protocol, 10.0), pacer)
    with running_server(create_app(AsyncEngine(engine), refusal_pacer=pacer), **options) as url:
        yield SimpleNamespace(url=url, pacer=pacer, engine=engine)
    engine.check_invariants()


def _client(source: str) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=60)


def test_an_address_past_its_burst_is_held_and_another_is_not(server: SimpleNamespace) -> None:
    """ATTACKER's four 400s are answered at once (the burst is 3; the fourth takes its debt
    over it); its fifth is held until the debt drains back to the burst (0.5 s at 2 a
    second) and still gets its 400 in OpenAI's shape. INNOCENT, from another address, is
    never held, its bad request included, and its completion is what the engine gives alone."""
    url = f"{server.url}/v1/completions"
    alone = list(Engine(model="demo", page_size=16, num_pages=64).generate(
        [GOOD["prompt"]], _params())[0].token_ids)
    with _client(ATTACKER) as attacker, _client(INNOCENT) as innocent:
        for _ in range(4):
            assert attacker.post(url, json=BAD).status_code == 400
        assert server.pacer.wait_s(ATTACKER) > 0 and server.pacer.held == 0
        held_from = time.monotonic()
        answer = attacker.post(url, json=BAD)
        assert time.monotonic() - held_from >= 0.4  # (0.5 s less what drained before it was asked)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "max_tokens"
        assert server.pacer.held == 1
        # The innocent, while the attacker is in debt again (its fifth refusal): not held.
        assert server.pacer.wait_s(ATTACKER) > 0
        assert innocent.post(url, json=BAD).status_code == 400
        good = innocent.post(url, json=GOOD)
        assert good.status_code == 200 and good.json()["choices"][0]["text"] is not None
        assert server.pacer.held == 1
        assert _tokens(innocent, server.url) == alone
        metrics = innocent.get(f"{server.url}/metrics").text
    assert "radixserve_http_refusal_holds_total 1.0" in metrics


def test_a_client_that_gives_up_is_not_charged_with_refusals(server: SimpleNamespace) -> None:
    """A client that leaves before its answer (its own timeout; a server too slow to start
    its request) was not refused: the 499 written for nobody must not build a debt that holds
    its address, and everyone behind its NAT, once past the burst (a review saw /health take
    4.5 s after 100 of them)."""
    url = f"{server.url}/v1/completions"
    body = {"prompt": "x", "max_tokens": 900, "ignore_eos": True}  # seconds here (a pool of 1,024 slots)
    gone_before = _disconnects(server.url)
    with httpx.Client(transport=httpx.HTTPTransport(local_address=QUITTER),
                      timeout=httpx.Timeout(60, read=0.05)) as quitter:
        for _ in range(6):
            with pytest.raises(httpx.ReadTimeout):
                quitter.post(url, json=body)
    deadline = time.monotonic() + 60
    while _disconnects(server.url) < gone_before + 6:  # the server has seen each leave
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.pacer.wait_s(QUITTER) == 0


def _disconnects(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("radixserve_http_disconnects_total"))


def test_requests_pipelined_in_one_write_are_held_one_by_one(server: SimpleNamespace) -> None:
    """Eight refused requests in one write from a third address: the first four are answered
    at once (the fourth takes the debt over the burst of 3), then each next one waits for the
    debt to drain back (0.5 s at 2 a second). Held per write alone, all eight were answered
    at once, and a thousand in a write would be too."""
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps(BAD).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n").encode() + body
    with socket.create_connection((host, int(port)), timeout=60, source_address=("127.0.0.3", 0)) as conn:
        started = time.monotonic()
        conn.sendall(request * 8)
        received = b""
        while received.count(b"HTTP/1.1 400") < 8:
            chunk = conn.recv(65536)
            assert chunk, received
            received += chunk
        elapsed = time.monotonic() - started
    assert elapsed >= 1.8, elapsed  # four waits of 0.5 s (less what drains meanwhile)
    assert received.count(b"HTTP/1.1 ") == 8 and received.count(b'"param":"max_tokens"') == 8


def test_a_forwarded_address_is_not_taken_for_the_client(server: SimpleNamespace) -> None:
    """uvicorn takes X-Forwarded-For from 127.0.0.1 as the client's address unless told not
    to: a local client then had its refusals charged to an innocent address (which was held
    until its connections closed unanswered), or to none (never held). The address is the
    connection's."""
    url = f"{server.url}/v1/completions"
    with _client("127.0.0.1") as local:  # (uvicorn trusts the header from 127.0.0.1 alone)
        for _ in range(4):
            response = local.post(url, json=BAD, headers={"X-Forwarded-For": "127.0.0.9"})
            assert response.status_code == 400
    assert server.pacer.wait_s("127.0.0.1") > 0
    assert server.pacer.wait_s("127.0.0.9") == 0


def _deep_debt_server(head_timeout_s: float, keep_alive_s: float, max_hold_s: float) -> Iterator[str]:
    """A real server (its URL, first); then ATTACKER in debt for 8 s (5 refusals, as of as
    many connections at once, at half a refusal a second past a burst of 1), longer than any
    hold here; closing the generator stops the server."""
    pacer = RefusalPacer(rate=0.5, burst=1.0)
    engine = Engine(model="demo", page_size=16, num_pages=64)
    options = {**uvicorn_options(head_timeout_s=head_timeout_s, keep_alive_s=keep_alive_s, pacer=pacer),
               "http": with_refusal_pacing(with_deadlines(_httptools(), head_timeout_s), pacer, max_hold_s)}
    with running_server(create_app(AsyncEngine(engine), refusal_pacer=pacer), **options) as url:
        yield url
        for _ in range(5):
            pacer.refused(ATTACKER)
        yield url


@pytest.mark.parametrize(("head_timeout_s", "keep_alive_s", "reused"), [(10.0, 5.0, False), (1.5, 5.0, False),
                                                                         (10.0, 0.5, True)],
                         ids=["longest-hold", "head-deadline", "reused-connection"])
def test_a_hold_ends_in_a_429_with_retry_after(head_timeout_s: float, keep_alive_s: float, reused: bool) -> None:
    """A request of an address deep in debt is held at most 1 s (the longest hold here), and
    never past the connection's head deadline (1.5 s from its opening), then answered 429
    `too_many_refusals` with Retry-After and its connection closed: not closed unanswered by
    the head deadline, which the hold does not put off either (a head sent in pieces, each
    held, kept a connection open while the deadline restarted at each release), nor by
    uvicorn's keep-alive timer on a reused connection (0.5 s here: it closed the held request
    unanswered)."""
    servers = _deep_debt_server(head_timeout_s, keep_alive_s, max_hold_s=1.0 if head_timeout_s > 5 else 5.0)
    url = next(servers)
    with _client(ATTACKER) as attacker:
        if reused:  # one request on the connection before the debt
            assert attacker.post(f"{url}/v1/completions", json=GOOD).status_code == 200
        next(servers)
        started = time.monotonic()
        response = attacker.post(f"{url}/v1/completions", json=BAD)
        held = time.monotonic() - started
    metrics = httpx.get(f"{url}/metrics").text
    servers.close()
    assert response.status_code == 429 and response.json()["error"]["code"] == "too_many_refusals", response.text
    assert 6 <= int(response.headers["retry-after"]) <= 8 and response.headers["connection"] == "close"
    # Under the deadline the hold ends 50 ms before it: a loaded machine can deliver the 429 a
    # little past 1.5 s (seen: 1.514 s), so the bound is loose; a hold that put the deadline
    # off would run to max_hold_s (5 s).
    assert held >= 0.9 if head_timeout_s > 5 else held < head_timeout_s + 1.0, held
    assert "radixserve_http_refusal_holds_refused_total 1.0" in metrics


def _httptools() -> type:
    from radixserve.server.head_limits import with_head_limits
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return with_head_limits(HttpToolsProtocol)


def _params() -> object:
    from radixserve import SamplingParams

    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _tokens(client: httpx.Client, url: str) -> list[int]:
    response = client.post(f"{url}/v1/completions", json={**GOOD, "return_tokens_as_token_ids": True,
                                                          "logprobs": 0})
    assert response.status_code == 200, response.text
    return [int(token.split(":", 1)[1]) for token in response.json()["choices"][0]["logprobs"]["tokens"]]
