"""DNS rebinding: a server listening on loopback answers only for loopback host names and
those given with --allowed-hosts (radixserve/host_names.py, server/host_check.py), on a real uvicorn server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.cli import build_parser
from radixserve.cli_serve import app_options
from radixserve.server import create_app
from radixserve.host_names import host_names, requested_host


@pytest.mark.parametrize(("header", "host"), [
    ("127.0.0.1:8000", "127.0.0.1"), ("LocalHost", "localhost"), ("[::1]:8000", "::1"), ("[::1]", "::1"),
    ("Example.COM.:80", "example.com"), ("example.com", "example.com"), ("::1", "::1"), ("[::1", "::1"),
    ("", ""),
])
def test_the_requested_host_is_the_headers_name_without_port_or_brackets(header: str, host: str) -> None:
    assert requested_host(header) == host


def test_loopback_servers_check_names_and_others_only_when_asked() -> None:
    def names(*flags: str) -> frozenset[str] | None:
        return app_options(build_parser().parse_args(["serve", *flags]))["allowed_hosts"]  # type: ignore[return-value]

    assert names() == frozenset()  # the default --host is 127.0.0.1
    assert names("--host", "::1") == frozenset()
    assert names("--host", "0.0.0.0") is None
    assert names("--host", "0.0.0.0", "--allowed-hosts", "Api.Example.com.", "[fd00::1]") == {"api.example.com",
                                                                                           "fd00::1"}
    assert names("--allowed-hosts", "*") is None
    assert host_names("192.0.2.7", ["*", "x"]) is None


def test_a_rebound_name_is_refused_and_the_servers_own_clients_are_served(tiny_llama_dir: Path) -> None:
    """A page whose name the attacker made resolve to 127.0.0.1 reaches the server with its own
    name in Host: every route (the completions, the cache tree, the metrics, the flush) is
    refused in OpenAI's error shape, before any work; the loopback names and the allowed one
    are served, and an innocent client's output is unchanged."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=64)
    app = create_app(AsyncEngine(engine), allowed_hosts=frozenset({"llm.lan"}))
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
        port = url.rsplit(":", 1)[1]
        for host in (f"localhost:{port}", f"127.0.0.2:{port}", f"[::1]:{port}", f"LLM.lan:{port}", f"a.localhost:{port}"):
            r = client.post("/v1/completions", json=body, headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
            assert r.json()["choices"][0]["text"] == before
        assert client.get("/v1/cache/tree").status_code == 200


def test_without_names_the_app_answers_any_host(tiny_llama_dir: Path) -> None:
    """create_app's default (and a server on a routable address): no check."""
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=16)
    with running_server(create_app(AsyncEngine(engine))) as url:
        assert httpx.get(f"{url}/health", headers={"Host": "api.example.com"}, timeout=30).status_code == 200
