"""Scheduling policies: order, priority and aging, against hand-computed expectations."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Hashable

import numpy as np
import pytest

from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.engine.policy import LongestPrefixMatch, make_schedule_policy


@dataclass(eq=False)
class Waiting:
    name: str
    prompt_ids: np.ndarray
    arrival_time: float
    priority: int = 0
    namespace: Hashable = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids)


def req(name: str, tokens: list[int], arrival: float, priority: int = 0) -> Waiting:
    return Waiting(name, np.asarray(tokens, dtype=np.int32), arrival, priority)


def cached_tree(tree_class: type[RadixTree] = RadixTree) -> RadixTree:
    """A tree over 2-token pages holding tokens 1..8."""
    pool = PagePool(64, 2)
    tree = tree_class(pool)
    pages = pool.allocate(4)
    tree.insert([1, 2, 3, 4, 5, 6, 7, 8], pages)
    pool.decref(pages)
    return tree


@pytest.fixture
def tree() -> RadixTree:
    return cached_tree()


def names(items: list[Waiting]) -> list[str]:
    return [w.name for w in items]


def test_fcfs_is_arrival_order(tree: RadixTree) -> None:
    waiting = [req("b", [9, 9, 9], 2.0), req("a", [1, 2, 3], 1.0), req("c", [1, 2, 3, 4, 5], 3.0)]
    assert names(make_schedule_policy("fcfs").order(waiting, tree, now=4.0)) == ["a", "b", "c"]


def test_lpm_orders_by_cached_prefix(tree: RadixTree) -> None:
    waiting = [req("none", [9, 9, 9], 1.0), req("short", [1, 2, 3], 2.0),
               req("long", [1, 2, 3, 4, 5, 6, 0], 3.0)]
    assert names(make_schedule_policy("lpm").order(waiting, tree, now=4.0)) == ["long", "short", "none"]


def test_dfs_weight_visits_heavier_groups_first_and_keeps_groups_together(tree: RadixTree) -> None:
    waiting = [req("x1", [50, 1, 1], 1.0), req("y1", [60, 1, 1], 2.0), req("y2", [60, 2, 2], 3.0),
               req("x2", [50, 2, 2], 4.0), req("y3", [60, 3, 3], 5.0), req("z", [70, 0], 6.0)]
    order = names(make_schedule_policy("dfs-weight").order(waiting, tree, now=7.0))
    assert order[:3] == ["y1", "y2", "y3"] and set(order[3:5]) == {"x1", "x2"} and order[5] == "z"


def test_priority_then_aging(tree: RadixTree) -> None:
    policy = make_schedule_policy("lpm", max_wait_s=10.0)
    waiting = [req("cached", [1, 2, 3, 4, 5], 95.0), req("urgent", [9, 9], 96.0, priority=5),
               req("starving", [8, 8], 80.0)]
    assert names(policy.order(waiting, tree, now=100.0)) == ["starving", "urgent", "cached"]


def test_unknown_policy_is_named() -> None:
    with pytest.raises(ValueError, match="unknown schedule policy 'best'"):
        make_schedule_policy("best")


def test_dfs_weight_prefers_a_cached_subtree_to_a_heavier_uncached_one(tree: RadixTree) -> None:
    waiting = [req("y1", [60, 1, 1], 1.0), req("y2", [60, 2, 2], 2.0), req("y3", [60, 3, 3], 3.0),
               req("cached", [1, 2, 3, 4, 5, 9], 4.0)]
    assert names(make_schedule_policy("dfs-weight").order(waiting, tree, now=5.0)) == ["cached", "y1", "y2", "y3"]


class CountingTree(RadixTree):
    """A real tree that counts its lookups."""

    lookups = 0

    def match(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.lookups += 1
        return super().match(*args, **kwargs)


def test_lpm_looks_up_at_most_its_budget_and_converges_to_the_exact_order() -> None:
    tree = cached_tree(CountingTree)
    # Ten requests; the later an arrival, the longer its cached prefix (0..8 tokens).
    waiting = [req(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8][: min(i, 8)] + [99, 99], float(i)) for i in range(10)]
    exact = names(LongestPrefixMatch().order(waiting, tree, now=10.0))
    assert exact == ["r8", "r9", "r7", "r6", "r5", "r4", "r3", "r2", "r1", "r0"]
    bounded = LongestPrefixMatch(match_budget=4)
    tree.lookups = 0
    first = names(bounded.order(waiting, tree, now=10.0))
    assert tree.lookups == 4  # the four oldest were looked up; the rest count as 0 so far
    assert first == ["r3", "r2", "r1", "r0", "r4", "r5", "r6", "r7", "r8", "r9"]
    for _ in range(2):
        bounded.order(waiting, tree, now=10.0)
    assert tree.lookups == 10  # four, then four more, then the last two: the tree did not change
    assert names(bounded.order(waiting, tree, now=10.0)) == exact
    # A newcomer is looked up before any stale value is refreshed.
    newcomer = req("new", [1, 2, 3, 4, 5, 6, 7, 8, 0], 11.0)
    assert names(bounded.order([*waiting, newcomer], tree, now=12.0))[:3] == ["r8", "r9", "new"]


@pytest.mark.parametrize("name", ["lpm", "dfs-weight"])
def test_lookups_are_reused_until_the_tree_or_the_request_changes(name: str) -> None:
    """A waiting request is looked up again only after a change to the tree (insert, evict,
    reset, a match that counts as a use) or to its tokens; every order equals a fresh
    policy's, which looks everything up."""
    tree = cached_tree(CountingTree)
    pool = tree.pool
    waiting = [req("a", [1, 2, 3, 4, 0], 1.0), req("b", [9, 9, 9, 9, 9, 0], 2.0), req("c", [1, 2, 0], 3.0)]
    policy = make_schedule_policy(name)

    def order() -> list[str]:
        got = names(policy.order(waiting, tree, now=5.0))
        assert got == names(make_schedule_policy(name).order(waiting, tree, now=5.0))
        return got

    assert order()[0] == "a"
    tree.lookups = 0
    assert order()[0] == "a" and tree.lookups == 3  # the fresh policy's three only
    pages = pool.allocate(3)
    tree.insert([9, 9, 9, 9, 9, 9], pages)  # b's prompt is now the longest cached
    pool.decref(pages)
    tree.lookups = 0
    assert order()[0] == "b" and tree.lookups == 6
    waiting[2].prompt_ids = np.asarray([1, 2, 3, 4, 5, 6, 7, 8, 0], dtype=np.int32)  # c grew (output)
    tree.lookups = 0
    assert order()[0] == "c" and tree.lookups == 1 + 3
    assert tree.evict(8) > 0  # everything
    tree.lookups = 0
    order()
    assert tree.lookups == 6
    tree.match([1, 2], update=True)  # a use: it could have split an edge or copied to the host
    tree.lookups = 0
    order()
    assert tree.lookups == 6


