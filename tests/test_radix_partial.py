"""Partial leaves: a finished request's last, partly filled page in the radix tree.

Exact values at page size 4: where a partial leaf is matched (token-deep), when it is
superseded, how it is evicted (first, like any leaf; dropped, never offloaded), and that no
cache event names it. The invariant checker runs after every step.
"""

from __future__ import annotations

import numpy as np

from radixserve.cache.events import BlockRemoved, CacheEvent, CacheEventHub
from radixserve.cache.invariants import check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixNode, RadixTree, Retention
from radixserve.cache.tiers import HostTier
from radixserve.cache.transfer import PageCopier
from tests.test_radix import FakeClock

P = 4


def make(num_pages: int = 32, host_pages: int = 0, page_size: int = P) -> tuple[PagePool, RadixTree, list[CacheEvent]]:
    pool = PagePool(num_pages, page_size)
    hub = CacheEventHub(page_size)
    events: list[CacheEvent] = []
    hub.subscribe(events.append)
    host = None
    if host_pages:
        host_pool = PagePool(host_pages, page_size)
        host = HostTier(host_pool, PageCopier(pool, host_pool))
    return pool, RadixTree(pool, clock=FakeClock(), events=hub, host=host), events


def finish(pool: PagePool, tree: RadixTree, tokens: list[int], **kw) -> tuple[list[int], list[int]]:
    """A finished request: its pages go to the tree with its partial page, then it lets go.
    Returns (its pages, what insert did not adopt)."""
    pages = pool.allocate(-(-len(tokens) // pool.page_size))
    rejected = tree.insert(tokens, pages, partial=True, **kw)
    pool.decref(pages)
    check_invariants(pool, tree, [])
    return pages, rejected


def partial_leaves(tree: RadixTree) -> list[RadixNode]:
    return [node for node, _ in tree.nodes() if node.partial]


def test_a_partial_leaf_is_matched_token_deep() -> None:
    pool, tree, _ = make()
    pages, rejected = finish(pool, tree, list(range(10)))  # 2 full pages and 2 tokens
    assert rejected == [] and tree.cached_pages == 3 and tree.stats()["nodes"] == 2
    (leaf,) = partial_leaves(tree)
    assert leaf.tokens.tolist() == [8, 9] and leaf.pages == [pages[2]] and not leaf.children
    for query, expected in (([*range(10), 50, 51], 2), (list(range(9)), 1), ([*range(9), 77], 1)):
        m = tree.match(query)
        assert (m.pages, m.partial_page, m.partial_tokens, m.num_tokens) == (pages[:2], pages[2], expected,
                                                                           8 + expected)
        assert m.node is leaf.parent  # the lock handle covers the full pages only
    m = tree.match([*range(8), 70, 71])
    assert (m.partial_page, m.partial_tokens) == (None, 0)
    check_invariants(pool, tree, [])


def test_a_partial_leaf_under_the_root_and_beside_a_full_sibling() -> None:
    pool, tree, _ = make()
    short, _ = finish(pool, tree, [5, 6])
    m = tree.match([5, 6, 7, 8, 9])
    assert (m.pages, m.partial_page, m.partial_tokens) == ([], short[0], 2)
    full, _ = finish(pool, tree, [5, 9, 9, 9])  # a full page sharing one token: both stay
    assert len(partial_leaves(tree)) == 1 and tree.cached_pages == 2
    assert tree.match([5, 6, 0, 0, 1]).partial_page == short[0]
    assert (tree.match([5, 9, 0, 0, 1]).partial_page, tree.match([5, 9, 0, 0, 1]).partial_tokens) == (full[0], 2)


def test_a_longer_insert_supersedes_a_partial_leaf_and_a_shorter_one_is_rejected() -> None:
    pool, tree, events = make()
    first, _ = finish(pool, tree, list(range(9)))       # partial [8]
    second, rejected = finish(pool, tree, list(range(11)))  # partial [8, 9, 10] replaces it
    assert rejected == second[:2]  # the full pages were cached already
    assert pool.refcount(first[2]) == 0  # the old partial page is freed
    assert [leaf.tokens.tolist() for leaf in partial_leaves(tree)] == [[8, 9, 10]]
    third, rejected = finish(pool, tree, list(range(10)))  # [8, 9] is held by the longer page
    assert rejected == third and pool.refcount(third[2]) == 0
    fourth, rejected = finish(pool, tree, list(range(12)))  # a full page over it
    assert rejected == fourth[:2] and partial_leaves(tree) == [] and pool.refcount(second[2]) == 0
    assert tree.match(list(range(13))).pages == [*first[:2], fourth[2]]
    assert tree.cached_pages == 3 == pool.num_used
    # No event ever named a partial page: one "stored" per full-page leaf.
    assert [(type(e).__name__, len(e.hashes)) for e in events] == [("BlockStored", 2), ("BlockStored", 1)]


def test_a_partial_leaf_is_evicted_first_like_a_leaf_and_never_reported() -> None:
    pool, tree, events = make()
    pages, _ = finish(pool, tree, list(range(6)))
    stored = list(events)
    assert [len(e.hashes) for e in stored] == [1] and tree.cached_page_hashes() == {(stored[0].namespace,
                                                                                   stored[0].hashes[0])}
    assert tree.evict(1) == 1 and pool.refcount(pages[1]) == 0 and partial_leaves(tree) == []
    assert events == stored  # its eviction is not reported either
    assert tree.stats()["evicted_pages"] == 1
    check_invariants(pool, tree, [])
    assert tree.evict(1) == 1 and isinstance(events[-1], BlockRemoved) and tree.cached_pages == 0


def test_eviction_order_among_leaves_counts_the_partial_leafs_priority_and_recency() -> None:
    pool, tree, _ = make()
    kept, _ = finish(pool, tree, [1, 2, 3, 4, 5], retention=Retention(80))
    other, _ = finish(pool, tree, [9, 9, 9, 9, 9, 9])
    assert tree.evict(1) == 1 and pool.refcount(other[1]) == 0  # the default-priority partial page first
    assert partial_leaves(tree)[0].pages == [kept[1]]
    pool2, tree2, _ = make()
    a, _ = finish(pool2, tree2, [1, 1, 1, 1, 2])
    b, _ = finish(pool2, tree2, [3, 3, 3, 3, 4])
    tree2.match([1, 1, 1, 1, 2, 0])  # uses a's partial page: now b's is the least recent
    assert tree2.evict(1) == 1 and pool2.refcount(b[1]) == 0 and pool2.refcount(a[1]) == 1


def test_a_partial_leaf_is_dropped_never_offloaded_with_a_host_tier() -> None:
    pool, tree, events = make(host_pages=8)
    pages, _ = finish(pool, tree, list(range(10)))
    assert tree.evict(3) == 3 and tree.cached_pages == 0
    assert tree.host_cached_pages == tree.host_only_pages == 2  # the full pages only
    stats = tree.stats()
    assert (stats["offloaded_pages"], stats["dropped_pages"], stats["evicted_pages"]) == (2, 1, 3)
    assert partial_leaves(tree) == [] and all(e.hashes for e in events)
    check_invariants(pool, tree, [])
    m = tree.match(list(range(12)))
    assert (len(m.host_pages), m.partial_page, m.partial_tokens) == (2, None, 0)


def test_insert_over_host_only_pages_then_a_partial_leaf() -> None:
    pool, tree, _ = make(host_pages=8)
    finish(pool, tree, list(range(8)))
    assert tree.evict(2) == 2 and tree.host_only_pages == 2
    pages, rejected = finish(pool, tree, list(range(11)))
    assert rejected == [] and tree.cached_pages == 3 and tree.host_only_pages == 0
    assert tree.match(list(range(12))).partial_page == pages[2]


def test_locks_cover_full_pages_and_flush_drops_partial_leaves() -> None:
    pool, tree, _ = make(host_pages=8)
    finish(pool, tree, list(range(10)))
    m = tree.match(list(range(11)))
    tree.lock(m.node)
    assert tree.locked_pages == 2 and tree.evictable_pages == 1
    freed = tree.reset()
    assert (int(freed), freed.host, freed.tiers()) == (1, 0, {"device": 1, "host": 0})
    assert partial_leaves(tree) == [] and tree.cached_pages == 2
    tree.unlock(m.node)
    assert tree.evict(2) == 2 and tree.host_cached_pages == 2
    freed = tree.reset()
    assert (int(freed), freed.host) == (0, 2) and tree.host_cached_pages == 0
    check_invariants(pool, tree, [])


def test_end_retention_ends_a_partial_leafs_temporary_level() -> None:
    pool, tree, _ = make()
    session = [1, 2, 3, 4, 5, 6]
    pages, _ = finish(pool, tree, session, retention=Retention(90, 60.0))
    finish(pool, tree, [7, 7, 7, 7, 7])  # default priority
    tree.end_retention(session, None, 90)
    (mine,) = [leaf for leaf in partial_leaves(tree) if leaf.pages == [pages[1]]]
    assert mine.retention.effective(0.0).tolist() == [35]
    assert tree.evict(1) == 1 and pool.refcount(pages[1]) == 0  # older, now at the default: first


def test_partial_is_ignored_at_page_size_one_and_without_the_flag() -> None:
    pool, tree, _ = make(page_size=1)
    pages = pool.allocate(3)
    tree.insert([1, 2, 3], pages, partial=True)
    assert partial_leaves(tree) == [] and tree.cached_pages == 3
    pool4, tree4, _ = make()
    pages = pool4.allocate(2)
    tree4.insert(np.arange(6), np.asarray(pages), partial=False)
    assert partial_leaves(tree4) == [] and tree4.cached_pages == 1
    tree4.insert(np.arange(6), np.asarray(pages), partial=True)  # array pages too
    assert [leaf.pages for leaf in partial_leaves(tree4)] == [[pages[1]]]
    pool4.decref(pages)
    check_invariants(pool4, tree4, [])
