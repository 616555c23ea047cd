"""Reuse history: which page prefixes were seen recently, remembered beyond eviction.

A tree-local hit counter forgets a page when it is evicted, so a document that is reused
only after its first copy was evicted looks new again. This history (a ghost list, as in
2Q/ARC, per page prefix) keeps 64-bit hashes of recently seen page prefixes — metadata only,
about 16 bytes per page — so the second arrival is recognised and can be retained longer (its effect on hit rates: docs/benchmark.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Hashable

import numpy as np

from radixserve.cache.page_hash import MASK64, page_hashes
from radixserve.cache.retention import Retention

REUSED_RETENTION = Retention(60)  # pages seen before outrank first-seen ones (default 35)


class ReuseHistory:
    """Counts how many leading pages of a prompt were seen within the last `window_pages`
    page observations, then records the prompt's pages as seen now.

    Namespaces are kept apart (the namespace seeds the hashes), so one tenant's prompts
    never change how another's pages are retained. The pages seen get `retention`.
    """

    retention = REUSED_RETENTION

    def __init__(self, page_size: int, window_pages: int) -> None:
        self.page_size = page_size
        self.window_pages = window_pages
        self._last_seen: dict[int, int] = {}
        self._clock = 0

    def observe(self, tokens: np.ndarray, namespace: Hashable = None) -> int:
        """Returns the number of leading pages seen recently; records all of them.

        A prompt's pages share one time stamp, so the seen pages always form a prefix.
        """
        return self.observe_hashes(self.hashes(tokens, namespace))

    def hashes(self, tokens: np.ndarray, namespace: Hashable = None) -> list[int]:
        """The prefix hash of each full page of `tokens` in `namespace`."""
        seed = hash(namespace) & MASK64 if namespace is not None else 0
        return page_hashes(tokens, self.page_size, seed)[0].tolist()

    def observe_hashes(self, hashes: list[int]) -> int:
        """`observe` for a prompt's page hashes (`hashes`)."""
        seen = 0
        for h in hashes:
            last = self._last_seen.get(h)
            if last is None or self._clock - last >= self.window_pages:
                break
            seen += 1
        self._clock += len(hashes)
        for h in hashes:
            self._last_seen[h] = self._clock
        if len(self._last_seen) > 4 * self.window_pages + 1024:  # forget what left the window
            self._last_seen = {h: t for h, t in self._last_seen.items() if self._clock - t < self.window_pages}
        return seen

    def __len__(self) -> int:
        """Hashes remembered (at most about 4 windows' worth)."""
        return len(self._last_seen)


class ClusterHistory(ReuseHistory):
    """The reuse history of a cluster's whole traffic, kept by whatever sees every request
    (the cluster simulation's router, a cluster's ingress), over hashes it is given (page
    size unused). It also remembers which replica took each page last, so that a request
    for a prefix its last replica (its *home*) no longer holds, sent elsewhere, can be told
    to that replica (adaptive.py: `AdaptiveReuse.elsewhere`)."""

    def __init__(self, window_pages: int) -> None:
        super().__init__(1, window_pages)
        self._taker: dict[int, str] = {}

    def home(self, hashes: list[int], seen: int) -> str | None:
        """The replica that took the last of a prompt's `seen` leading pages (seen within
        the window; None: none seen, or taken before this history began)."""
        return self._taker.get(hashes[seen - 1]) if seen else None

    def took(self, hashes: list[int], seen: int, replica: str, held: Callable[[str], int]) -> str | None:
        """`replica` takes the prompt with these page hashes (`seen`: their count from
        `observe_hashes`); returns the replica to tell that it went elsewhere: its home,
        when that is another replica and `held(home)`, the leading pages the home still
        holds, falls short of the `seen` ones (None: nobody to tell)."""
        home = self.home(hashes, seen)
        for h in hashes:
            self._taker[h] = replica
        if len(self._taker) > 2 * len(self._last_seen) + 1024:  # forget what the history forgot
            self._taker = {h: r for h, r in self._taker.items() if h in self._last_seen}
        if home is None or home == replica or held(home) >= seen:
            return None
        return home
