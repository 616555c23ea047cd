"""What a cache view costs the engine thread, per step: all at once (as before) or sliced.

    python bench/view_cost.py            # a synthetic 100k-node tree (page size 2)
    python bench/view_cost.py --groups 20 --branches 250   # a smaller one
    python bench/view_cost.py --long-prompts 100 --long-tokens 4000   # the text row's tree

Before, a tree request built its whole view on the engine thread between two steps, and an
event subscribe hashed every cached page there: the step after it waited that long. Now both
run as sliced work (engine/sliced_work.py) at most `--budget-ms` per step; this script runs
them through a SlicedWork exactly as the engine loop does and reports, per step, the engine
thread's time, and how many steps the view spans. Prints medians of --runs.

The last row is the dashboard's query on an --expose-cache-tokens server (tokens=true,
top_k=100) over --long-prompts prompts of --long-tokens tokens, each hit once: decoding is
what a piece of it costs, so its pieces are sized by tokens decoded (tree_snapshot.py).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_dashboard_browser import grow_synthetic_tree  # noqa: E402

from radixserve import Engine  # noqa: E402
from radixserve.cache.page_hash import namespace_id  # noqa: E402
from radixserve.engine.sliced_work import SlicedTask, SlicedWork  # noqa: E402
from radixserve.engine.tree_copy import copy_tree, page_hashes, run_to_end  # noqa: E402
from radixserve.engine.tree_snapshot import SnapshotOptions, build_view, snapshot_tree  # noqa: E402


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def sliced(works: list[Generator[None, None, Any]], budget_ms: float) -> tuple[float, float, float, int]:
    """Runs `works` as the engine loop does: per step, the median and the largest time (of
    steps in which Python's garbage collector made no full pass, then of all steps), and the
    steps taken."""
    runner = SlicedWork(budget_ms / 1e3)
    for work in works:
        runner.add(SlicedTask(work, lambda result, error: None, lambda: False))
    full_passes = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 2:
            full_passes[0] += 1

    gc.callbacks.append(count)
    per_step, quiet = [], []
    try:
        while runner:
            before = full_passes[0]
            per_step.append(timed(runner.run))
            if full_passes[0] == before:
                quiet.append(per_step[-1])
    finally:
        gc.callbacks.remove(count)
    return statistics.median(per_step), max(quiet), max(per_step), len(per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=200)
    parser.add_argument("--branches", type=int, default=500)
    parser.add_argument("--budget-ms", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--long-prompts", type=int, default=100, help="prompts of the text row's tree")
    parser.add_argument("--long-tokens", type=int, default=4000, help="tokens per prompt of the text row's tree")
    args = parser.parse_args()
    engine = Engine(model="demo", page_size=2, num_pages=args.groups * (args.branches + 8) + 1000)
    grow_synthetic_tree(engine, groups=args.groups, branches=args.branches)
    tree = engine.tree
    print(f"{engine.stats()['cache_nodes']} nodes, {tree.cached_pages} pages; budget {args.budget_ms} ms per step")
    options = SnapshotOptions(max_nodes=2000, include_hashes=True)

    def sliced_view() -> Generator[None, None, Any]:
        copy = yield from copy_tree(tree)
        return (yield from build_view(copy, options, namespace_id=namespace_id))

    def sliced_hashes() -> Generator[None, None, Any]:
        copy = yield from copy_tree(tree)
        return (yield from page_hashes(copy, namespace_id))

    long_engine = _long_prompts(args.long_prompts, args.long_tokens)
    text_options = SnapshotOptions(max_nodes=2000, max_depth=32, top_k=100, include_hashes=True, include_tokens=True)
    decode = long_engine.tokenizer.decode

    def sliced_text_view() -> Generator[None, None, Any]:
        copy = yield from copy_tree(long_engine.tree)
        return (yield from build_view(copy, text_options, namespace_id=namespace_id, decode=decode))

    rows = []
    for name, whole, work in (
            ("tree view (2000 nodes, hashes)", lambda: snapshot_tree(tree, options, namespace_id=namespace_id),
             lambda: [sliced_view()]),
            ("event subscribe (first reader)", engine.cache_page_hashes, lambda: [sliced_hashes()]),
            ("16 tree views, distinct max_nodes", None, lambda: _sixteen(tree)),
            (f"tree view with text ({args.long_prompts} x {args.long_tokens}-token prompts, top_k 100)",
             lambda: snapshot_tree(long_engine.tree, text_options, namespace_id=namespace_id, decode=decode),
             lambda: [sliced_text_view()])):
        before = statistics.median(timed(whole) for _ in range(args.runs)) if whole else None
        results = [sliced(work(), args.budget_ms) for _ in range(args.runs)]
        median, worst, worst_gc, steps = (statistics.median(r[k] for r in results) for k in range(4))
        rows.append((name, before, median, worst, worst_gc, steps))
    print("| view | before: engine thread, one step | after: per step, median | max | max with a full GC pass | steps |")
    print("|---|---|---|---|---|---|")
    for name, before, median, worst, worst_gc, steps in rows:
        shown = "-" if before is None else f"{before:.0f} ms"
        print(f"| {name} | {shown} | {median:.2f} ms | {worst:.1f} ms | {worst_gc:.0f} ms | {steps:.0f} |")
    print("(an event subscribe while the hub already listens costs the engine thread nothing: its snapshot "
          "comes from the page mirror on the event loop)")


def _long_prompts(count: int, length: int) -> Engine:
    """An engine whose cache holds `count` distinct prompts of `length` tokens (page size 16),
    each hit once (all of them top prefixes), cached before its thread runs."""
    engine = Engine(model="demo", page_size=16, num_pages=count * (length // 16) + 100, eviction_policy="lru")
    rng = np.random.default_rng(0)
    namespace = (engine.model_name, None)
    for i in range(count):
        tokens = np.concatenate([[i % 200, i // 200], rng.integers(0, 200, length - 2)])[: length // 16 * 16]
        pages = engine.pool.allocate(len(tokens) // 16)
        engine.tree.insert(tokens, pages, namespace)
        engine.pool.decref(pages)
        engine.tree.match(tokens, namespace)
    return engine


def _sixteen(tree: Any) -> list[Generator[None, None, Any]]:
    """One shared copy, then sixteen views of it with distinct max_nodes (as the server does)."""
    copy = run_to_end(copy_tree(tree))  # timed separately above: one copy serves them all
    return [build_view(copy, SnapshotOptions(max_nodes=1000 + i), namespace_id=namespace_id) for i in range(16)]


if __name__ == "__main__":
    main()
