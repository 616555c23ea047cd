"""The host tier's write rules at work, with exact values: under write-through-selective a
matched device page is copied to host on the match that brings its hits to
`write_through_hits`, not before, and only once; write-back never copies on a hit; a page
back on the device keeps its host copy under write-back and gives it up under exclusive.
(The slow stateful property test checks the same against a model; these run in a blink.)"""

from collections.abc import Sequence

import pytest

from radixserve.cache.invariants import check_invariants
from radixserve.cache.node import MatchResult
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree, Retention
from radixserve.benchmark.cli_simulate import HOST_WRITE_POLICIES
from radixserve.cache.tiers import EXCLUSIVE, WRITE_BACK, WRITE_POLICIES, WRITE_THROUGH_SELECTIVE, HostTier
from radixserve.cli import build_parser
from radixserve.cache.transfer import KVCopier, LoadHandle

PAGE_SIZE = 2
TOKENS = [1, 2, 3, 4, 5, 6]  # three pages
OTHER = [9, 9, 8, 8, 7, 7]  # three more, another prompt


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


def test_write_through_takes_free_host_pages_only() -> None:
    """A copy of a page the device still holds is worth less than a page cached on the host
    alone: with the host full of those, write-through copies nothing (it evicted them)."""
    tree, copier, pages = make(WRITE_THROUGH_SELECTIVE, 1, host_pages=3)
    other = tree.pool.allocate(3)
    tree.insert(OTHER, other)
    tree.pool.decref(other)
    tree.lock(tree.match(TOKENS, update=False).node)
    assert tree.evict(3) == 3  # OTHER goes to host: the host is full
    assert copier.offloads == [(other, [0, 1, 2])]
    tree.match(TOKENS)
    assert len(copier.offloads) == 1  # TOKENS' pages hit: nothing copied
    assert (tree.host_cached_pages, tree.host_only_pages) == (3, 3)
    assert tree.stats()["host_evicted_pages"] == 0 and tree.match(OTHER, update=False).cached_tokens == 6


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


def loading_back(write_policy: str, host_pages: int) -> tuple[RadixTree, SlowCopier, MatchResult, MatchResult]:
    """TOKENS pushed to host, matched, locked and loaded back by a copier whose load is in
    flight until the test finishes it: the tree, its copier, the match and the loaded match."""
    pool = PagePool(16, PAGE_SIZE)
    copier = SlowCopier()
    tree = RadixTree(pool, clock=lambda: 0.0, host=HostTier(PagePool(host_pages, PAGE_SIZE), copier,
                                                            write_policy=write_policy))
    pages = pool.allocate(3)
    tree.insert(TOKENS, pages)
    pool.decref(pages)
    push_to_host(tree, copier, pages)
    match = tree.match(TOKENS)
    tree.lock(match.host_node)
    return tree, copier, match, tree.load_back(match)


def test_exclusive_frees_a_host_copy_only_once_its_load_is_done() -> None:
    """While a load is in flight its host pages stay held (an offload must not reuse what
    the load reads) and a second request matching the pages still finds the load to wait
    for (that match splits the loaded node: its upper part goes with it); the next device
    eviction after the load is done frees them."""
    tree, copier, match, loaded = loading_back(EXCLUSIVE, host_pages=8)
    pool = tree.pool
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


@pytest.mark.parametrize("write_policy", [WRITE_BACK, WRITE_THROUGH_SELECTIVE])
def test_host_copies_of_device_pages_give_way_to_pages_leaving_the_device(write_policy: str) -> None:
    """The host holds only copies of pages still on the device (TOKENS', loaded back): the
    device evicts OTHER, which has no copy. Those copies are freed for it (nothing is lost:
    TOKENS stays on the device) instead of OTHER being dropped."""
    tree, copier, pages = make(write_policy, 9, host_pages=3)
    push_to_host(tree, copier, pages)
    match = tree.match(TOKENS)
    tree.lock(match.host_node)
    loaded = tree.load_back(match)
    assert (tree.host_cached_pages, tree.host_only_pages, tree.host.pool.num_free) == (3, 0, 0)
    other = tree.pool.allocate(3)
    tree.insert(OTHER, other)
    tree.pool.decref(other)
    assert tree.evict(3) == 3  # TOKENS is locked: OTHER leaves the device
    assert copier.offloads[-1] == (other, [2, 1, 0])  # into the copies' pages, last freed first
    stats = tree.stats()
    assert (stats["dropped_pages"], stats["host_copies_freed_pages"], stats["host_evicted_pages"]) == (0, 3, 0)
    assert (tree.host_cached_pages, tree.host_only_pages) == (3, 3)
    assert tree.match(OTHER, update=False).cached_tokens == 6
    assert tree.match(TOKENS, update=False).pages == loaded.pages  # still on the device
    tree.unlock(match.host_node)
    check_invariants(tree.pool, tree, [])


