"""Fair share between clients on a server without tenants' keys (Request.fair_key): one
address's flood is shared with another address's requests as one tenant's is with
another's, on a real server (real sockets, two source addresses). With keys, a tenant is one
client whatever addresses it sends from.

The engine-level orders are test_fair_share.py's (there with tenants, and with clients of
the single tenant); here the server's wiring: the queue's shares (`max_queue`) and the
admission order go by address.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from server_util import running_server, wait_for

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.tenancy import Caller

FLOOD, INNOCENT = "127.0.0.1", "127.0.0.2"
KEY = "k-tenant"
LONG = {"prompt": "a flood of long requests", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


def _post(url: str, body: dict[str, object], source: str, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=120) as client:
        return client.post(f"{url}/v1/completions", json=body, headers=headers)


def _server(**app_kwargs: object) -> Iterator[SimpleNamespace]:
    # One request runs at a time, two may wait: a client's share of the queue is 2, or 1 beside
    # another client waiting.
    engine = Engine(model="demo", page_size=16, num_pages=64, max_running=1, max_queue=2)
    with running_server(create_app(AsyncEngine(engine), **app_kwargs)) as url:
        yield SimpleNamespace(url=url, engine=engine)
    engine.check_invariants()


@pytest.fixture(scope="module")
def keyless() -> Iterator[SimpleNamespace]:
    yield from _server()


@pytest.fixture(scope="module")
def keyed() -> Iterator[SimpleNamespace]:
    yield from _server(tenant_keys={KEY: Caller("acme", admin=False)})


def _fill(server: SimpleNamespace, key: str | None = None) -> tuple[list[threading.Thread], list[tuple[str, int]]]:
    """Three long requests from FLOOD: one running, then two waiting (the queue is full)."""
    finished: list[tuple[str, int]] = []
    threads = [threading.Thread(target=lambda i=i: finished.append(
        (f"flood-{i}", _post(server.url, {**LONG, "prompt": f"{LONG['prompt']} {i}"}, FLOOD, key).status_code)))
        for i in range(3)]
    threads[0].start()
    assert wait_for(lambda: server.engine.stats()["running"] == 1, 60)
    for thread in threads[1:]:
        thread.start()
    assert wait_for(lambda: server.engine.stats()["waiting"] == 2, 60)
    return threads, finished


def test_without_keys_another_address_gets_its_share_of_the_queue_and_goes_first(keyless: SimpleNamespace) -> None:
    """FLOOD holds the running slot and the whole queue: its next request is a 503, but
    INNOCENT's is queued (its share) and admitted before FLOOD's waiting ones. Before fair
    share went round addresses, the two were one tenant: INNOCENT got the 503 too."""
    threads, finished = _fill(keyless)
    assert _post(keyless.url, LONG, FLOOD).status_code == 503
    innocent = _post(keyless.url, {**LONG, "max_tokens": 4}, INNOCENT)
    finished.append(("innocent", innocent.status_code))
    for thread in threads:
        thread.join(120)
    assert innocent.status_code == 200, innocent.text
    assert innocent.json()["usage"]["completion_tokens"] == 4
    # One runs at a time: the innocent request finished before the two flood requests that were
    # waiting when it arrived (and before the running one too where it was served a step's
    # tokens ahead: it is then preempted, its pages cached; docs/server.md, "Many tenants").
    assert [name for name, _ in finished].index("innocent") <= 1, finished
    assert all(status == 200 for _, status in finished), finished
    assert wait_for(lambda: keyless.engine.stats()["running"] == keyless.engine.stats()["waiting"] == 0)


def test_with_keys_a_tenant_is_one_client_from_any_address(keyed: SimpleNamespace) -> None:
    """The tenant that fills the queue from FLOOD gets its 503 from INNOCENT's address too."""
    threads, finished = _fill(keyed, KEY)
    refused = _post(keyed.url, LONG, INNOCENT, KEY)
    for thread in threads:
        thread.join(120)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full", refused.text
    assert sorted(status for _, status in finished) == [200, 200, 200]
