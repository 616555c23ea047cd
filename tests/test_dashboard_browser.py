"""The dashboard in a real headless Chromium against a real server: it draws what /v1/cache/tree
says, follows new requests, works with an API key, and stays exact on a 100k-node tree."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from browser_util import headless_chromium, wait_until
from server_util import running_server
from starlette.responses import PlainTextResponse

from radixserve import AsyncEngine, Engine
from radixserve.server import create_app

API_KEY = "dashboard-test-key"
PAGE_SIZE = 4
TREE_QUERY = "max_nodes=2000&max_depth=32&hashes=true"  # what the dashboard asks for
POLL = "tree_ms=200&stats_ms=200"
HOT = list(range(10, 34))       # 24 tokens = 6 pages, shared by the hot requests
WARM = list(range(100, 116))    # 4 pages, shared by two requests
SCREENSHOT_DIR_ENV = "RADIXSERVE_SCREENSHOT_DIR"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with headless_chromium() as context:
        yield context


def complete(client: httpx.Client, prompt: list[int]) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def idle(client: httpx.Client, finished: int) -> dict[str, Any]:
    """Stats once `finished` requests are done and nothing runs or waits. The engine publishes
    its stats just after it hands out a step's tokens, so the last answer can come first."""
    for _ in range(600):
        stats = client.get("/v1/cache/stats").json()
        requests = stats["requests"]
        if requests["requests_finished"] == finished and requests["running"] == requests["waiting"] == 0:
            return stats
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {stats}")


def views(node: dict[str, Any]) -> list[dict[str, Any]]:
    """Every view below the top one, pre-order."""
    out, stack = [], list(reversed(node.get("children", [])))
    while stack:
        view = stack.pop()
        out.append(view)
        stack.extend(reversed(view.get("children", [])))
    return out


def shape(tree: dict[str, Any]) -> list[tuple[Any, ...]]:
    """What the drawing depends on (ages and timings move on; the structure must not)."""
    return [(v["id"], v["kind"], v["subtree_pages"], v["subtree_nodes"], v["hits"], v["lock_count"],
             v.get("priority"), v.get("hash")) for v in views(tree["root"])]


def drawn(page: Any) -> list[tuple[int, str]]:
    """(id, kind) of every rect of the drawn tree, sorted."""
    pairs = page.eval_on_selector_all("#tree rect", "rs => rs.map(r => [Number(r.dataset.id), r.dataset.kind])")
    return sorted((i, kind) for i, kind in pairs)


