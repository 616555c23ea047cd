"""Caps on open connections (server/connection_limits.py): a client that opens connections by
the hundred is refused past its cap, in OpenAI's error shape, while another address is served
with the output it gets alone; refused connections hold no descriptor for long; and
`radixserve serve` derives its caps from the descriptor limit, so that one address cannot
exhaust it."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from server_util import running_server, wait_for

from radixserve import AsyncEngine, Engine
from radixserve.ports import free_port
from radixserve.server import connection_limits as limits_module
from radixserve.server import create_app
from radixserve.server.connection_limits import ConnectionLimits, address_key, connection_limits

REPO_ROOT = Path(__file__).resolve().parent.parent
ATTACKER = "127.0.0.2"  # another loopback address: the innocent client is 127.0.0.1
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12,
        "temperature": 0}


def open_from(address: str, url: str) -> socket.socket:
    """A connection to the server at `url` from local `address`."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    try:
        sock.bind((address, 0))
    except OSError as exc:  # pragma: no cover - a sandbox without 127.0.0.0/8 on loopback
        sock.close()
        pytest.skip(f"cannot bind {address}: {exc}")
    sock.connect((host, int(port)))
    return sock


def read_all(sock: socket.socket) -> bytes:
    """What the server sends until it closes."""
    sock.settimeout(60)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def response_parts(raw: bytes) -> tuple[int, dict[str, str], dict]:
    head, body = raw.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_addresses_are_ipv4_hosts_and_ipv6_slash_64s() -> None:
    assert address_key(("10.1.2.3", 5000)) == "10.1.2.3"
    assert address_key(("2a00:1450:1:2:aaaa::5", 5000, 0, 0)) == "2a00:1450:1:2::/64"
    assert address_key(("2a00:1450:1:2:ffff::9", 1, 0, 0)) == address_key(("2a00:1450:1:2::1", 2, 0, 0))
    assert address_key(("2a00:1450:1:3::1", 1, 0, 0)) != address_key(("2a00:1450:1:2::1", 1, 0, 0))
    assert address_key(("::ffff:10.1.2.3", 1, 0, 0)) == "10.1.2.3"
    # Not global: a network's hosts, each alone (every link-local address is in fe80::/64).
    assert address_key(("fe80::1%eth0", 1, 0, 2)) == "fe80::1%eth0" != address_key(("fe80::2%eth0", 1, 0, 2))
    assert address_key(("fd00::5", 1, 0, 0)) == "fd00::5" and address_key(("::1", 1, 0, 0)) == "::1"
    assert address_key("/run/radixserve.sock") is None and address_key(None) is None


def test_counts_refuse_past_each_cap_and_free_on_release() -> None:
    limits = ConnectionLimits(per_address=2, total=3)
    assert [limits.admit("a"), limits.admit("a"), limits.admit("a")] == [None, None, 429]
    assert [limits.admit("b"), limits.admit("c")] == [None, 503]
    assert limits.admit(None) == 503  # a Unix socket counts in the total only
    limits.release("a")
    assert limits.open_by_address == {"a": 1, "b": 1} and limits.open_total == 2
    assert limits.admit("a") is None and limits.admit("a") == 429
    for key in ("a", "a", "b"):
        limits.release(key)
    assert not limits.open_by_address and limits.open_total == 0
    status, headers, body = response_parts(limits.refusal(429))
    assert status == 429 and headers["retry-after"] == "1" and headers["connection"] == "close"
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "too_many_connections"
    status, _, body = response_parts(limits.refusal(503))
    assert status == 503 and body["error"]["type"] == "server_overloaded"


