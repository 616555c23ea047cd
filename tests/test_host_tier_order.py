"""The host tier's cache events in the order of the events contract (docs/server.md): a
`stored` run follows its parent page, so its `parent_hash` names a page some tier holds when
the event comes.

One device eviction that takes a path of several nodes off the device copies them to the
host parent first. (It copied and reported them leaf first, in the order they left the
device: a child's `stored` on the host named a parent whose device copy had just been
removed and whose host copy was not stored yet, and an indexer keeping a trie by parent hash,
as a KV-aware router does, orphaned the child.) Real tree, pools and event hub; the indexer
(tests/cache_indexer.py) knows only the stream and checks each event as it comes.
"""

from __future__ import annotations

import random

import pytest

from radixserve.cache.events import CacheEvent, CacheEventHub
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.cache.tiers import WRITE_POLICIES, HostTier
from radixserve.cache.transfer import PageCopier
from tests.cache_indexer import PageIndexer

P = 4


class Indexed:
    """A tree over a host tier, its events applied to an outside indexer as they come."""

    def __init__(self, device_pages: int, host_pages: int, write_policy: str) -> None:
        self.pool, host = PagePool(device_pages, P), PagePool(host_pages, P)
        hub = CacheEventHub(P)
        self.indexer = PageIndexer()
        self.errors: list[str] = []
        hub.subscribe(self.apply)  # the hub unsubscribes a failing subscriber: keep its failures
        self.tree = RadixTree(self.pool, events=hub, eviction_policy="lru",
                              host=HostTier(host, PageCopier(self.pool, host), write_policy=write_policy,
                                            write_through_hits=1))

    def apply(self, event: CacheEvent) -> None:
        try:
            self.indexer.apply(event)
        except AssertionError as exc:
            self.errors.append(str(exc))

    def cache(self, tokens: list[int]) -> None:
        """Caches the whole pages of `tokens` (evicting to make room)."""
        count = len(tokens) // P
        if count > self.pool.num_free:
            self.tree.evict(count - self.pool.num_free)
        pages = self.pool.allocate(count)
        self.tree.insert(tokens[: count * P], pages)
        self.pool.decref(pages)

    def load_back(self, tokens: list[int]) -> None:
        """A request's admission: its prefix matched on both tiers, the host part loaded back."""
        match = self.tree.match(tokens)
        if match.host_pages:
            self.tree.lock(match.host_node)
            if len(match.host_pages) > self.pool.num_free:
                self.tree.evict(len(match.host_pages) - self.pool.num_free)
            self.tree.load_back(match)
            self.tree.unlock(match.host_node)

    def check(self) -> None:
        assert self.errors == []
        for tier in ("device", "host"):
            assert self.indexer.tiers[tier] == self.tree.cached_page_hashes(tier)


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_one_eviction_of_several_paths_stores_each_on_the_host_after_its_parent(write_policy: str) -> None:
    rig = Indexed(32, 32, write_policy)
    a = list(range(100, 116))
    rig.cache(a)
    rig.cache(a[:8] + list(range(200, 208)))  # a 2-page parent with two 2-page children
    c = list(range(300, 324))
    rig.cache(c)
    rig.cache(c[:4] + list(range(400, 408)))  # three levels: 1 page; 3 pages and 2; 2 and 1
    rig.cache(c[:16] + list(range(500, 504)))
    rig.tree.evict(rig.tree.evictable_pages)  # one call takes every path off the device
    assert rig.tree.cached_pages == 0 and rig.tree.host_only_pages == 15
    rig.check()


@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
def test_random_evictions_and_loads_keep_host_events_in_path_order(write_policy: str) -> None:
    """Partial evictions (split runs), load-backs, host eviction (a host smaller than the
    device) and pages of one call competing for the host: every event names a known parent."""
    for seed in range(6):
        rng = random.Random(seed)
        rig = Indexed(rng.choice([12, 20]), rng.choice([3, 8, 40]), write_policy)
        prefixes = [[rng.randrange(3, 300) for _ in range(24)] for _ in range(3)]
        for _ in range(60):
            tokens = rng.choice(prefixes)[: rng.randrange(4, 25)] + [rng.randrange(3, 300)
                                                                      for _ in range(rng.randrange(0, 9))]
            roll = rng.random()
            if roll < 0.4:
                rig.cache(tokens[: min(len(tokens), rig.pool.num_pages * P)])
            elif roll < 0.7:
                rig.load_back(tokens)
            else:
                rig.tree.evict(rng.randrange(1, max(2, rig.tree.evictable_pages + 1)))
            assert rig.errors == [], f"seed {seed}"
        rig.check()