def test_dashboard_draws_the_tree_and_follows_requests(tiny_llama_dir: Path, browser: Any, tmp_path: Path) -> None:
    engine = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=256)
    app = create_app(AsyncEngine(engine), api_key=API_KEY)
    with running_server(app) as url, httpx.Client(base_url=url, timeout=60,
                                                   headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        for i in range(5):
            complete(client, HOT + [200 + i] * 5)
        complete(client, WARM + [40, 41, 42, 43, 44])
        complete(client, WARM + [50, 51, 52, 53, 54])
        complete(client, list(range(60, 80)))
        stats = idle(client, 8)
        tree = client.get(f"/v1/cache/tree?{TREE_QUERY}").json()
        hottest = tree["top_prefixes"][0]
        assert hottest["prefix_tokens"] == len(HOT) and hottest["hits"] == 4

        page = browser.new_page()
        requests: list[str] = []
        page.on("request", lambda request: requests.append(request.url))
        page.goto(f"{url}/dashboard?{POLL}#key={API_KEY}")
        wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 1 && radixDashboard.statsUpdates >= 2"),
                   "the first tree and two stats polls")
        assert "key=" not in page.url  # the key left the address bar at once
        assert not page.is_visible("#keyform")  # the key from the fragment was enough

        # The drawing is exactly the snapshot: one rect per view, the hottest prefix marked.
        assert shape(page.evaluate("radixDashboard.tree")) == shape(tree)
        rects = drawn(page)
        assert rects == sorted((v["id"], v["kind"]) for v in views(tree["root"]))
        assert sum(kind == "node" for _, kind in rects) == tree["nodes_shown"] == tree["nodes_total"] > 3
        assert page.get_attribute("#tree", "data-nodes") == str(len(rects))
        hot = page.locator(f'#tree rect[data-id="{hottest["id"]}"]')
        assert "hot" in hot.get_attribute("class")
        width = float(page.get_attribute("#tree", "viewBox").split()[2])
        hot_view = next(v for v in views(tree["root"]) if v["id"] == hottest["id"])
        drawn_width = float(hot.get_attribute("width")) + 0.5
        assert drawn_width == pytest.approx(hot_view["subtree_pages"] / tree["pages_total"] * width, abs=0.02)
        first_row = page.eval_on_selector("#top tbody tr", "r => [...r.cells].map(c => c.textContent)")
        assert first_row[:4] == ["1", str(hottest["hits"]), str(len(HOT)), str(hottest["pages"])]
        assert "expose-cache-tokens" in first_row[5]  # no text leaves without the flag
        assert float(page.get_attribute("#hit-now", "data-value")) == pytest.approx(stats["hit_rate"])

        hot.dispatch_event("click")
        details = page.inner_text("#details")
        assert "tier\ndevice" in details
        assert f"hits\n{hottest['hits']}" in details and f"prefix tokens\n{len(HOT)}" in details

        # New requests: the tree grows, the hit rate moves, and the page follows.
        for i in range(3):
            complete(client, list(range(120, 160)) + [i])
        new_stats = idle(client, 11)
        new_tree = client.get(f"/v1/cache/tree?{TREE_QUERY}").json()
        assert new_tree["nodes_total"] > tree["nodes_total"] and new_stats["hit_rate"] != stats["hit_rate"]
        wait_until(page, lambda: page.evaluate(
            f"radixDashboard.tree.nodes_total === {new_tree['nodes_total']} && "
            f"radixDashboard.stats.hit_rate === {new_stats['hit_rate']!r}"), "the page to show the new requests")
        page.evaluate("radixDashboard.refreshTree()")  # a poll certainly started after the requests
        wait_until(page, lambda: drawn(page) == sorted((v["id"], v["kind"]) for v in views(new_tree["root"])),
                   "the new tree to be drawn")
        assert float(page.get_attribute("#hit-now", "data-value")) == pytest.approx(new_stats["hit_rate"])
        # The node clicked before is still selected: found again by its page hash.
        moved = next(v for v in views(new_tree["root"]) if v.get("hash") == hottest["hash"])
        assert page.get_attribute("#tree rect.selected", "data-id") == str(moved["id"])
        assert page.evaluate("radixDashboard.history.some(p => p.hit !== null && p.ttft !== null)")

        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert page.evaluate("radixDashboard.errors") == 0
        assert requests and all(r.startswith(url + "/") for r in requests), requests  # nothing from elsewhere
        page.close()