def test_only_the_copies_the_room_needs_are_freed_the_most_recently_used_first() -> None:
    """Write-back, a host of 6 pages holding only copies: of SECOND (loaded back first) and of
    TOKENS (loaded back after it). OTHER leaving the device needs 3 pages: TOKENS's copy goes
    (the more recently used, which the device keeps longer), SECOND's stays, so when SECOND
    leaves the device later it needs no copy. Freeing every copy had copied SECOND again."""
    second = [11, 12, 13, 14, 15, 16]
    tree, copier, pages = make(WRITE_BACK, 9, host_pages=6)
    pool = tree.pool
    second_pages = pool.allocate(3)
    tree.insert(second, second_pages)
    pool.decref(second_pages)
    assert tree.evict(6) == 6 and tree.host_only_pages == 6
    locked = []
    for tokens in (second, TOKENS):  # loaded back in this order: TOKENS is the more recent
        match = tree.match(tokens)
        tree.lock(match.host_node)
        loaded = tree.load_back(match)
        tree.lock(loaded.node)
        tree.unlock(match.host_node)
        locked.append(loaded.node)
    tokens_host = list(tree.match(TOKENS, update=False).node.host)
    assert (tree.host_cached_pages, tree.host_only_pages, tree.host.pool.num_free) == (6, 0, 0)
    other = pool.allocate(3)
    tree.insert(OTHER, other)
    pool.decref(other)
    offloads = len(copier.offloads)
    assert tree.evict(3) == 3  # TOKENS and SECOND are locked: OTHER leaves the device
    assert copier.offloads[offloads:] == [(other, sorted(tokens_host, reverse=True))]
    assert tree.match(TOKENS, update=False).node.host is None
    assert tree.match(second, update=False).node.host is not None
    stats = tree.stats()
    assert (stats["dropped_pages"], stats["host_copies_freed_pages"], stats["host_evicted_pages"]) == (0, 3, 0)
    tree.unlock(locked[0])  # SECOND leaves the device over its kept copy: nothing is copied
    assert tree.evict(3) == 3
    assert len(copier.offloads) == offloads + 1
    assert (tree.host_cached_pages, tree.host_only_pages) == (6, 6)
    assert tree.match(second, update=False).host_tokens == 6
    tree.unlock(locked[1])
    check_invariants(pool, tree, [])


def test_a_host_copy_a_load_still_reads_is_not_freed_for_room() -> None:
    """Write-back with the load of TOKENS in flight (a CUDA side stream's): its host pages
    are what the copy reads, so OTHER leaving the device finds no room and is dropped; once
    the load is done the copies give way."""
    tree, copier, match, _ = loading_back(WRITE_BACK, host_pages=3)
    pool = tree.pool
    for round_ in range(2):
        other = pool.allocate(3)
        tree.insert(OTHER, other)
        pool.decref(other)
        assert tree.evict(3) == 3
        stats = tree.stats()
        if round_ == 0:
            assert (stats["dropped_pages"], stats["host_copies_freed_pages"]) == (3, 0)
            copier.loads[0].finished = True
        else:
            assert (stats["dropped_pages"], stats["host_copies_freed_pages"]) == (3, 3)
            assert tree.match(OTHER, update=False).cached_tokens == 6
    tree.unlock(match.host_node)
    check_invariants(pool, tree, [])


def test_host_pages_dropped_below_a_page_under_the_offload_floor_are_counted_as_host_evicted() -> None:
    """A device page below the offload floor is dropped with everything below it: the host
    pages of its host-only descendants leave the cache too, and are counted."""
    pool = PagePool(16, PAGE_SIZE)
    tree = RadixTree(pool, clock=lambda: 0.0, host=HostTier(PagePool(8, PAGE_SIZE), RecordingCopier()))
    pages = pool.allocate(3)  # the first page at 10 (below the floor, 35), the next two raised to 50
    tree.insert(TOKENS, pages, None, Retention(priority=10), [(2, 6, Retention(priority=50))])
    pool.decref(pages)
    assert tree.evict(2) == 2  # the two raised pages go to host
    assert (tree.host_only_pages, tree.stats()["host_evicted_pages"]) == (2, 0)
    assert tree.evict(1) == 1  # the first page: dropped, and its two host-only children with it
    stats = tree.stats()
    assert (stats["dropped_pages"], stats["host_evicted_pages"], tree.host_cached_pages) == (1, 2, 0)
    check_invariants(pool, tree, [])
