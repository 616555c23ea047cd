"""The sliced tree copy's `engine_ms` (a view's `took_ms`) is the engine-thread time of all its
pieces together, not of its last piece only: timed here with a clock that moves one second per
reading, so every piece counts exactly and no wall clock is involved."""

from __future__ import annotations

import itertools
import time
import types
from typing import Any

import pytest

from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.engine import tree_copy
from radixserve.engine.tree_copy import copy_tree, restrict

P = 4


def test_engine_ms_adds_up_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = PagePool(512, P)
    tree = RadixTree(pool, clock=lambda: 100.0)
    for i in range(300):  # 300 nodes below the root: several pieces of NODES_PER_PIECE
        pages = pool.allocate(1)
        tree.insert([i, 1, 2, 3], pages, "a" if i % 2 else "b")
        pool.decref(pages)
    ticks = itertools.count()
    fake_time: Any = types.SimpleNamespace(perf_counter=lambda: float(next(ticks)), monotonic=time.monotonic)
    monkeypatch.setattr(tree_copy, "time", fake_time)  # each reading one second after the last

    work, pieces = copy_tree(tree, nodes_per_piece=64), 0
    while True:
        pieces += 1
        try:
            next(work)
        except StopIteration as stop:
            copy = stop.value
            break
    assert len(copy.nodes) == 300 + 2 and pieces == 5  # 2 namespace roots; ceil(302 / 64) pieces
    # One second per piece (a reading at its start and one at its end), all of them counted:
    # the last piece's alone was 1000.
    assert copy.engine_ms == pieces * 1000.0
    # A tenant's copy carries the copy's time.
    tenant = tree_copy.run_to_end(restrict(copy, lambda namespace: namespace == "a"))
    assert tenant.engine_ms == copy.engine_ms