@pytest.mark.parametrize("write_policy", ["write-back", "write-through-selective", "exclusive"])
def test_reused_lookups_equal_fresh_ones_through_every_change_to_two_tiers(write_policy: str) -> None:
    """Random inserts, evictions (to a small host tier, which evicts in turn), uses, loads
    back and resets: after each, every waiting request's reused length equals a fresh lookup."""
    from radixserve.cache.tiers import HostTier
    from radixserve.engine.policy import _cached_len
    from tests.test_host_placement import RecordingCopier

    rng = random.Random(7)
    pool = PagePool(12, 2)
    tier = HostTier(PagePool(6, 2), RecordingCopier(), write_policy=write_policy, write_through_hits=2)
    tree = RadixTree(pool, clock=lambda: 0.0, host=tier)

    def prompt(length: int) -> list[int]:
        return [rng.choice((1, 2)) for _ in range(length)]

    waiting = [req(f"w{i}", prompt(rng.randrange(2, 12)) + [0], float(i)) for i in range(8)]
    policy = make_schedule_policy("lpm")
    for step in range(400):
        action = rng.random()
        if action < 0.35:
            tokens = prompt(rng.randrange(2, 12))
            needed = len(tokens) // 2
            if pool.num_free < needed:
                tree.evict(needed - pool.num_free)
            if pool.num_free >= needed:
                pages = pool.allocate(needed)
                tree.insert(tokens, pages)
                pool.decref(pages)
        elif action < 0.6:
            tree.evict(rng.randrange(1, 5))
        elif action < 0.9:
            match = tree.match(prompt(rng.randrange(2, 12)), update=True)
            if match.host_node is not None and pool.num_free >= len(match.host_pages):
                tree.lock(match.host_node)
                tree.unlock(tree.load_back(match).node)
        elif action < 0.97:
            grown = rng.choice(waiting)  # preempted with output: its tokens grew
            grown.prompt_ids = np.append(grown.prompt_ids[:-1], [rng.choice((1, 2)), 0]).astype(np.int32)
        else:
            tree.reset()
        policy.order(waiting, tree, now=10.0)
        for w in waiting:
            assert policy.cached_lengths.get(w, tree) == _cached_len(w, tree), (step, w.name)
    assert policy.cached_lengths.lookups < 400 * len(waiting)  # some were reused
