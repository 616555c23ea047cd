"""DNS rebinding: a server listening on loopback answers only for loopback host names and
those given with --allowed-hosts (radixserve/host_names.py, server/host_check.py), on a real uvicorn server."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.cli import build_parser
from radixserve.cli_serve import app_options
from radixserve.server import create_app
from radixserve.server.refusal_pacing import RefusalPacer
from radixserve.host_names import host_names, is_loopback, requested_host


@pytest.mark.parametrize(("header", "host"), [
    ("127.0.0.1:8000", "127.0.0.1"), ("LocalHost", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("Example.COM.:80", "example.com"), ("example.com", "example.com"), ("::1", "::1"),
    ("[FE80::0001]:8000", "fe80::1"), ("[::1", None), ("[::1]evil.example", None), ("[::1]:x", None),
    ("example.com:", None), ("127.0.0.1:80x", None), ("", ""),
])
def test_the_requested_host_is_the_headers_name_in_one_form(header: str, host: str | None) -> None:
    assert requested_host(header) == host


@pytest.mark.parametrize(("host", "loopback"), [
    ("localhost", True), ("a.localhost", True), ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True),
    ("127.1", True), ("0x7f.1", True), ("2130706433", True), ("::ffff:127.0.0.1", True),
    ("128.0.0.1", False), ("0.0.0.0", False), ("127.0.0.1.nip.io", False), ("localhost.evil.example", False),
    ("evil.example", False), ("::ffff:10.0.0.1", False), (None, False),
])
def test_loopback_hosts_in_every_form_a_client_sends(host: str | None, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_loopback_servers_check_names_and_others_only_when_asked() -> None:
    def names(*flags: str) -> frozenset[str] | None:
        return app_options(build_parser().parse_args(["serve", *flags]))["allowed_hosts"]  # type: ignore[return-value]

    assert names() == frozenset()  # the default --host is 127.0.0.1
    assert names("--host", "::1") == frozenset()
    assert names("--host", "0.0.0.0") is None
    assert names("--host", "0.0.0.0", "--allowed-hosts", "Api.Example.com.:443", "[FD00::0001]") == {
        "api.example.com", "fd00::1"}  # in the form a request's Host is compared in: any port
    assert names("--allowed-hosts", "*") is None
    assert host_names("192.0.2.7", ["*", "x"]) is None


def test_a_rebound_name_is_refused_and_the_servers_own_clients_are_served(tiny_llama_dir: Path) -> None:
    """A page whose name the attacker made resolve to 127.0.0.1 reaches the server with its own
    name in Host: every route (the completions, the cache tree, the metrics, the flush) is
    refused in OpenAI's error shape, before any work; the loopback names and the allowed one
    are served, and an innocent client's output is unchanged."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=64)
    pacer = RefusalPacer(rate=0.5, burst=1.0)  # a second 4xx from an address would be held
    app = create_app(AsyncEngine(engine), allowed_hosts=frozenset({"llm.lan"}), refusal_pacer=pacer)
    body = {"prompt": "hello there", "max_tokens": 4, "temperature": 0}
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60) as client:
        before = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        attacker = {"Host": "attacker.example:8000", "Origin": "http://attacker.example:8000"}
        for method, path in [("POST", "/v1/completions"), ("GET", "/v1/cache/tree"), ("GET", "/metrics"),
                             ("GET", "/health"), ("POST", "/v1/cache/flush"), ("GET", "/dashboard")]:
            r = client.request(method, path, headers=attacker, json=body if method == "POST" else None)
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["code"] == "host_not_allowed" and error["param"] == "Host"
            assert "--allowed-hosts attacker.example " in error["message"]
        assert engine.stats()["requests_finished"] == 1  # the refused completion never started
        # Not the server's to count, nor the address's to pay for: every local client shares
        # 127.0.0.1 with the attacker's page (its refusals held them all before).
        assert pacer.wait_s("127.0.0.1") == 0 and pacer.held == 0
        assert "status=\"400\"" not in client.get("/metrics").text
        port = url.rsplit(":", 1)[1]
        with socket.create_connection(("127.0.0.1", int(port))) as raw:  # two Host headers: which one counts?
            raw.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: evil.example\r\n"
                        "Connection: close\r\n\r\n".encode())
            answer = b"".join(iter(lambda: raw.recv(65536), b""))
        assert answer.startswith(b"HTTP/1.1 400") and b"host_not_allowed" in answer
        for host in (f"localhost:{port}", f"127.0.0.2:{port}", f"[::1]:{port}", f"LLM.lan:{port}", f"a.localhost:{port}",
                     f"127.1:{port}"):
            r = client.post("/v1/completions", json=body, headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
            assert r.json()["choices"][0]["text"] == before
        assert client.get("/v1/cache/tree").status_code == 200


def test_without_names_the_app_answers_any_host(tiny_llama_dir: Path) -> None:
    """create_app's default (and a server on a routable address): no check."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=16)
    with running_server(create_app(AsyncEngine(engine))) as url:
        assert httpx.get(f"{url}/health", headers={"Host": "api.example.com"}, timeout=30).status_code == 200


def test_a_keyless_server_refuses_posts_from_pages_of_other_origins(tiny_llama_dir: Path) -> None:
    """Any page the operator visits may POST to a key-less local server (a form, a no-cors
    fetch) and make it generate, or flush its cache, though it cannot read the answer: a
    browser says where a request comes from, and another origin's POST is refused before any
    work; clients that are not browsers, same-origin pages and GETs are served, and a server
    with keys does not check (the page does not know the key)."""
    body = {"prompt": "hello there", "max_tokens": 2, "temperature": 0}
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=64)
    with running_server(create_app(AsyncEngine(engine))) as url, httpx.Client(base_url=url, timeout=60) as client:
        for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                        {"Origin": "http://attacker.example"}, {"Origin": "null"}):
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/cache/flush"):
                r = client.post(path, headers=headers, content=b'{"prompt": "x", "max_tokens": 2}')
                assert r.status_code == 403, (headers, path, r.text)
                assert r.json()["error"]["code"] == "cross_origin"
        assert engine.stats()["requests_finished"] == 0 and engine.stats()["prefill_tokens"] == 0
        assert client.get("/v1/models", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 200
        for headers in ({}, {"Sec-Fetch-Site": "same-origin"}, {"Origin": url}):
            assert client.post("/v1/completions", json=body, headers=headers).status_code == 200, headers
    keyed = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=64)
    with running_server(create_app(AsyncEngine(keyed), api_key="k")) as url:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60,
                       headers={"Authorization": "Bearer k", "Sec-Fetch-Site": "cross-site"})
        assert r.status_code == 200, r.text
