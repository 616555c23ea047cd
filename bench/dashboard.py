"""The dashboard's figures: render time on a synthetic 100k-node tree, and the README screenshot.

    python bench/dashboard.py                      # 100k-node tree: snapshot, fetch, render times
    python bench/dashboard.py --screenshot docs/dashboard.png   # a demo-model server, screenshotted

Needs Debian's chromium and the playwright package (the test extra). Prints medians of --runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from browser_util import headless_chromium  # noqa: E402
from server_util import running_server  # noqa: E402
from test_dashboard_browser import grow_synthetic_tree  # noqa: E402

from radixserve import AsyncEngine, Engine  # noqa: E402
from radixserve.server import create_app  # noqa: E402


def measure(runs: int) -> None:
    engine = Engine(model="demo", page_size=2, num_pages=102_000)
    grow_synthetic_tree(engine, groups=200, branches=500)
    with running_server(create_app(AsyncEngine(engine))) as url, headless_chromium() as browser:
        for max_nodes in (2000, 10000):
            samples = []
            for _ in range(runs):
                page = browser.new_page()
                page.goto(f"{url}/dashboard?max_nodes={max_nodes}&tree_ms=600000&stats_ms=600000")
                page.wait_for_function("radixDashboard.treeUpdates >= 1 && radixDashboard.frameMs !== null")
                samples.append(page.evaluate("({snapshot: radixDashboard.tree.took_ms, fetch: radixDashboard.treeFetchMs,"
                                             " render: radixDashboard.renderMs, frame: radixDashboard.frameMs,"
                                             " drawn: radixDashboard.drawnNodes, total: radixDashboard.tree.nodes_total})"))
                page.close()
            med = {k: statistics.median(s[k] for s in samples) for k in ("snapshot", "fetch", "render", "frame")}
            print(f"{samples[0]['total']} nodes, {samples[0]['drawn']} drawn: snapshot on the engine thread "
                  f"{med['snapshot']:.0f} ms, fetch (incl. snapshot) {med['fetch']:.0f} ms, render script "
                  f"{med['render']:.0f} ms, to next frame {med['frame']:.0f} ms (median of {runs})")


def screenshot(path: Path) -> None:
    engine = Engine(model="demo", page_size=16, num_pages=160)
    system = "You are the radixserve demo assistant. Answer briefly and cite the page table. " * 3
    with running_server(create_app(AsyncEngine(engine), expose_cache_tokens=True)) as url, \
            httpx.Client(base_url=url, timeout=120) as client, headless_chromium() as browser:
        page = browser.new_page()
        page.goto(f"{url}/dashboard?tree_ms=500&stats_ms=500")
        topics = ["radix trees", "paged KV", "eviction", "prefix reuse", "retention", "schedulers"]
        for turn in range(36):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Tell me about {topics[turn % len(topics)]}, part {turn // 6}."}]
            client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 24,
                                                      "retention_priority": 60 if turn % 3 == 0 else 35})
            page.wait_for_timeout(200)
        page.wait_for_timeout(1500)
        page.evaluate("radixDashboard.select(radixDashboard.tree.top_prefixes[0].id)")
        page.screenshot(path=str(path), full_page=True)
    print(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--screenshot", type=Path, default=None)
    args = parser.parse_args()
    if args.screenshot:
        screenshot(args.screenshot)
    else:
        measure(args.runs)


if __name__ == "__main__":
    main()
