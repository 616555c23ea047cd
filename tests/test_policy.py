"""Scheduling policies: order, priority and aging, against hand-computed expectations."""

from __future__ import annotations

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
    assert tree.lookups == 12
    assert names(bounded.order(waiting, tree, now=10.0)) == exact
    # A newcomer is looked up before any stale value is refreshed.
    newcomer = req("new", [1, 2, 3, 4, 5, 6, 7, 8, 0], 11.0)
    assert names(bounded.order([*waiting, newcomer], tree, now=12.0))[:3] == ["r8", "r9", "new"]
