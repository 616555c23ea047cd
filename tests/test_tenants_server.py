"""Sessions and fair share between tenants through a real server with several API keys
(issue 22, items 3 and 5 end to end): real uvicorn on a real port, real httpx clients.

The engine-level tests (test_sessions_tenants.py, test_fair_share.py) check the rules; these
check that the server hands each key's tenant to them, so that one key can neither end, nor
learn of, nor share another key's session, and that one key's flood leaves another key's
output unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.tenancy import Caller

VICTIM, MALLORY = "k-victim", "k-mallory"
KEYS = {VICTIM: Caller("victim", admin=False), MALLORY: Caller("mallory", admin=False)}
QUESTION = {"messages": [{"role": "user", "content": "Tell me about the river and the mill."}],
            "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[Engine, str]]:
    engine = Engine(model="demo", page_size=4, num_pages=2048, debug_checks=True)
    with running_server(create_app(AsyncEngine(engine), tenant_keys=KEYS)) as url:
        yield engine, url


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {key}"})


def _open_session(url: str, key: str, session_id: str) -> None:
    with _client(url, key) as client:
        response = client.post("/v1/chat/completions", json={**QUESTION, "session_id": session_id})
        assert response.status_code == 200, response.text


def _close(url: str, key: str, session_id: str) -> httpx.Response:
    with _client(url, key) as client:
        return client.post(f"/v1/sessions/{session_id}/close")


def test_another_tenants_session_is_answered_as_an_unknown_one(server: tuple[Engine, str]) -> None:
    _, url = server
    _open_session(url, VICTIM, "victims-session")
    theirs = _close(url, MALLORY, "victims-session")
    unknown = _close(url, MALLORY, "no-such-session")
    assert theirs.status_code == unknown.status_code == 404
    # Byte for byte the same answer, but for the id the caller itself sent.
    assert theirs.text.replace("victims-session", "ID") == unknown.text.replace("no-such-session", "ID")
    assert _close(url, VICTIM, "victims-session").status_code == 200  # still open: nothing ended it


def test_one_session_id_from_two_keys_is_two_sessions(server: tuple[Engine, str]) -> None:
    _, url = server
    _open_session(url, VICTIM, "same-id")
    _open_session(url, MALLORY, "same-id")
    assert _close(url, MALLORY, "same-id").status_code == 200
    assert _close(url, VICTIM, "same-id").status_code == 200  # Mallory's close ended only hers
    assert _close(url, VICTIM, "same-id").status_code == 404


def _answer(url: str, key: str, body: dict) -> str:
    with _client(url, key) as client:
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]


def test_a_flooding_key_leaves_another_keys_output_unchanged(server: tuple[Engine, str]) -> None:
    engine, url = server
    alone = _answer(url, VICTIM, QUESTION)
    flood = {"messages": [{"role": "user", "content": "Write a long story about the sea."}],
             "n": 8, "max_tokens": 48, "temperature": 1.0}
    failures: list[str] = []

    def flooder() -> None:
        with _client(url, MALLORY) as client:
            response = client.post("/v1/chat/completions", json=flood)
            if response.status_code != 200:
                failures.append(response.text)

    threads = [threading.Thread(target=flooder) for _ in range(3)]
    for thread in threads:
        thread.start()
    beside = _answer(url, VICTIM, QUESTION)
    for thread in threads:
        thread.join()
    assert not failures
    assert beside == alone
    assert engine.scheduler.running == [] and engine.scheduler.waiting == []
