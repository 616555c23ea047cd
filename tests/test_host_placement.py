"""The host tier's write rules at work, with exact values: under write-through-selective a
matched device page is copied to host on the match that brings its hits to
`write_through_hits`, not before, and only once; write-back never copies on a hit; a page
back on the device keeps its host copy under write-back and gives it up under exclusive.
(The slow stateful property test checks the same against a model; these run in a blink.)"""

from collections.abc import Sequence

import pytest

from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.benchmark.cli_simulate import HOST_WRITE_POLICIES
from radixserve.cache.tiers import EXCLUSIVE, WRITE_BACK, WRITE_POLICIES, WRITE_THROUGH_SELECTIVE, HostTier
from radixserve.cli import build_parser
from radixserve.cache.transfer import KVCopier, LoadHandle

PAGE_SIZE = 2
TOKENS = [1, 2, 3, 4, 5, 6]  # three pages


class RecordingCopier(KVCopier):
    """Copies nothing; records each offload as (device pages, host pages)."""

    def __init__(self) -> None:
        super().__init__()
        self.offloads: list[tuple[list[int], list[int]]] = []

    def offload(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self.offloads.append((list(device_pages), list(host_pages)))

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LoadHandle | None:
        return None


def make(write_policy: str, hits: int, host_pages: int = 8) -> tuple[RadixTree, RecordingCopier, list[int]]:
    """A tree over a host tier holding TOKENS on the device; returns it, its copier and the
    device pages of TOKENS."""
    pool = PagePool(16, PAGE_SIZE)
    copier = RecordingCopier()
    tier = HostTier(PagePool(host_pages, PAGE_SIZE), copier, write_policy=write_policy, write_through_hits=hits)
    tree = RadixTree(pool, clock=lambda: 0.0, host=tier)
    pages = pool.allocate(3)
    tree.insert(TOKENS, pages)
    pool.decref(pages)
    return tree, copier, pages


def test_every_write_policy_is_offered_by_serve_and_the_benchmarks() -> None:
    """The command lines list the policies by name (they may not import torch for --help)."""
    assert HOST_WRITE_POLICIES == list(WRITE_POLICIES)
    for policy in WRITE_POLICIES:
        assert build_parser().parse_args(["serve", "--host-tier-write-policy", policy]).host_write_policy == policy


def test_the_rule_is_hits_at_least_the_threshold_under_write_through_only() -> None:
    through = HostTier(PagePool(1, 1), RecordingCopier(), write_policy=WRITE_THROUGH_SELECTIVE, write_through_hits=2)
    back = HostTier(PagePool(1, 1), RecordingCopier(), write_policy=WRITE_BACK, write_through_hits=2)
    assert [through.writes_through(h) for h in range(5)] == [False, False, True, True, True]
    assert [back.writes_through(h) for h in range(5)] == [False] * 5


@pytest.mark.parametrize("threshold", [1, 2, 3])
def test_a_page_is_copied_on_the_match_that_brings_its_hits_to_the_threshold(threshold: int) -> None:
    tree, copier, pages = make(WRITE_THROUGH_SELECTIVE, threshold)
    for _ in range(threshold - 1):  # fewer hits than the threshold: nothing moves
        tree.match(TOKENS)
    assert copier.offloads == []
    assert (tree.host_cached_pages, tree.stats()["written_through_pages"]) == (0, 0)
    tree.match(TOKENS)  # hit number `threshold`
    assert copier.offloads == [(pages, [0, 1, 2])]
    assert (tree.host_cached_pages, tree.host_only_pages, tree.stats()["written_through_pages"]) == (3, 0, 3)
    tree.match(TOKENS)  # already on the host: not copied again
    assert len(copier.offloads) == 1 and tree.host_cached_pages == 3


def test_only_the_pages_hit_often_enough_are_copied() -> None:
    tree, copier, pages = make(WRITE_THROUGH_SELECTIVE, 2)
    tree.match(TOKENS)           # all three pages: 1 hit
    tree.match(TOKENS[:4])       # the first two: 2 hits (the edge splits there)
    assert copier.offloads == [(pages[:2], [0, 1])]
    assert (tree.host_cached_pages, tree.stats()["written_through_pages"]) == (2, 2)


def test_write_through_copies_as_far_as_host_room_goes() -> None:
    tree, copier, pages = make(WRITE_THROUGH_SELECTIVE, 1, host_pages=2)
    tree.match(TOKENS)
    assert copier.offloads == [(pages[:2], [0, 1])]
    assert (tree.host_cached_pages, tree.stats()["written_through_pages"]) == (2, 2)


def test_write_back_never_copies_on_a_hit() -> None:
    tree, copier, _ = make(WRITE_BACK, 1)
    for _ in range(4):
        tree.match(TOKENS)
    assert copier.offloads == []
    assert (tree.host_cached_pages, tree.stats()["written_through_pages"]) == (0, 0)


def push_to_host(tree: RadixTree, copier: RecordingCopier, pages: list[int]) -> None:
    """Evicts TOKENS' three pages from the device: they are copied to host pages 0-2."""
    assert tree.evict(3) == 3
    assert copier.offloads == [(pages, [0, 1, 2])]
    assert (tree.host_cached_pages, tree.host_only_pages) == (3, 3)


@pytest.mark.parametrize(("write_policy", "host_copies"), [(WRITE_BACK, 3), (EXCLUSIVE, 0)])
def test_a_page_loaded_back_keeps_its_host_copy_unless_exclusive(write_policy: str, host_copies: int) -> None:
    tree, copier, pages = make(write_policy, 2)
    push_to_host(tree, copier, pages)
    match = tree.match(TOKENS)
    assert (match.pages, len(match.host_pages)) == ([], 3)
    tree.lock(match.host_node)
    loaded = tree.load_back(match)
    tree.unlock(match.host_node)
    assert len(loaded.pages) == 3 and loaded.host_pages == []
    assert (tree.host_cached_pages, tree.host_only_pages) == (host_copies, 0)
    assert tree.host.pool.num_free == 8 - host_copies
    # The next device eviction: a kept copy makes it free, an exclusive tier copies again.
    assert tree.evict(3) == 3
    again = [(loaded.pages, [2, 1, 0])]  # the host pages freed on the load, last freed first
    expected = [(pages, [0, 1, 2])] + ([] if host_copies else again)
    assert copier.offloads == expected
    assert (tree.host_cached_pages, tree.host_only_pages) == (3, 3)


@pytest.mark.parametrize(("write_policy", "host_copies"), [(WRITE_BACK, 3), (EXCLUSIVE, 0)])
def test_a_page_recomputed_over_its_host_copy_keeps_it_unless_exclusive(write_policy: str, host_copies: int) -> None:
    tree, copier, pages = make(write_policy, 2)
    push_to_host(tree, copier, pages)
    again = tree.pool.allocate(3)  # the prefix computed again instead of loaded
    tree.insert(TOKENS, again)
    tree.pool.decref(again)
    assert tree.match(TOKENS, update=False).pages == again
    assert (tree.host_cached_pages, tree.host_only_pages) == (host_copies, 0)
    assert tree.host.pool.num_free == 8 - host_copies


class SlowLoad:
    """A load that completes when the test says so."""

    def __init__(self) -> None:
        self.finished = False

    def done(self) -> bool:
        return self.finished


class SlowCopier(RecordingCopier):
    """Records offloads; each load returns a `SlowLoad` (kept in `loads`)."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[SlowLoad] = []

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LoadHandle | None:
        self.loads.append(SlowLoad())
        return self.loads[-1]


def test_exclusive_frees_a_host_copy_only_once_its_load_is_done() -> None:
    """While a load is in flight its host pages stay held (an offload must not reuse what
    the load reads) and a second request matching the pages still finds the load to wait
    for (that match splits the loaded node: its upper part goes with it); the next device
    eviction after the load is done frees them."""
    pool = PagePool(16, PAGE_SIZE)
    copier = SlowCopier()
    tree = RadixTree(pool, clock=lambda: 0.0, host=HostTier(PagePool(8, PAGE_SIZE), copier, write_policy=EXCLUSIVE))
    pages = pool.allocate(3)
    tree.insert(TOKENS, pages)
    pool.decref(pages)
    push_to_host(tree, copier, pages)
    match = tree.match(TOKENS)
    tree.lock(match.host_node)
    loaded = tree.load_back(match)
    tree.unlock(match.host_node)
    (load,) = copier.loads
    assert loaded.loads == [load]
    assert (tree.host_cached_pages, tree.host_only_pages, tree.host.pool.num_free) == (3, 0, 5)
    assert tree.match(TOKENS[:4]).loads == [load]  # another request waits for the same load
    other = pool.allocate(2)  # a second prompt, evicted while the load is in flight
    tree.insert([9, 9, 8, 8], other)
    pool.decref(other)
    tree.lock(loaded.node)  # TOKENS' pages stay on the device
    assert tree.evict(2) == 2
    assert copier.offloads[-1][1] == [3, 4]  # host pages 0-2 are still the load's
    assert (tree.host_cached_pages, tree.host_only_pages) == (5, 2)
    load.finished = True
    assert tree.match(TOKENS).loads == []
    third = pool.allocate(1)
    tree.insert([7, 7], third)
    pool.decref(third)
    assert tree.evict(1) == 1  # the eviction after the load frees its host copy first
    assert (tree.host_cached_pages, tree.host_only_pages) == (3, 3)
    assert copier.offloads[-1][0] == third and copier.offloads[-1][1][0] in (0, 1, 2)  # the load's, now free
    tree.unlock(loaded.node)