def under_route_prefix(app: Any, prefix: str) -> Any:
    """`app` served at `prefix` as Ray Serve's proxy serves an app at its route prefix (the
    prefix in `root_path`, the path whole); every other path is a 404, as where no app is."""
    async def routed(scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "lifespan" or path == prefix or path.startswith(prefix + "/"):
            inner = scope if scope["type"] == "lifespan" else {**scope, "root_path": prefix}
            await app(inner, receive, send)
        else:
            await PlainTextResponse("no app here", status_code=404)(scope, receive, send)
    return routed


def test_dashboard_asks_for_the_key_and_flushes(tiny_llama_dir: Path, browser: Any) -> None:
    """... served under a route prefix (a second app on a cluster): the page's files and API
    calls are that app's, none goes to the root."""
    engine = Engine(model=str(tiny_llama_dir), page_size=PAGE_SIZE, num_pages=128)
    app = under_route_prefix(create_app(AsyncEngine(engine), api_key=API_KEY), "/small")
    with running_server(app) as root, httpx.Client(base_url=f"{root}/small", timeout=60,
                                                    headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        url = f"{root}/small"
        complete(client, HOT)
        assert httpx.get(f"{url}/v1/cache/tree").status_code == 401
        page = browser.new_page()
        requests: list[str] = []
        page.on("request", lambda request: requests.append(request.url))
        page.goto(f"{url}/dashboard?{POLL}")
        page.wait_for_selector("#keyform", state="visible")
        assert page.evaluate("radixDashboard.treeUpdates") == 0
        page.fill("#key", API_KEY)
        page.click("#keyform button")
        wait_until(page, lambda: page.evaluate("radixDashboard.tree !== null && radixDashboard.tree.pages_total === 6"),
                   "the tree after the key was typed")
        page.on("dialog", lambda dialog: dialog.accept())
        page.click("#flush")
        wait_until(page, lambda: page.evaluate("radixDashboard.tree.pages_total === 0"), "the flushed tree")
        assert client.get("/v1/cache/stats").json()["tiers"]["device"]["pages_cached"] == 0
        assert page.locator("#tree text").first.text_content() == "the cache is empty"
        assert all(r.startswith(url + "/") for r in requests), requests  # (its 401s before the key count as errors)
        page.close()


def grow_synthetic_tree(engine: Engine, groups: int, branches: int, seed: int = 0) -> None:
    """Caches `groups` shared prefixes of 8 pages with `branches` one-page children each (one
    node per prefix and per branch: their first pages all differ), through the tree's own
    insert while the engine thread is not running yet. Needs page_size 2."""
    assert engine.page_size == 2 and branches <= 300 * 300
    rng = np.random.default_rng(seed)
    pool, tree = engine.pool, engine.tree
    for group in range(groups):
        system = np.concatenate([[group % 300, group // 300], rng.integers(0, 300, 14)])
        namespace = (engine.model_name, None if group % 2 else f"tenant-{group % 5}")
        for branch in range(branches):
            tokens = np.concatenate([system, [branch % 300, branch // 300]])
            pages = pool.allocate(len(tokens) // 2)
            tree.insert(tokens, pages, namespace)
            pool.decref(pages)  # the tree is now their only holder
            if branch % 50 == 0:
                tree.match(tokens, namespace)  # some hits, so there are hot prefixes


def test_dashboard_on_a_100k_node_tree(tiny_llama_dir: Path, browser: Any) -> None:
    # LRU: the default rule's ghost caches follow every insert and would triple the time the
    # 100,000 inserts take; what is drawn depends on the tree's shape and hit counts alone.
    engine = Engine(model=str(tiny_llama_dir), page_size=2, num_pages=102_000, eviction_policy="lru")
    grow_synthetic_tree(engine, groups=200, branches=500)
    assert engine.stats()["cache_nodes"] == 200 * 501
    app = create_app(AsyncEngine(engine))
    with running_server(app) as url:
        page = browser.new_page()
        page.goto(f"{url}/dashboard?tree_ms=60000&stats_ms=60000")
        wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 1"), "the first tree")
        tree = page.evaluate("radixDashboard.tree")
        assert tree["nodes_total"] == 200 * 501 and tree["truncated"]
        assert tree["nodes_shown"] == 2000  # the budget, exactly (the hottest are among the largest)
        rects = drawn(page)
        assert len(rects) == len(views(tree["root"]))
        assert sum(kind == "node" for _, kind in rects) == 2000
        aggregates = [v for v in views(tree["root"]) if v["kind"] == "aggregate"]
        assert aggregates and sum(v["subtree_nodes"] for v in aggregates) + 2000 == 200 * 501
        # Widths add up: the namespaces' row spans the whole drawing.
        top_row = page.eval_on_selector_all('#tree rect[data-kind="namespace"]',
                                            "rs => rs.reduce((s, r) => s + Number(r.getAttribute('width')) + 0.5, 0)")
        assert top_row == pytest.approx(float(page.get_attribute("#tree", "viewBox").split()[2]), abs=0.1)
        timing = page.evaluate("({render: radixDashboard.renderMs, fetch: radixDashboard.treeFetchMs, "
                               "snapshot: radixDashboard.tree.took_ms})")
        print(f"100k-node tree, 2000 drawn: {timing}")  # figures for docs, not asserted
        page.close()


SALTED = 300  # one-page namespaces in the key-less server below


@pytest.fixture(scope="module")
def salted_url() -> Iterator[str]:
    """A key-less server whose cache holds SALTED namespaces of one page each (what SALTED
    requests with distinct cache_salt values leave behind), cached before the engine starts."""
    engine = Engine(model="demo", page_size=2, num_pages=SALTED + 200, eviction_policy="lru")
    for i in range(SALTED):
        pages = engine.pool.allocate(1)
        engine.tree.insert(np.array([i % 200, i // 200]), pages, (engine.model_name, f"salt-{i}"))
        engine.pool.decref(pages)
    with running_server(create_app(AsyncEngine(engine))) as url:
        yield url


def test_max_nodes_bounds_the_namespaces_drawn(salted_url: str, browser: Any) -> None:
    """300 namespaces and max_nodes=20: 20 are drawn, the other 280 as one grey aggregate in
    the top row (they were all sent and drawn, a top row quadratic in namespaces)."""
    page = browser.new_page()
    page.goto(f"{salted_url}/dashboard?tree_ms=60000&stats_ms=60000&max_nodes=20")
    wait_until(page, lambda: page.evaluate("radixDashboard.treeUpdates >= 1"), "the first tree")
    tree = page.evaluate("radixDashboard.tree")
    top_row = [(v["kind"], v.get("namespaces")) for v in tree["root"]["children"]]
    assert top_row == [("namespace", None)] * 20 + [("aggregate", SALTED - 20)]
    assert tree["nodes_shown"] == 20 and tree["nodes_total"] == SALTED and tree["truncated"]
    assert drawn(page) == sorted((v["id"], v["kind"]) for v in views(tree["root"]))
    # The top row spans the drawing, left to right without gap or overlap.
    xs = page.eval_on_selector_all(
        "#tree rect", "rs => rs.filter(r => Number(r.getAttribute('y')) === 0)"
        ".map(r => [Number(r.getAttribute('x')), Number(r.getAttribute('width')) + 0.5])")
    xs.sort()
    assert xs[0][0] == 0 and all(abs(x + w - nx) < 0.02 for (x, w), (nx, _) in itertools.pairwise(xs))
    assert xs[-1][0] + xs[-1][1] == pytest.approx(float(page.get_attribute("#tree", "viewBox").split()[2]), abs=0.02)
    assert f"+{SALTED - 20} namespaces" in page.text_content("#tree")
    page.close()


def test_a_malformed_key_fragment_is_taken_raw_and_leaves_the_address_bar(salted_url: str, browser: Any) -> None:
    """`#key=50%off` (a key with a '%' pasted unencoded) threw URIError before the fragment was
    removed: the page never polled, and the key stayed in the address bar. The fragment's value
    is URL-encoded (a key holding '&' or '%' is written %26, %25); one that does not decode is
    taken as it is."""
    for fragment, key in (("50%off", "50%off"), ("%E0%A4%A", "%E0%A4%A"), ("a%26b%25c", "a&b%c")):
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda error, errors=errors: errors.append(str(error)))
        page.goto(f"{salted_url}/dashboard?tree_ms=60000&stats_ms=60000#key={fragment}")
        wait_until(page, lambda page=page: page.evaluate("radixDashboard.treeUpdates >= 1"), "the first tree")
        assert "key=" not in page.url and errors == []
        assert page.evaluate("[radixDashboard.key, sessionStorage.getItem('radixserve-api-key')]") == [key, key]
        page.close()


def test_another_site_cannot_flush_a_keyless_server(salted_url: str, browser: Any) -> None:
    """A page of another site that the operator visits fires the POSTs a cross-site page can
    (no-cors fetch, a form's text/plain body): refused (403), nothing flushed. A client with no
    Origin (curl), and the dashboard itself (same origin, the other tests), still flush."""
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse
    from starlette.routing import Route

    async def bait(request: Any) -> HTMLResponse:
        return HTMLResponse("<!doctype html><title>cats</title><p>cute cats</p>")

    flush = f"{salted_url}/v1/cache/flush"
    with running_server(Starlette(routes=[Route("/", bait)])) as other:
        page = browser.new_page()
        page.goto(other.replace("127.0.0.1", "localhost") + "/")  # another site: localhost, not 127.0.0.1
        for init in ("{method: 'POST', mode: 'no-cors'}",
                     "{method: 'POST', mode: 'no-cors', headers: {'Content-Type': 'text/plain'}, body: '{}'}"):
            # The answer is opaque to the page; it has come back once the promise resolves.
            assert page.evaluate(f"url => fetch(url, {init}).then(r => r.type)", flush) == "opaque"
        page.close()
    cached = httpx.get(f"{salted_url}/v1/cache/stats").json()["tiers"]["device"]["pages_cached"]
    assert cached == SALTED
    for headers in ({"Origin": "http://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site", "Origin": salted_url.replace("127.0.0.1", "localhost")}):
        response = httpx.post(flush, headers=headers)
        assert response.status_code == 403 and response.json()["error"]["code"] == "cross_origin", headers
    # Same origin (what the dashboard sends), then no Origin at all (curl): flushed.
    same = httpx.post(flush, headers={"Origin": salted_url, "Sec-Fetch-Site": "same-origin"})
    assert same.status_code == 200 and same.json()["pages_freed"] == SALTED
    assert httpx.post(flush).status_code == 200
