"""ReuseHistory: prefixes seen within the window are recognised, beyond eviction."""

from __future__ import annotations

import numpy as np

from radixserve.cache.reuse import ReuseHistory


def test_a_repeated_prefix_is_seen_page_by_page() -> None:
    history = ReuseHistory(page_size=4, window_pages=100)
    doc = np.arange(100, 120)  # 5 pages
    assert history.observe(doc) == 0
    assert history.observe(np.concatenate([doc[:12], [1, 2, 3, 4, 5]])) == 3  # shares 3 pages
    assert history.observe(doc) == 5


def test_the_window_forgets_and_namespaces_are_apart() -> None:
    history = ReuseHistory(page_size=4, window_pages=8)
    doc = np.arange(0, 16)  # 4 pages
    history.observe(doc)
    assert history.observe(doc, namespace=("m", "tenant")) == 0
    history.observe(np.arange(500, 532))  # 8 other pages push doc out of the window
    assert history.observe(doc) == 0