def test_derived_caps_leave_descriptors_and_need_four_addresses_to_fill() -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits = connection_limits(None, None)
    assert limits is not None and limits.total == max(soft - limits_module.RESERVED_FDS, soft // 4)
    assert limits.per_address == min(limits_module.DEFAULT_PER_ADDRESS, limits.total // 4)
    assert connection_limits(None, 400) == ConnectionLimits(100, 400)
    assert connection_limits(7, 0) == ConnectionLimits(7, 0)
    assert connection_limits(0, 0) is None


@contextmanager
def capped_server(limits: ConnectionLimits, parser: str = "httptools", **options: str) -> Iterator[str]:
    """A real server with the caps on `parser`'s protocol; `options` go to uvicorn.Config."""
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    from radixserve.server.connection_limits import with_connection_limits
    from radixserve.server.connections import with_deadlines

    app = create_app(AsyncEngine(Engine(model="demo", page_size=16, num_pages=64)))
    app.state.server.metrics.watch_connections(limits)
    with running_server(app, http=with_connection_limits(with_deadlines(base, 30.0), limits), **options) as url:
        yield url


UPGRADE = (b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")


@pytest.mark.parametrize("parser", ["httptools", "h11"])
@pytest.mark.parametrize("ws", ["none", "auto"])  # the CLI's setting (uvicorn_options), and uvicorn's default
def test_websocket_upgrades_do_not_keep_a_count(parser: str, ws: str) -> None:
    """An upgraded connection leaves uvicorn's protocol without a connection_lost: counted
    and never released, eight upgrades held a cap of 8 for good (and 20 addresses the server's)."""
    from radixserve.server.connections import uvicorn_options

    assert uvicorn_options()["ws"] == "none"
    limits = ConnectionLimits(per_address=2, total=0)
    with capped_server(limits, parser, ws=ws) as url:
        for _ in range(4):
            upgrade = open_from(ATTACKER, url)
            upgrade.sendall(UPGRADE)
            upgrade.settimeout(60)
            assert not upgrade.recv(4096).startswith(b"HTTP/1.1 429")
            upgrade.close()
            assert wait_for(lambda: ATTACKER not in limits.open_by_address)
        assert limits.open_total == 0 and not limits.refused


def metric_values(client: httpx.Client) -> dict[str, float]:
    lines = client.get("/metrics").text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines
            if line.startswith("radixserve_http_connections")}


@pytest.mark.parametrize("parser", ["httptools", "h11"])
def test_an_address_past_its_cap_gets_429_while_another_is_served_as_alone(
        parser: str, caplog: pytest.LogCaptureFixture) -> None:
    limits = ConnectionLimits(per_address=4, total=0)
    with capped_server(limits, parser) as url, httpx.Client(base_url=url, timeout=60) as innocent:
        alone = innocent.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
        held = [open_from(ATTACKER, url) for _ in range(4)]
        assert wait_for(lambda: limits.open_by_address[ATTACKER] == 4)
        refused = open_from(ATTACKER, url)
        refused.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = response_parts(read_all(refused))  # then the server closes
        refused.close()
        assert status == 429 and headers["retry-after"] == "1"
        assert body["error"] == {"message": "too many open connections from this address (at most 4); "
                                            "reuse connections or retry later",
                                 "type": "rate_limit_error", "param": None, "code": "too_many_connections"}
        # The innocent address is served, with the same output, all along.
        for _ in range(2):
            answer = innocent.post("/v1/chat/completions", json=CHAT)
            assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == alone
        assert limits.refused == {429: 1}
        refused_again = open_from(ATTACKER, url)  # the operator is told once, not per refusal
        assert read_all(refused_again).startswith(b"HTTP/1.1 429")
        refused_again.close()
        notes = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert notes == [f"a connection from {ATTACKER} refused (429): the address holds 4 open connections; "
                         "if it is a proxy, give --max-connections-per-client 0 and cap clients there "
                         "(logged once)"]
        assert limits.refused == {429: 2}
        assert metric_values(innocent) == {"radixserve_http_connections_open": 5.0,
                                           'radixserve_http_connections_refused_total{status="429"}': 2.0,
                                           'radixserve_http_connections_refused_total{status="503"}': 0.0}
        # Closing its connections gives the address its cap back.
        for sock in held:
            sock.close()
        assert wait_for(lambda: ATTACKER not in limits.open_by_address)
        again = open_from(ATTACKER, url)
        again.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert read_all(again).startswith(b"HTTP/1.1 200")
        again.close()
        assert wait_for(lambda: limits.open_total == 1)  # the innocent's kept-alive connection


def test_the_server_cap_answers_503_to_every_address() -> None:
    limits = ConnectionLimits(per_address=0, total=3)
    with capped_server(limits) as url:
        held = [open_from("127.0.0.1", url) for _ in range(3)]
        assert wait_for(lambda: limits.open_total == 3)
        for address in ("127.0.0.1", ATTACKER):
            status, _, body = response_parts(read_all(open_from(address, url)))
            assert status == 503 and body["error"]["code"] == "too_many_connections"
        held.pop().close()
        assert wait_for(lambda: limits.open_total == 2)
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/health").status_code == 200
        for sock in held:
            sock.close()


def test_refused_connections_that_never_read_hold_no_descriptor_for_long(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits_module, "REFUSED_LINGER_S", 0.3)
    limits = ConnectionLimits(per_address=1, total=0)
    with capped_server(limits) as url:
        held = open_from(ATTACKER, url)
        assert wait_for(lambda: limits.open_total == 1)
        before = open_fds()  # the held connection's two ends counted
        silent = [open_from(ATTACKER, url) for _ in range(2 * limits_module.MAX_LINGERING)]
        assert wait_for(lambda: limits.refused[429] == len(silent))
        # Past MAX_LINGERING the refused are closed at once; the others after the linger, so
        # that the server's descriptors come back though the clients keep their sockets.
        assert wait_for(lambda: limits.lingering == 0 and open_fds() == before + len(silent))
        assert limits.open_total == 1
        for sock in silent:
            sock.close()
        held.close()


def test_serve_derives_its_caps_from_a_low_descriptor_limit_and_an_innocent_is_served() -> None:
    """One address opens more connections than the process has descriptors: without the caps
    the server accepts no other connection (the innocent's is reset: checked by hand with both
    caps 0); with them the address is held to a quarter of the total and the innocent client
    is served throughout."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("RADIXSERVE_API_KEY", None)
    descriptors = 600  # hard too: the server cannot raise it, and its caps come from it

    # The limit is set in the child before it becomes the server (no preexec_fn: a fork beside
    # this process's threads).
    serve = [sys.executable, "-m", "radixserve", "serve", "--port", str(port), "--num-pages", "64",
             "--log-level", "warning"]
    lowered = ("import os, resource, sys; "
               f"resource.setrlimit(resource.RLIMIT_NOFILE, ({descriptors}, {descriptors})); "
               "os.execv(sys.executable, sys.argv[1:])")
    process = subprocess.Popen([sys.executable, "-c", lowered, *serve], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    attack: list[socket.socket] = []
    try:
        assert wait_for(lambda: _answers(url, process), timeout=180), "the server did not come up"
        total = descriptors - limits_module.RESERVED_FDS
        per_address = total // 4
        with httpx.Client(base_url=url, timeout=60) as innocent:
            alone = innocent.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]["content"]
            attack = [open_from(ATTACKER, url) for _ in range(descriptors + 100)]
            for _ in range(3):  # each on a new connection, which the server must accept
                answer = innocent.post("/v1/chat/completions", json=CHAT, headers={"connection": "close"})
                assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == alone
            refused = 'radixserve_http_connections_refused_total{status="429"}'
            assert wait_for(lambda: metric_values(innocent)[refused] == len(attack) - per_address)
            assert metric_values(innocent)["radixserve_http_connections_open"] == per_address + 1
    finally:
        for sock in attack:
            sock.close()
        process.terminate()
        _, stderr = process.communicate(timeout=60)
    assert f"at most {per_address} from one address, {total} in all" in stderr


def _answers(url: str, process: subprocess.Popen[str]) -> bool:
    if process.poll() is not None:
        raise AssertionError(process.communicate())
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
