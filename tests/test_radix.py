"""RadixTree unit tests: matching, insertion, retention, locking, eviction, statistics."""

import numpy as np
import pytest

from radixserve.cache.invariants import check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import DEFAULT_PRIORITY, RadixTree, Retention

PAGE_SIZES = [1, 4, 16]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(page_size: int, num_pages: int = 256, policy: str = "priority"):
    clock = FakeClock()
    pool = PagePool(num_pages, page_size)
    return pool, RadixTree(pool, eviction_policy=policy, clock=clock), clock


def seq(start: int, n: int) -> list[int]:
    """n distinct token ids from `start`."""
    return list(range(start, start + n))


def cache(pool: PagePool, tree: RadixTree, tokens, namespace=None, **kw) -> list[int]:
    """What a finishing request does: its pages go to the tree, then it lets go of them.
    Returns the pages the tree now holds for `tokens`."""
    pages = pool.allocate(len(tokens) // pool.page_size)
    tree.insert(tokens, pages, namespace, **kw)
    pool.decref(pages)
    return tree.match(tokens, namespace, update=False).pages


def ok(pool, tree, sequences=()):
    check_invariants(pool, tree, sequences)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_empty_tree_matches_nothing(P):
    pool, tree, _ = make(P)
    m = tree.match(seq(0, 3 * P))
    assert (m.num_tokens, m.pages, m.partial_page, m.partial_tokens) == (0, [], None, 0)
    tree.lock(m.node)
    tree.unlock(m.node)
    ok(pool, tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_insert_caches_full_pages_only_and_match_returns_them(P):
    pool, tree, _ = make(P)
    tokens = seq(0, 3 * P + P // 2)
    pages = pool.allocate(4)
    assert tree.insert(tokens, pages) == []
    assert tree.cached_pages == 3  # the partial fourth page is not cached
    assert pool.refcount(pages[3]) == 1 and pool.refcount(pages[0]) == 2
    m = tree.match(tokens)
    assert m.pages == pages[:3] and m.num_tokens == 3 * P + m.partial_tokens
    assert m.partial_page is None  # the tail was never cached
    pool.decref(pages)
    ok(pool, tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_match_ending_mid_edge_splits_so_the_node_covers_exactly_the_pages(P):
    pool, tree, _ = make(P)
    pages = cache(pool, tree, seq(0, 4 * P))
    assert tree.stats()["nodes"] == 1
    m = tree.match(seq(0, 2 * P))
    assert m.pages == pages[:2] and m.num_tokens == 2 * P
    assert tree.stats()["nodes"] == 2
    assert m.node.pages == pages[:2]
    tree.lock(m.node)
    assert tree.locked_pages == 2 and tree.evictable_pages == 2
    assert tree.evict(10) == 2  # only the unlocked lower half goes
    assert tree.match(seq(0, 4 * P), update=False).pages == pages[:2]
    tree.unlock(m.node)
    ok(pool, tree)


@pytest.mark.parametrize("P", [4, 16])
def test_partial_match_inside_a_cached_page(P):
    pool, tree, _ = make(P)
    pages = cache(pool, tree, seq(0, 3 * P))
    # Query ends two tokens into the second page.
    m = tree.match(seq(0, P + 2))
    assert (m.pages, m.partial_page, m.partial_tokens, m.num_tokens) == ([pages[0]], pages[1], 2, P + 2)
    # Query diverges after one token of the third page.
    query = seq(0, 2 * P + 1) + [10**6] + seq(0, P)
    m = tree.match(query)
    assert (m.pages, m.partial_page, m.partial_tokens) == (pages[:2], pages[2], 1)
    # Query diverges on the very first token of a page: no partial page.
    m = tree.match(seq(0, P) + [10**6] * P)
    assert (m.pages, m.partial_page, m.partial_tokens) == (pages[:1], None, 0)
    ok(pool, tree)


@pytest.mark.parametrize("P", [4, 16])
def test_partial_match_picks_the_child_sharing_most_tokens(P):
    pool, tree, _ = make(P)
    base = seq(0, P)
    children = {}
    for share in range(P):  # child `share` agrees with the query on its first `share` tokens
        tail = seq(1000, share) + [5000 + share] + seq(9000, P - share - 1)
        children[share] = cache(pool, tree, base + tail)[1]
    for share in [P - 1, 2, 0]:
        m = tree.match(base + seq(1000, share) + [7777] * (P - share))
        expect = (children[share], share) if share else (None, 0)
        assert (m.pages, m.partial_page, m.partial_tokens) == (m.pages[:1], *expect), share
    m = tree.match(base + seq(1000, P - 1))  # the query ends before a full page
    assert (len(m.pages), m.partial_page, m.partial_tokens) == (1, children[P - 1], P - 1)
    ok(pool, tree)


@pytest.mark.parametrize("P", [4, 16])
def test_partial_match_below_the_root(P):
    pool, tree, _ = make(P)
    pages = cache(pool, tree, seq(0, 2 * P))
    m = tree.match(seq(0, P - 1))
    assert (m.pages, m.partial_page, m.partial_tokens) == ([], pages[0], P - 1)


def test_page_size_one_never_has_a_partial_page():
    pool, tree, _ = make(1)
    cache(pool, tree, seq(0, 5))
    m = tree.match(seq(0, 3) + [99])
    assert (m.num_tokens, m.partial_page, m.partial_tokens) == (3, None, 0)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_namespaces_never_share_pages(P):
    pool, tree, _ = make(P)
    tokens = seq(0, 2 * P)
    a = cache(pool, tree, tokens, namespace="a")
    assert tree.match(tokens, "b").num_tokens == 0
    assert tree.match(tokens).num_tokens == 0  # None is a namespace too
    b = cache(pool, tree, tokens, namespace=("tenant", 7))
    assert set(a).isdisjoint(b)
    assert tree.match(tokens, "a").pages == a
    assert tree.match(tokens, ("tenant", 7)).pages == b
    assert tree.cached_pages == 4
    ok(pool, tree)


@pytest.mark.parametrize("as_array", [False, True])
@pytest.mark.parametrize("P", PAGE_SIZES)
def test_insert_returns_duplicates_and_adopts_only_new_pages(P, as_array):
    pool, tree, _ = make(P)
    first = cache(pool, tree, seq(0, 2 * P))
    # A request that matched the first page and computed two more.
    m = tree.match(seq(0, P))
    pool.incref(m.pages)
    mine = m.pages + pool.allocate(2)
    dups = tree.insert(seq(0, 3 * P), np.array(mine) if as_array else mine)
    assert dups == [mine[1]]  # page 0 is the tree's own, page 2 is new
    assert pool.refcount(mine[2]) == 2  # adopted
    assert pool.decref(mine) == [mine[1]]  # the duplicate frees, the rest stay cached
    assert tree.match(seq(0, 3 * P)).pages == first + [mine[2]]
    ok(pool, tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_insert_diverging_mid_edge_splits_at_the_page_boundary(P):
    pool, tree, _ = make(P)
    a = cache(pool, tree, seq(0, 4 * P))
    diverging = seq(0, 2 * P + P // 2) + [10**6] * (2 * P - P // 2)
    pages = pool.allocate(4)
    dups = tree.insert(diverging, pages)
    assert dups == pages[:2]
    pool.decref(pages)
    assert tree.stats()["nodes"] == 3  # shared top, two branches
    assert tree.match(diverging).pages == a[:2] + pages[2:]
    assert tree.match(seq(0, 4 * P)).pages == a
    ok(pool, tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_insert_extends_a_leaf(P):
    pool, tree, _ = make(P)
    a = cache(pool, tree, seq(0, P))
    pages = pool.allocate(3)
    tree.insert(seq(0, 3 * P), [a[0]] + pages[1:])
    pool.decref(pages)
    assert tree.match(seq(0, 3 * P)).pages == [a[0]] + pages[1:]
    ok(pool, tree)


def test_insert_needs_a_page_per_full_page_of_tokens():
    pool, tree, _ = make(4)
    with pytest.raises(ValueError, match="3 full pages"):
        tree.insert(seq(0, 12), pool.allocate(2))


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_evict_takes_pages_from_the_tail_of_a_leaf(P):
    pool, tree, _ = make(P, num_pages=8)
    pages = cache(pool, tree, seq(0, 3 * P))
    assert tree.evict(1) == 1
    assert pool.refcount(pages[2]) == 0 and pool.num_free == 6
    assert tree.match(seq(0, 3 * P)).pages == pages[:2]
    assert tree.evict(5) == 2
    assert tree.cached_pages == 0 and pool.num_free == 8
    assert tree.stats()["nodes"] == 0
    ok(pool, tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_lru_order_among_equal_priorities(P):
    pool, tree, _ = make(P)
    a = cache(pool, tree, seq(0, 2 * P))
    b = cache(pool, tree, seq(100, 2 * P))
    c = cache(pool, tree, seq(200, 2 * P))
    tree.match(seq(0, 2 * P))  # a is now the most recent
    assert tree.evict(2) == 2
    assert pool.refcount(b[0]) == 0 and pool.refcount(b[1]) == 0
    assert tree.evict(2) == 2
    assert all(pool.refcount(p) == 0 for p in c)
    assert all(pool.refcount(p) == 1 for p in a)
    ok(pool, tree)


@pytest.mark.parametrize("P", [1, 4])
def test_parent_left_childless_becomes_evictable(P):
    pool, tree, _ = make(P)
    shared = seq(0, P)
    cache(pool, tree, shared + seq(100, P))
    cache(pool, tree, shared + seq(200, P))
    assert tree.stats()["nodes"] == 3
    assert tree.evict(2) == 2  # both leaves
    assert tree.stats()["nodes"] == 1
    assert tree.evict(1) == 1  # then the parent
    assert tree.cached_pages == 0
    ok(pool, tree)


@pytest.mark.parametrize("P", PAGE_SIZES)
def test_locked_nodes_are_never_evicted(P):
    pool, tree, _ = make(P)
    a = cache(pool, tree, seq(0, 3 * P))
    cache(pool, tree, seq(0, 2 * P) + seq(500, 2 * P))
    m = tree.match(seq(0, 3 * P))
    tree.lock(m.node)
    tree.lock(m.node)
    assert tree.locked_pages == 3
    assert tree.evict(100) == 2  # only the other branch
    assert tree.match(seq(0, 3 * P)).pages == a
    tree.unlock(m.node)
    assert tree.evict(100) == 0
    tree.unlock(m.node)
    with pytest.raises(ValueError, match="not locked"):
        tree.unlock(m.node)
    assert tree.evict(100) == 3
    with pytest.raises(ValueError, match="evicted"):
        tree.lock(m.node)
    ok(pool, tree)


@pytest.mark.parametrize("P", [1, 4])
def test_priority_beats_recency(P):
    pool, tree, _ = make(P)
    high = cache(pool, tree, seq(0, P), retention=Retention(80))
    low = cache(pool, tree, seq(100, P), retention=Retention(10))
    default = cache(pool, tree, seq(200, P))
    tree.match(seq(100, P))  # low is the most recent but still goes first
    order = []
    for _ in range(3):
        tree.evict(1)
        order.append(next(p for p in (high, low, default) if pool.refcount(p[0]) == 0 and p not in order))
    assert order == [low, default, high]


@pytest.mark.parametrize("P", [1, 4])
def test_lru_policy_ignores_priority(P):
    pool, tree, _ = make(P, policy="lru")
    high = cache(pool, tree, seq(0, P), retention=Retention(100))
    low = cache(pool, tree, seq(100, P), retention=Retention(0))
    tree.evict(1)
    assert pool.refcount(high[0]) == 0 and pool.refcount(low[0]) == 1


@pytest.mark.parametrize("P", [1, 4])
def test_priority_decays_to_default_after_its_duration(P):
    pool, tree, clock = make(P)
    kept = cache(pool, tree, seq(0, P), retention=Retention(90, duration_s=10.0))
    plain = cache(pool, tree, seq(100, P))
    clock.now = 9.0
    tree.evict(1)
    assert pool.refcount(plain[0]) == 0 and pool.refcount(kept[0]) == 1
    plain = cache(pool, tree, seq(100, P))
    clock.now = 10.0  # decayed: now both default, `kept` is older
    tree.evict(1)
    assert pool.refcount(kept[0]) == 0 and pool.refcount(plain[0]) == 1
    ok(pool, tree)


def test_low_priority_with_duration_rises_to_default():
    pool, tree, clock = make(4)
    low = cache(pool, tree, seq(0, 4), retention=Retention(0, duration_s=5.0))
    clock.now = 1.0
    plain = cache(pool, tree, seq(100, 4))
    clock.now = 6.0
    tree.match(seq(100, 4))
    tree.evict(1)  # both default now: LRU picks `low`
    assert pool.refcount(low[0]) == 0 and pool.refcount(plain[0]) == 1


@pytest.mark.parametrize("P", [1, 4])
def test_retention_takes_the_max_of_current_and_new(P):
    pool, tree, clock = make(P)
    a = cache(pool, tree, seq(0, P), retention=Retention(80))
    b = cache(pool, tree, seq(100, P), retention=Retention(60))
    pages = pool.allocate(1)
    assert tree.insert(seq(0, P), pages, retention=Retention(50)) == pages  # a stays at 80
    pool.decref(pages)
    tree.evict(1)
    assert pool.refcount(b[0]) == 0 and pool.refcount(a[0]) == 1
    b = cache(pool, tree, seq(100, P), retention=Retention(60))
    pages = pool.allocate(1)
    tree.insert(seq(0, P), pages, retention=Retention(40, duration_s=1.0))  # lower: ignored
    pool.decref(pages)
    clock.now = 2.0
    tree.evict(1)
    assert pool.refcount(b[0]) == 0 and pool.refcount(a[0]) == 1


@pytest.mark.parametrize("P", [1, 4, 16])
def test_range_retention_protects_a_system_prompt_inside_a_longer_edge(P):
    pool, tree, _ = make(P)
    # Tokens [0, P + 1) are the "system prompt": pages 0 and 1 overlap it.
    long = cache(pool, tree, seq(0, 4 * P), range_retention=[(0, P + 1, Retention(90))])
    other = cache(pool, tree, seq(1000, 2 * P))
    assert tree.stats()["nodes"] == 2
    assert tree.evict(2) == 2  # the two default tail pages of `long` go first (older)
    assert [pool.refcount(p) for p in long] == [1, 1, 0, 0]
    assert tree.evict(2) == 2  # then `other`, although newer than `long`'s protected head
    assert all(pool.refcount(p) == 0 for p in other)
    assert [pool.refcount(p) for p in long] == [1, 1, 0, 0]
    ok(pool, tree)


@pytest.mark.parametrize("P", [1, 4])
def test_reset_drops_every_unlocked_page(P):
    pool, tree, _ = make(P)
    kept = cache(pool, tree, seq(0, 3 * P))
    cache(pool, tree, seq(0, P) + seq(300, 2 * P))
    cache(pool, tree, seq(600, P), namespace="x")
    m = tree.match(seq(0, 2 * P))
    tree.lock(m.node)
    assert tree.reset() == 4
    assert tree.cached_pages == 2 and tree.locked_pages == 2
    assert tree.match(seq(0, 3 * P), update=False).pages == kept[:2]
    ok(pool, tree)
    tree.unlock(m.node)
    assert tree.evict(5) == 2
    ok(pool, tree)


def test_match_without_update_changes_nothing():
    pool, tree, _ = make(4)
    pages = cache(pool, tree, seq(0, 16))
    before = tree.stats()
    m = tree.match(seq(0, 6), update=False)
    assert (m.pages, m.partial_page, m.partial_tokens) == (pages[:1], pages[1], 2)
    assert tree.stats() == before
    assert m.node.is_root  # no split: the deepest fully matched node is the root
    assert tree.match(seq(0, 20), update=False).node.pages == pages


def test_stats_and_age_histograms_follow_the_clock():
    pool, tree, clock = make(4)
    cache(pool, tree, seq(0, 8))
    clock.now = 7.0
    tree.match(seq(0, 8) + [1, 2, 3])
    tree.match(seq(50, 4))
    clock.now = 20.0
    assert tree.evict(2) == 2
    s = tree.stats()
    assert (s["lookups"], s["lookup_tokens"], s["hit_tokens"]) == (2, 15, 8)
    assert s["hit_rate"] == pytest.approx(8 / 15)
    assert (s["cached_pages"], s["free_pages"], s["evicted_pages"]) == (0, 256, 2)
    assert (s["hit_age_seconds_sum"], s["hit_age_seconds_count"]) == (14.0, 2)
    assert (s["evict_age_seconds_sum"], s["evict_age_seconds_count"]) == (40.0, 2)
    assert (s["evict_reuse_sum"], s["evict_reuse_count"]) == (2.0, 2)
    hist = tree.histograms()["evict_age_seconds"]
    assert hist.cumulative()[-1] == (float("inf"), 2)
    assert dict(hist.cumulative())[15.0] == 0 and dict(hist.cumulative())[30.0] == 2


@pytest.mark.parametrize("P", [1, 4])
def test_counters_track_locks_and_splits(P):
    pool, tree, _ = make(P)
    cache(pool, tree, seq(0, 4 * P))
    m1 = tree.match(seq(0, 3 * P))
    tree.lock(m1.node)
    m2 = tree.match(seq(0, P))  # splits the locked node again
    tree.lock(m2.node)
    assert (tree.cached_pages, tree.locked_pages, tree.evictable_pages) == (4, 3, 1)
    ok(pool, tree)
    tree.unlock(m1.node)
    assert (tree.locked_pages, tree.evictable_pages) == (1, 3)
    tree.unlock(m2.node)
    assert tree.locked_pages == 0
    ok(pool, tree)


def test_repeated_lock_cycles_keep_the_eviction_heap_bounded():
    pool, tree, _ = make(4)
    cache(pool, tree, seq(0, 8))
    for _ in range(500):
        m = tree.match(seq(0, 8))
        tree.lock(m.node)
        tree.unlock(m.node)
    assert len(tree._queue) <= 2 * tree.stats()["nodes"] + 65
    assert tree.evict(2) == 2


def test_numpy_tokens_are_not_aliased():
    pool, tree, _ = make(4)
    tokens = np.arange(8, dtype=np.int64)
    pages = pool.allocate(2)
    tree.insert(tokens, pages)
    tokens[:] = 99  # the caller reuses its buffer
    assert tree.match(list(range(8))).pages == pages


def test_retention_is_validated():
    assert Retention().priority == DEFAULT_PRIORITY == 35
    with pytest.raises(ValueError, match="priority"):
        Retention(101)
    with pytest.raises(ValueError, match="duration_s"):
        Retention(50, duration_s=0)
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixTree(PagePool(4, 4), eviction_policy="fifo")


def test_equal_priority_inside_a_leaf_yields_to_an_older_leaf():
    pool, tree, _ = make(4)
    old = cache(pool, tree, seq(1000, 4), retention=Retention(90))
    # Pages 0-1 of `new` are protected at the same priority as `old`, pages 2-3 are default.
    new = cache(pool, tree, seq(0, 16), range_retention=[(0, 5, Retention(90))])
    assert tree.evict(3) == 3
    assert [pool.refcount(p) for p in new] == [1, 1, 0, 0]  # the older equal-priority leaf went
    assert pool.refcount(old[0]) == 0


def test_an_expired_priority_is_replaced_by_a_lower_new_one():
    pool, tree, clock = make(4)
    a = cache(pool, tree, seq(0, 4), retention=Retention(80, duration_s=2.0))
    b = cache(pool, tree, seq(100, 4), retention=Retention(40))
    clock.now = 2.0  # a has just decayed to the default, so 50 beats it
    pages = pool.allocate(1)
    tree.insert(seq(0, 4), pages, retention=Retention(50))
    pool.decref(pages)
    tree.evict(1)
    assert pool.refcount(b[0]) == 0 and pool.refcount(a[0]) == 1


def test_equal_priority_keeps_the_later_expiry():
    pool, tree, clock = make(4)
    a = cache(pool, tree, seq(0, 4), retention=Retention(80, duration_s=2.0))
    pages = pool.allocate(1)
    tree.insert(seq(0, 4), pages, retention=Retention(80))  # same priority, never decays
    pool.decref(pages)
    clock.now = 1.0
    b = cache(pool, tree, seq(100, 4), retention=Retention(60))
    clock.now = 5.0
    tree.evict(1)
    assert pool.refcount(b[0]) == 0 and pool.refcount(a[0]) == 1


def test_duplicates_are_exactly_the_pages_that_differ_within_one_edge():
    pool, tree, _ = make(4)
    cached = cache(pool, tree, seq(0, 12))  # one node of three pages
    (mine,) = pool.allocate(1)
    assert tree.insert(seq(0, 12), [cached[0], mine, cached[2]]) == [mine]
    assert pool.refcount(mine) == 1 and tree.stats()["nodes"] == 1


def test_a_temporary_boost_decays_to_the_permanent_retention_not_the_default() -> None:
    clock = FakeClock()
    pool = PagePool(16, 1)
    tree = RadixTree(pool, clock=clock)
    a, b = pool.allocate(2), pool.allocate(2)
    tree.insert([1, 2], a, retention=Retention(50))
    tree.insert([3, 4], b, retention=Retention(40))
    tree.insert([1, 2], a, retention=Retention(90, duration_s=10))
    pool.decref(a + b)
    clock.now = 20.0  # the boost has expired: [1, 2] is back at 50, above [3, 4] at 40
    assert tree.evict(2) == 2
    assert tree.match([1, 2, 9], update=False).num_tokens == 2
    assert tree.match([3, 4, 9], update=False).num_tokens == 0


def test_end_retention_drops_only_the_temporary_level() -> None:
    clock = FakeClock()
    pool = PagePool(16, 1)
    tree = RadixTree(pool, clock=clock)
    a, b = pool.allocate(2), pool.allocate(2)
    tree.insert([1, 2], a, retention=Retention(50))
    tree.insert([1, 2], a, retention=Retention(90, duration_s=100))  # a session-like boost
    tree.insert([3, 4], b, retention=Retention(95))  # someone else's higher, permanent retention
    tree.insert([3, 4], b, retention=Retention(90, duration_s=100))
    pool.decref(a + b)
    tree.end_retention([1, 2], None, 90)
    tree.end_retention([3, 4], None, 90)
    assert tree.evict(2) == 2  # [1, 2] fell back to 50, below [3, 4] still at 95
    assert tree.match([3, 4, 9], update=False).num_tokens == 2


def test_node_page_arrays_and_match_arrays_mirror_the_page_lists() -> None:
    """Random inserts (lists and arrays), matches, splits and evictions at page size 1 and 4."""
    rng = np.random.default_rng(3)
    for page_size in (1, 4):
        pool = PagePool(400, page_size)
        tree = RadixTree(pool, eviction_policy="lru")
        for step in range(300):
            tokens = rng.integers(0, 3, size=int(rng.integers(1, 40))).tolist()
            peek = tree.match(tokens, update=False)
            assert peek.page_array.tolist() == peek.pages
            match = tree.match(tokens)
            assert match.page_array.tolist() == match.pages
            tree.lock(match.node)
            need = -(-len(tokens) // page_size) - len(match.pages)
            if pool.num_free < need:
                tree.evict(need - pool.num_free)
            if pool.num_free < need:
                tree.unlock(match.node)
                continue
            pool.incref(match.page_array, distinct=True)
            table = match.pages + pool.allocate(need)
            dups = tree.insert(tokens, np.array(table) if step % 3 else table)
            assert all(isinstance(d, int) for d in dups)
            tree.unlock(match.node)
            pool.decref(table)
            for node, pages in tree.nodes():
                assert node.page_array.dtype == np.int64 and node.page_array.tolist() == pages
        tree.reset()
        assert pool.num_free == pool.num_pages


def test_a_retention_raised_by_every_request_keeps_the_expiry_heaps_bounded_and_still_decays():
    """A system prompt every request raises for 300 s (100 requests a second, nothing
    evicted): each raise supersedes the expiry times before it, so neither tier's expiry heap
    grows with the requests (it kept one entry a request, and the nodes they named); the
    prompt still decays 300 s after its last raise."""
    from radixserve.cache.tiers import HostTier
    from radixserve.cache.transfer import PageCopier

    clock = FakeClock()
    pool, host = PagePool(64, 4), PagePool(64, 4)
    tree = RadixTree(pool, clock=clock, host=HostTier(host, PageCopier(pool, host)))
    system = seq(0, 16)
    for _ in range(5000):
        clock.now += 0.01
        cache(pool, tree, system, retention=Retention(80, duration_s=300.0))
    bound = 2 * tree._forest.num_nodes + 64
    assert len(tree._queue._expiries) <= bound and len(tree._host_tier._queue._expiries) <= bound
    plain = cache(pool, tree, seq(100, 4))
    clock.now += 299.0
    tree.evict(1)
    assert pool.refcount(plain[0]) == 0  # the prompt is still raised
    plain = cache(pool, tree, seq(100, 4))
    clock.now += 1.0  # 300 s after the last raise: default, and older than `plain`
    tree.evict(4)
    assert tree.match(system, update=False).pages == [] and pool.refcount(plain[0]) == 1
    ok(pool, tree)


def test_a_raise_after_an_unprocessed_decay_keeps_the_decayed_key_through_expiry_compaction():
    """X held at 80 for 5 s decays unnoticed (nothing evicted), is raised to 60 at 6 s, then
    another prompt's raises make the expiry heap drop superseded entries: X must be queued
    with its key of 60, not still with the 80 of before its decay (evicted after Z at 70)."""
    pool, tree, clock = make(1)
    x = cache(pool, tree, seq(0, 1), retention=Retention(80, duration_s=5.0))
    z = cache(pool, tree, seq(100, 1), retention=Retention(70))
    clock.now = 6.0
    cache(pool, tree, seq(0, 1), retention=Retention(60, duration_s=100.0))
    for _ in range(200):  # superseded expiry entries, past the heap's bound
        clock.now += 0.01
        cache(pool, tree, seq(200, 1), retention=Retention(90, duration_s=300.0))
    tree.evict(1)
    assert pool.refcount(x[0]) == 0 and pool.refcount(z[0]) == 1
    ok(pool, tree)


def test_ending_a_retention_requeues_a_device_leaf_above_pages_on_the_host_only():
    """A session's pages A, B held at 80; B leaves for the host, so A is a device leaf. The
    session ends (both back to the default) and C, an ordinary page, is newer: A goes first
    (it kept its queued key of 80 and C went, though only the path's last node was re-queued)."""
    from radixserve.cache.tiers import HostTier
    from radixserve.cache.transfer import PageCopier

    clock = FakeClock()
    pool, host = PagePool(8, 1), PagePool(8, 1)
    tree = RadixTree(pool, clock=clock, host=HostTier(host, PageCopier(pool, host)))
    a = cache(pool, tree, [1, 2], retention=Retention(80, duration_s=100.0))
    tree.evict(1)
    assert tree.match([1, 2], update=False).pages == a[:1] and tree.host_only_pages == 1
    clock.now = 1.0
    c = cache(pool, tree, [7])
    tree.end_retention([1, 2], None, 80)
    tree.evict(1)
    assert pool.refcount(a[0]) == 0 and pool.refcount(c[0]) == 1
    ok(pool, tree)


def test_a_namespace_emptied_while_a_request_holds_its_root_is_forgotten_at_unlock():
    """A request of a namespace that matched nothing holds its root; eviction empties the
    namespace meanwhile. Once the request lets go, the root goes (it stayed until a flush:
    one node for every tenant or cache salt ever seen)."""
    pool, tree, _ = make(1, num_pages=4)
    for i in range(50):
        namespace = ("tenant", i)
        cache(pool, tree, [5], namespace)
        held = tree.match([9], namespace)
        tree.lock(held.node)
        tree.evict(1)
        tree.unlock(held.node)
    assert tree.cached_pages == 0 and not tree._forest._roots
    ok(pool, tree)


def test_a_partial_match_passes_over_a_sibling_on_the_host_only():
    """Pages [36, 1] on the host only and [36, 19] on the device: a query [36, 7] shares one
    token with both; the device page is copied from (the host-only neighbour in sorted order
    hid it: nothing was reused)."""
    from radixserve.cache.tiers import HostTier
    from radixserve.cache.transfer import PageCopier

    pool, host = PagePool(8, 2), PagePool(8, 2)
    tree = RadixTree(pool, host=HostTier(host, PageCopier(pool, host)))
    cache(pool, tree, [36, 1])
    tree.evict(1)
    assert tree.host_only_pages == 1
    (device_page,) = cache(pool, tree, [36, 19])
    for query in ([36], [36, 7], [36, 0]):
        m = tree.match(query, update=False)
        assert (m.partial_page, m.partial_tokens) == (device_page, 1), query
    ok(pool, tree)
