"""Replays the Mooncake synthetic trace through the radix tree alone (no model).

Each request does what the scheduler does: match its prompt (all but the last token), lock
and take the matched pages, evict if the pool is short, allocate the rest, then insert its
pages when it finishes and let go. Timed separately, in CPU time of the benchmark thread
(`time.thread_time`: steadier than wall time on a shared machine): the tree operations, and
the pool and block-table bookkeeping (every PagePool call, wherever made, plus assembling
the block table). The radix replay keeps block tables as int64 arrays (`page_array`,
`allocate_array`). The same replay runs through a naive page-by-page Python trie (a dict per
page, walked one page at a time, same LRU leaf eviction, list block tables), and the table
reports both and the speed-up.

    PYTHONPATH=. python bench/tree_ops.py [--limit N] [--capacity TOKENS] [--page-sizes 1 16] [--no-naive]
"""

from __future__ import annotations

import argparse
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from radixserve.cache import PagePool, RadixTree
from radixserve.workloads import expand_tokens, load_mooncake_trace

TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"


@dataclass
class Timings:
    """Seconds spent, calls made and tokens handled per operation."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("match", "insert", "evict"), 0.0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("match", "insert", "evict"), 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(("match", "insert", "evict"), 0))
    prompt_tokens: int = 0
    hit_tokens: int = 0
    pool_seconds: float = 0.0  # inside PagePool methods, wherever called (tree ops included)
    table_seconds: float = 0.0  # the replay's own block-table assembly and release

    def add(self, op: str, seconds: float, tokens: int) -> None:
        self.seconds[op] += seconds
        self.calls[op] += 1
        self.tokens[op] += tokens


class NaiveNode:
    """One page of the naive trie."""

    __slots__ = ("parent", "key", "children", "page", "last_access", "lock_ref")

    def __init__(self, parent: NaiveNode | None, key: tuple[int, ...] | None, page: int) -> None:
        self.parent, self.key, self.page = parent, key, page
        self.children: dict[tuple[int, ...], NaiveNode] = {}
        self.last_access = 0
        self.lock_ref = 0


class NaiveTrie:
    """The baseline: a trie with one node per page, keyed by the page's token tuple, walked
    page by page in Python; LRU eviction of unlocked leaves through a lazy heap."""

    def __init__(self, pool: PagePool) -> None:
        self.pool, self.size = pool, pool.page_size
        self.root = NaiveNode(None, None, -1)
        self.tick = 0
        self.heap: list[tuple[int, int, NaiveNode]] = []

    def match(self, tokens: list[int]) -> tuple[list[int], NaiveNode]:
        self.tick += 1
        node, pages, size = self.root, [], self.size
        for start in range(0, len(tokens) - size + 1, size):
            child = node.children.get(tuple(tokens[start:start + size]))
            if child is None:
                break
            child.last_access = self.tick
            pages.append(child.page)
            node = child
        return pages, node

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        self.tick += 1
        node, size, adopted = self.root, self.size, []
        for i in range(len(tokens) // size):
            key = tuple(tokens[i * size:(i + 1) * size])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = NaiveNode(node, key, pages[i])
                adopted.append(pages[i])
            child.last_access = self.tick
            node = child
        self.pool.incref(adopted)
        self._push(node)

    def lock(self, node: NaiveNode, delta: int) -> None:
        while node is not self.root:
            node.lock_ref += delta
            if not node.lock_ref and not node.children:
                self._push(node)
            node = node.parent

    def _push(self, node: NaiveNode) -> None:
        if node is not self.root:
            heapq.heappush(self.heap, (node.last_access, id(node), node))

    def evict(self, num_pages: int) -> int:
        evicted: list[int] = []
        while len(evicted) < num_pages and self.heap:
            when, _, node = heapq.heappop(self.heap)
            if node.children or node.lock_ref or node.parent is None:
                continue
            if when != node.last_access:
                self._push(node)
                continue
            del node.parent.children[node.key]
            evicted.append(node.page)  # unlocked, so only the trie holds it
            parent, node.parent = node.parent, None
            if not parent.children and not parent.lock_ref:
                self._push(parent)
        return len(self.pool.decref(evicted))


class TimedPagePool(PagePool):
    """A PagePool that adds the time spent in its bookkeeping methods to `seconds` (the
    outermost call only: allocate calls allocate_array)."""

    seconds = 0.0
    _depth = 0

    def _timed(self, method: Callable, *args):  # type: ignore[no-untyped-def]
        self._depth += 1
        start = time.thread_time()
        try:
            return method(*args)
        finally:
            self._depth -= 1
            if not self._depth:
                self.seconds += time.thread_time() - start

    def allocate(self, n):  # type: ignore[no-untyped-def]
        return self._timed(super().allocate, n)

    def allocate_array(self, n):  # type: ignore[no-untyped-def]
        return self._timed(super().allocate_array, n)

    def incref(self, pages, *, distinct=False):  # type: ignore[no-untyped-def]
        return self._timed(lambda: super(TimedPagePool, self).incref(pages, distinct=distinct))

    def decref(self, pages, *, distinct=False):  # type: ignore[no-untyped-def]
        return self._timed(lambda: super(TimedPagePool, self).decref(pages, distinct=distinct))

    def decref_count(self, pages, *, distinct=False):  # type: ignore[no-untyped-def]
        return self._timed(lambda: super(TimedPagePool, self).decref_count(pages, distinct=distinct))


def replay_radix(prompts: list[np.ndarray], page_size: int, capacity: int) -> Timings:
    pool = TimedPagePool(capacity // page_size, page_size)
    tree = RadixTree(pool, eviction_policy="lru")
    return _replay(prompts, pool, lambda t: tree.match(t[:-1]), tree.insert, tree.evict,
                   lambda m: (m.page_array, m.num_tokens), lambda m, d: (tree.lock if d > 0 else tree.unlock)(m.node),
                   arrays=True)


def replay_naive(prompts: list[list[int]], page_size: int, capacity: int) -> Timings:
    pool = TimedPagePool(capacity // page_size, page_size)
    trie = NaiveTrie(pool)
    return _replay(prompts, pool, lambda t: trie.match(t[:-1]), trie.insert, trie.evict,
                   lambda m: (m[0], len(m[0]) * page_size), lambda m, d: trie.lock(m[1], d))


def _replay(prompts, pool: TimedPagePool, match: Callable, insert: Callable, evict: Callable,
            unpack: Callable, lock: Callable, *, arrays: bool = False) -> Timings:
    """`arrays`: block tables as int64 arrays (the radix tree's page arrays), else lists."""
    size, clock = pool.page_size, time.thread_time
    out = Timings()
    for tokens in prompts:
        t0 = clock()
        m = match(tokens)
        out.add("match", clock() - t0, len(tokens) - 1)
        pages, hit = unpack(m)
        out.prompt_tokens += len(tokens)
        out.hit_tokens += hit
        lock(m, +1)
        pool.incref(pages, distinct=True)  # the tree holds each page once
        # Pages for the whole prompt; a partial hit is recomputed here (no K/V to copy).
        need = math.ceil(len(tokens) / size) - len(pages)
        if pool.num_free < need:
            t0 = clock()
            freed = evict(need - pool.num_free)
            out.add("evict", clock() - t0, freed * size)
        allocated = pool.allocate_array(need) if arrays else pool.allocate(need)
        t0 = clock()
        table = np.concatenate((pages, allocated)) if arrays else list(pages) + allocated
        out.table_seconds += clock() - t0
        t0 = clock()
        insert(tokens, table)
        out.add("insert", clock() - t0, len(tokens) // size * size)
        lock(m, -1)
        pool.decref(table, distinct=True)  # cached pages plus freshly allocated ones
    out.pool_seconds = pool.seconds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    parser.add_argument("--capacity", type=int, default=1_000_000, help="pool size in tokens")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--no-naive", action="store_true", help="skip the naive trie (it is slow at page size 1)")
    args = parser.parse_args()

    requests = load_mooncake_trace(args.trace)[: args.limit]
    arrays = [expand_tokens(r) for r in requests]
    lists = [a.tolist() for a in arrays]
    print(f"{len(requests)} requests, {sum(map(len, arrays)):,} prompt tokens, "
          f"capacity {args.capacity:,} tokens\n")
    print("| page size | matcher | hit rate | match Mtok/s | match µs/op | insert Mtok/s | "
          "insert µs/op | evict Mtok/s | evict µs/op |")
    print("|---|---|---|---|---|---|---|---|---|")
    bookkeeping: list[tuple[int, Timings]] = []
    for size in args.page_sizes:
        radix = replay_radix(arrays, size, args.capacity)
        naive = None if args.no_naive else replay_naive(lists, size, args.capacity)
        for name, t in (("radix (numpy edges)", radix), ("naive page trie", naive)):
            if t is None:
                continue
            cells = [f"{t.hit_tokens / t.prompt_tokens:.1%}"]
            for op in ("match", "insert", "evict"):
                secs, calls = t.seconds[op], max(t.calls[op], 1)
                cells += [f"{t.tokens[op] / secs / 1e6:.1f}" if secs else "-", f"{secs / calls * 1e6:.0f}"]
            print(f"| {size} | {name} | " + " | ".join(cells) + " |")
        if naive is not None:
            ratios = [f"{naive.seconds[op] / radix.seconds[op]:.1f}x" if radix.seconds[op] else "-"
                      for op in ("match", "insert", "evict")]
            print(f"| {size} | speed-up (naive time / radix time) | | {ratios[0]} | | {ratios[1]} | | {ratios[2]} | |")
        bookkeeping.append((size, radix))
    print("\nPool and block-table bookkeeping of the radix replay (PagePool calls wherever made, "
          "tree ops included, plus the replay's table assembly), seconds:\n")
    print("| page size | pool | block tables | total | tree ops (match + insert + evict) |")
    print("|---|---|---|---|---|")
    for size, t in bookkeeping:
        print(f"| {size} | {t.pool_seconds:.3f} | {t.table_seconds:.3f} | "
              f"{t.pool_seconds + t.table_seconds:.3f} | {sum(t.seconds.values()):.3f} |")


if __name__ == "__main__":
    main()
