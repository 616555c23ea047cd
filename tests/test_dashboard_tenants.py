"""The dashboard in headless Chromium with a tenant's key: it draws only that tenant's part of
the cache and its own stats (no pool-wide counters), without a script error."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser_util import headless_chromium, wait_until
from server_util import running_server

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app
from radixserve.server.tenancy import Caller

KEYS = {"key-acme": Caller("acme", admin=False), "key-globex": Caller("globex", admin=False)}
POLL = "tree_ms=200&stats_ms=200"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as context:
        yield context


def test_a_tenants_dashboard_shows_only_its_own_cache(tiny_llama_dir: Path, browser: Any) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128)
    app = create_app(AsyncEngine(engine), tenant_keys=KEYS, admin_api_key="key-admin")
    with running_server(app) as url:
        for key, prompt in (("key-acme", list(range(10, 34))), ("key-globex", list(range(100, 116)))):
            response = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                                  json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
            assert response.status_code == 200, response.text
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.goto(f"{url}/dashboard?{POLL}#key=key-globex")
        wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 1 && radixDashboard.statsUpdates >= 2"),
                   "the first tree and two stats polls")
        tree = page.evaluate("radixDashboard.tree")
        assert tree["pages_total"] == 4 and len(tree["root"]["children"]) == 1  # globex's 16 tokens, one namespace
        assert "tenant globex: 4 pages" in page.text_content("#pool-summary")
        assert page.is_hidden("#flush")  # a tenant may not flush (403): no button that always fails
        assert errors == []
        page.close()
