"""A stalled engine shows on the dashboard (headless Chromium, a real server): the page polls
GET /health and shows its reason, gives up a tree request that gets no answer (a tree view waits
for the engine thread) and says how old the tree is.

Before, the stats (published before the stall) kept answering and the status line kept saying
"updated <now>", while the tree request hung for good with no error."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from browser_util import headless_chromium, wait_until
from server_util import running_server, wait_for

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as context:
        yield context


def test_a_stalled_engine_shows_as_unhealthy_with_a_stale_tree(browser: Any) -> None:
    gate = threading.Event()  # the engine thread's steps wait for it: a stuck step
    engine = Engine(model="demo", page_size=4, num_pages=64)
    app = create_app(AsyncEngine(engine, step_hook=gate.wait, stall_timeout_s=0.5))
    with running_server(app) as url:
        page = browser.new_page()
        try:
            # A request: the engine takes a step, and the step never ends.
            stuck = threading.Thread(target=lambda: httpx.post(
                f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=120), daemon=True)
            stuck.start()
            assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 503)
            page.goto(f"{url}/dashboard?tree_ms=300&stats_ms=300&tree_timeout_ms=1000")
            wait_until(page, lambda: page.evaluate("radixDashboard.statsUpdates >= 2"), "two stats polls")
            page.wait_for_selector("#health", state="visible")
            assert "has not completed a step" in page.text_content("#health")
            wait_until(page, lambda: page.get_attribute("#tree-age", "data-stale") == "true", "a stale tree")
            assert "no answer in 1.0 s" in page.text_content("#tree-age")
            assert page.evaluate("radixDashboard.treeUpdates") == 0
            assert "1 running" in page.text_content("#pool-summary") or \
                "1 waiting" in page.text_content("#pool-summary")
        finally:
            gate.set()  # the engine goes on: the page recovers, and the server can stop
        wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 1"), "a tree after the stall")
        page.wait_for_selector("#health", state="hidden")
        wait_until(page, lambda: page.get_attribute("#tree-age", "data-stale") == "false", "a fresh tree")
        assert page.text_content("#tree-age").startswith("tree from ")
        page.close()
