"""Smaller dashboard behaviours in headless Chromium against a real server: the tier colours,
no failed request on load, the first tree asks for text where it is exposed, switching keys
through the form, the key form reachable without a 401, and a selection that does not jump
to another node when the tree changes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from browser_util import headless_chromium, wait_until
from server_util import running_server

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.server import create_app
from radixserve.server.tenancy import Caller

KEYS = {"key-acme": Caller("acme", admin=False)}
ADMIN = "key-admin"
POLL = "tree_ms=200&stats_ms=200"
DEVICE_AND_HOST = "#2ca58d"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as context:
        yield context


@pytest.fixture(scope="module")
def tiered_url() -> Iterator[str]:
    """A server with a host tier, tokens exposed, a tenant and an admin key, whose cache holds
    pages on the device only, on the host only, and on both (loaded back, their host copy kept)."""
    engine = Engine(model="demo", page_size=4, num_pages=48, host_num_pages=128)
    prompts = [[i * 50 + j for j in range(1, 81)] for i in range(4)]
    params = SamplingParams(max_tokens=1, temperature=0)
    for prompt in prompts + prompts[:1]:  # the device fills and offloads; the first loads back
        engine.generate([prompt], params)
    app = create_app(AsyncEngine(engine), expose_cache_tokens=True, tenant_keys=KEYS, admin_api_key=ADMIN)
    with running_server(app) as url:
        yield url


def views(node: dict[str, Any]) -> list[dict[str, Any]]:
    out, stack = [], list(node.get("children", []))
    while stack:
        view = stack.pop()
        out.append(view)
        stack.extend(view.get("children", []))
    return out


def test_pages_on_both_tiers_have_a_colour_and_a_legend(tiered_url: str, browser: Any) -> None:
    """`device+host` nodes were drawn in the fallback grey (nearly the aggregates' grey), and
    the legend and the hover text did not name the tier."""
    page = browser.new_page()
    page.goto(f"{tiered_url}/dashboard?{POLL}#key={ADMIN}")
    wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 1"), "the first tree")
    tree = page.evaluate("radixDashboard.tree")
    both = [v["id"] for v in views(tree["root"]) if v.get("tier") == "device+host"]
    assert both and any(v.get("tier") == "host" for v in views(tree["root"]))
    page.select_option("#colour", "tier")
    fills = page.eval_on_selector_all("#tree rect", "rs => rs.map(r => [Number(r.dataset.id), r.getAttribute('fill')])")
    assert "#999" not in {fill for _, fill in fills}
    assert {fill for i, fill in fills if i in both} == {DEVICE_AND_HOST}
    assert "device+host" in page.text_content("#legend")
    title = page.text_content(f'#tree rect[data-id="{both[0]}"] title')
    assert title.startswith("device+host: ")
    page.close()


def test_no_request_fails_on_load(browser: Any) -> None:
    """The browser asked for /favicon.ico, a 404 and a console error on every load. (A server
    of its own: a browser that met an origin's 404 already does not ask it again.)"""
    with running_server(create_app(AsyncEngine(Engine(model="demo", page_size=4, num_pages=64)))) as url:
        check_no_request_fails(url, browser.new_page())


def check_no_request_fails(url: str, page: Any) -> None:
    failed: list[str] = []
    console: list[str] = []
    page.on("response", lambda response: failed.append(f"{response.status} {response.url}")
            if response.status >= 400 else None)
    page.on("console", lambda message: console.append(message.text) if message.type == "error" else None)
    icons: list[int] = []
    page.on("response", lambda response: icons.append(response.status) if "favicon" in response.url else None)
    page.goto(f"{url}/dashboard?{POLL}")
    wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 2"), "two trees")
    # The browser asks for an icon on its own schedule: its answer, or the console's error.
    wait_until(page, lambda: bool(icons or console), "the icon's answer")
    assert failed == [] and console == [] and icons == [200]
    assert httpx.get(f"{url}/dashboard/favicon.svg").headers["content-type"] == "image/svg+xml"
    page.close()


def test_the_first_tree_asks_for_text_where_it_is_exposed(tiered_url: str, browser: Any) -> None:
    """The tree loop started with the stats loop, before the stats said `expose_tokens`: the
    first tree came without text, and the top table told to start the server with the flag."""
    page = browser.new_page()
    trees: list[str] = []
    page.on("request", lambda request: trees.append(request.url) if "/v1/cache/tree" in request.url else None)
    page.goto(f"{tiered_url}/dashboard?tree_ms=60000&stats_ms=60000#key={ADMIN}")
    wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 1"), "the first tree")
    assert trees and "tokens=true" in trees[0]
    assert "expose-cache-tokens" not in page.text_content("#top tbody")
    page.close()


def test_switching_from_a_tenants_key_to_an_admins(tiered_url: str, browser: Any) -> None:
    """The first admin stats after a tenant's were taken as a difference with the tenant's
    (which carry no pool-wide counters): a TypeError, an error on the page."""
    page = browser.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda error: page_errors.append(str(error)))
    page.goto(f"{tiered_url}/dashboard?{POLL}#key=key-acme")
    wait_until(page, lambda: page.evaluate("radixDashboard.statsUpdates >= 2"), "a tenant's stats")
    assert page.evaluate("radixDashboard.stats.requests") is None
    page.evaluate("document.querySelector('#keyform').hidden = false")
    page.fill("#key", ADMIN)
    page.click("#keyform button[type=submit]")
    wait_until(page, lambda: page.evaluate("radixDashboard.stats.requests !== null"), "an admin's stats")
    updates = page.evaluate("radixDashboard.statsUpdates")
    wait_until(page, lambda: page.evaluate(f"radixDashboard.statsUpdates >= {updates + 2}"), "two more polls")
    assert page.evaluate("radixDashboard.errors") == 0 and page_errors == []
    page.close()


def test_the_key_form_opens_without_a_401(tiered_url: str, browser: Any) -> None:
    """The form is the way in (a key in the URL stays in the browser's history): a button
    opens it at any time, and it says what `#key=` costs."""
    page = browser.new_page()
    page.goto(f"{tiered_url}/dashboard?tree_ms=60000&stats_ms=60000")
    page.wait_for_selector("#keyform", state="visible")  # the first 401
    page.evaluate("document.querySelector('#keyform').hidden = true")
    page.click("#key-button")
    page.wait_for_selector("#keyform", state="visible")
    assert "history" in page.text_content("#keyform")
    page.fill("#key", ADMIN)
    page.click("#keyform button[type=submit]")
    wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 1"), "the tree with the key")
    assert page.evaluate("[sessionStorage.getItem('radixserve-api-key'), localStorage.length]") == [ADMIN, 0]
    page.close()


def test_a_selected_node_without_a_hash_is_not_taken_for_another(browser: Any) -> None:
    """A node with no page hash (a partial leaf) was found again by its id, a position in one
    snapshot: once the tree changed, the details showed another node as the one clicked."""
    engine = Engine(model="demo", page_size=4, num_pages=256)
    with running_server(create_app(AsyncEngine(engine))) as url, httpx.Client(base_url=url, timeout=60) as client:
        def complete(prompt: list[int], **extra: Any) -> None:
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                            **extra})
            assert response.status_code == 200, response.text

        complete(list(range(10, 20)))  # 2 pages and a partial one
        page = browser.new_page()
        page.goto(f"{url}/dashboard?tree_ms=60000&stats_ms=60000")
        wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 1"), "the first tree")
        tree = page.evaluate("radixDashboard.tree")
        partial = next(v for v in views(tree["root"]) if v.get("partial"))
        page.evaluate(f"radixDashboard.select({partial['id']})")
        assert f"prefix tokens\n{partial['prefix_tokens']}" in page.inner_text("#details")
        # A larger namespace (another cache salt) whose partial leaf is drawn first: every id
        # after it moves, and its partial leaf takes the old one's id.
        complete(list(range(100, 162)), cache_salt="other")
        updates = page.evaluate("radixDashboard.treeUpdates")
        page.evaluate("radixDashboard.refreshTree()")
        wait_until(page, lambda: page.evaluate(f"radixDashboard.treeUpdates > {updates}"), "the new tree")
        new_tree = page.evaluate("radixDashboard.tree")
        moved = next(v for v in views(new_tree["root"])
                     if v.get("partial") and v["prefix_tokens"] == partial["prefix_tokens"])
        assert moved["id"] != partial["id"]
        taken = next(v for v in views(new_tree["root"]) if v["id"] == partial["id"])
        assert taken.get("partial") and taken["prefix_tokens"] != partial["prefix_tokens"]
        # The same node, found again (or none at all): never the one now at its old id.
        selected = page.get_attribute("#tree rect.selected", "data-id") if page.query_selector(
            "#tree rect.selected") else None
        assert selected in (None, str(moved["id"]))
        details = page.inner_text("#details")
        assert details.startswith("click a node") or f"prefix tokens\n{partial['prefix_tokens']}" in details
        page.close()


def test_a_refused_flush_says_so(tiered_url: str, browser: Any) -> None:
    """A flush the server refuses (a tenant's key: 403) is reported as the flush's error
    (it read "error (undefined): ..." once errors named their source)."""
    page = browser.new_page()
    page.goto(f"{tiered_url}/dashboard?tree_ms=60000&stats_ms=60000#key=key-acme")
    wait_until(page, lambda: page.evaluate("radixDashboard.statsUpdates >= 1"), "a tenant's stats")
    assert page.is_hidden("#flush")
    page.evaluate("document.querySelector('#flush').hidden = false")
    page.on("dialog", lambda dialog: dialog.accept())
    page.click("#flush")
    wait_until(page, lambda: page.evaluate("radixDashboard.errors >= 1"), "the refused flush")
    assert page.text_content("#status").startswith("error (flush): ")
    page.close()
