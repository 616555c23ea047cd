"""The server under limits: API key, a full queue, a small KV pool, a custom served name."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from server_util import running_server, wait_for

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app

API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_PAGES = 64
PAGE_SIZE = 16


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    engine = Engine(model="demo", page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_running=1, max_queue=1)
    app = create_app(AsyncEngine(engine), served_model_name="tiny-demo", api_key=API_KEY)
    with running_server(app) as url:
        yield SimpleNamespace(url=url, stats=app.state.server.engine.stats, engine=app.state.server.engine)
    engine.check_invariants()


@pytest.fixture
def client(server: SimpleNamespace) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_missing_or_wrong_key_is_401(client: httpx.Client, headers: dict[str, str]) -> None:
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]:
        r = client.request(method, path, headers=headers, json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"


def test_right_key_serves_and_health_needs_none(client: httpx.Client) -> None:
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2, "model": "tiny-demo"})
    assert r.status_code == 200 and r.json()["model"] == "tiny-demo"
    # The checkpoint's own name is accepted too.
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "max_tokens": 2, "model": "demo"})
    assert r.status_code == 200
    assert [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]] == ["tiny-demo"]
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 401  # the single key is the one that reads it
    assert client.get("/metrics", headers=AUTH).status_code == 200


@pytest.mark.parametrize(("path", "body", "param"), [
    # Fits the 4096-token context but not 64 pages x 16 tokens: the engine refuses it up front,
    # naming what does not fit: max_tokens when the prompt alone would, else the prompt.
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1500}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1500},
     "max_completion_tokens"),
    ("/v1/completions", {"prompt": [7] * (NUM_PAGES * PAGE_SIZE), "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 1100}], "max_tokens": 1},
     "messages"),
])
def test_request_larger_than_the_pool_is_400(client: httpx.Client, path: str, body: dict, param: str) -> None:
    r = client.post(path, headers=AUTH, json=body)
    assert r.status_code == 400
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                    "param": param, "code": "context_length_exceeded"}


def test_full_queue_is_503_with_retry_after(client: httpx.Client, server: SimpleNamespace) -> None:
    long_body = {"prompt": "Occupy the only running slot", "max_tokens": 900, "ignore_eos": True, "stream": True}
    queued: dict[str, int] = {}
    engine = server.engine

    def hold_once_running() -> None:  # runs on the engine thread before each step
        if engine.engine.stats()["running"]:
            engine.step_hook = None
            engine.pause()  # the long request stays running (and unfinished) until resume()

    def queued_request() -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/v1/completions", headers=AUTH, json={"prompt": "I wait my turn", "max_tokens": 3})
            queued["status"] = r.status_code

    engine.step_hook = hold_once_running
    try:
        with client.stream("POST", "/v1/completions", headers=AUTH, json=long_body) as running:
            assert running.status_code == 200  # headers arrive with the first token: it is running
            waiter = threading.Thread(target=queued_request)
            waiter.start()
            assert wait_for(lambda: server.stats()["waiting"] == 1, timeout=60)
            r = client.post("/v1/completions", headers=AUTH, json={"prompt": "No room", "max_tokens": 3})
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full" and r.json()["error"]["type"] == "server_overloaded"
            assert server.stats()["running"] == 1
            engine.resume()
    finally:
        engine.step_hook = None
        engine.resume()
    # Leaving the stream aborted the long request: the queued one now runs to completion.
    waiter.join(timeout=30)
    assert queued["status"] == 200
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": "And the server carries on", "max_tokens": 2})
    assert r.status_code == 200


def test_a_batch_larger_than_the_queue_is_400_and_starts_nothing(client: httpx.Client,
                                                                  server: SimpleNamespace) -> None:
    """max_queue 1: a batch's prompts are queued together, so two can never fit; a 503 with
    Retry-After had its client retry it for good, and its first prompt prefilled for nobody."""
    before = {key: server.stats()[key] for key in ("requests_finished", "requests_aborted", "prompt_tokens")}
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": ["one", "two"], "max_tokens": 50})
    assert r.status_code == 400 and "retry-after" not in r.headers
    assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                    "param": "prompt", "code": "request_too_large"}
    assert "--max-queue" in r.json()["error"]["message"]
    assert {key: server.stats()[key] for key in before} == before  # nothing was queued
    r = client.post("/v1/completions", headers=AUTH, json={"prompt": ["one"], "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1


def test_a_batch_with_a_refused_prompt_is_answered_at_once_and_leaves_nothing() -> None:
    """One prompt of a batch refused (a token id past the vocabulary): the 400 comes at once,
    not after the other prompts' first tokens (with the engine paused, as behind a long queue,
    it never came), names that prompt in its message as in its param, and the others leave the
    queue instead of being prefilled for nobody, counted as refused: not as their clients'
    aborts, their prompts not as served. (A server without --max-queue: the batch fits.)"""
    engine = AsyncEngine(Engine(model="demo", page_size=PAGE_SIZE, num_pages=NUM_PAGES))
    counters = ("requests_refused", "requests_aborted", "requests_finished", "prompt_tokens")
    with running_server(create_app(engine)) as url, httpx.Client(base_url=url, timeout=30) as client:
        before = {key: engine.stats()[key] for key in counters}
        engine.pause()
        try:
            r = client.post("/v1/completions", json={"prompt": [[1, 2, 3] * 10, [4, 5] * 20, [10**8]], "max_tokens": 3})
            assert r.status_code == 400, r.text
            assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                            "param": "prompt[2]", "code": "invalid_value"}
            assert r.json()["error"]["message"].startswith("prompt[2]: token ids must be in [0, ")
        finally:
            engine.resume()
        assert wait_for(lambda: engine.stats()["requests_refused"] == before["requests_refused"] + 2)
        stats = engine.stats()
        assert {key: stats[key] for key in counters} == before | {"requests_refused": before["requests_refused"] + 2}
        assert stats["waiting"] == stats["running"] == stats["pages_locked"] == 0


def test_model_retrieve_needs_the_key_and_knows_both_names(client: httpx.Client) -> None:
    assert client.get("/v1/models/tiny-demo").status_code == 401
    for name in ("tiny-demo", "demo"):
        r = client.get(f"/v1/models/{name}", headers=AUTH)
        assert r.status_code == 200 and r.json()["id"] == name and r.json()["object"] == "model"
