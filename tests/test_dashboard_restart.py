"""The dashboard's rate charts start again when the server behind it restarts (headless
Chromium): the stats say when their process `started`, and the page never takes a difference
of two processes' cumulative counters (it plotted a TTFT of -1046 ms). The restart is a proxy
in front of two real servers that switches from one to the other between two polls, with no
failed poll in between."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from browser_util import headless_chromium, wait_until
from server_util import running_server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as context:
        yield context


def switching_proxy(target: dict[str, str]) -> Starlette:
    """Forwards every GET and POST to `target["url"]`, read at each request."""
    async def forward(request: Request) -> Response:
        async with httpx.AsyncClient(base_url=target["url"], timeout=60) as client:
            answer = await client.request(request.method, request.url.path, params=request.query_params,
                                          content=await request.body(),
                                          headers={k: v for k, v in request.headers.items()
                                                   if k.lower() in ("authorization", "content-type")})
        return Response(answer.content, status_code=answer.status_code,
                        media_type=answer.headers.get("content-type"))

    return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])


def complete(url: str, count: int) -> None:
    for i in range(count):
        response = httpx.post(f"{url}/v1/completions", timeout=60,
                              json={"prompt": [1, 2, 3, 4, 5, i], "max_tokens": 1, "temperature": 0})
        assert response.status_code == 200, response.text


def test_the_charts_start_again_after_a_restart(browser: Any) -> None:
    first = create_app(AsyncEngine(Engine(model="demo", page_size=4, num_pages=64)))
    target: dict[str, str] = {}
    with running_server(first) as first_url, running_server(switching_proxy(target)) as url:
        target["url"] = first_url
        complete(first_url, 1)
        page = browser.new_page()
        page.goto(f"{url}/dashboard?tree_ms=60000&stats_ms=200")
        wait_until(page, lambda: page.evaluate("radixDashboard.history.length >= 3"), "three points")
        second = create_app(AsyncEngine(Engine(model="demo", page_size=4, num_pages=64)))
        with running_server(second) as second_url:
            complete(second_url, 4)  # more requests than the first had: its counters are larger
            started = httpx.get(f"{second_url}/v1/cache/stats").json()["started"]
            target["url"] = second_url
            wait_until(page, lambda: page.evaluate(f"radixDashboard.stats.started === {started}"), "the new server")
            updates = page.evaluate("radixDashboard.statsUpdates")
            wait_until(page, lambda: page.evaluate(f"radixDashboard.statsUpdates >= {updates + 2}"), "two more polls")
            history = page.evaluate("radixDashboard.history")
            # Every point comes from the new process's counters alone: none from before it
            # started, none across the switch.
            assert all(point["t"] >= started for point in history), history
            assert all(point["ttft"] is None for point in history), history  # no request since
            assert page.evaluate("[radixDashboard.historyResets, radixDashboard.errors]") == [1, 0]
            page.close()  # before its server stops: no poll meets a closed server
