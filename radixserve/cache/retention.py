"""Retention priorities: how long a cached page should be kept (TensorRT-LLM's 0..100 scale).

A page carries two levels: the retention in force (`priority` until `expiry`) and its `floor`,
the highest retention without a duration it was ever given, which it falls back to when a
temporary one expires. So a temporary boost over a permanent 50 decays to 50, not to the
default 35. `PageRetention` keeps those three arrays for the pages of one tree node, and a
fourth: `boosted`, set on pages the cache itself found worth keeping longer (a prefix seen
again). A boost is not a priority: it never outranks an explicit one; the adaptive eviction
policy (adaptive.py) counts it as a learned lead in recency, which ages out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

DEFAULT_PRIORITY = 35
NEVER = math.inf  # expiry time of a priority that does not decay


@dataclass(frozen=True)
class Retention:
    """How long cached KV should be kept: higher priority is evicted later.

    After `duration_s` seconds (from when it was set) the priority decays to the page's floor
    (DEFAULT_PRIORITY unless a permanent retention raised it); None keeps it for good.
    `boost` marks the pages as re-seen (set by the cache's own reuse rule, never by clients):
    the adaptive eviction policy gives them a lead in recency; other policies ignore it.
    """

    priority: int = DEFAULT_PRIORITY
    duration_s: float | None = None
    boost: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.priority <= 100:
            raise ValueError(f"priority: must be in 0..100, got {self.priority}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0 or None, got {self.duration_s}")

    @property
    def is_default(self) -> bool:
        """True when this retention changes nothing on a default page."""
        return self.priority == DEFAULT_PRIORITY and self.duration_s is None and not self.boost

    def expiry(self, now: float) -> float:
        """The clock time at which this retention, set at `now`, decays."""
        return NEVER if self.duration_s is None else now + self.duration_s


class PageRetention:
    """Per-page retention of a run of pages (one tree node's edge), as four arrays."""

    __slots__ = ("priority", "expiry", "floor", "boosted")

    def __init__(self, priority: np.ndarray, expiry: np.ndarray, floor: np.ndarray,
                 boosted: np.ndarray | None = None) -> None:
        self.priority = priority  # int16: the priority in force until `expiry`
        self.expiry = expiry      # float64 clock time; NEVER: no decay
        self.floor = floor        # int16: what the priority falls back to after expiry
        # bool: re-seen pages (`Retention.boost`), for the adaptive eviction policy
        self.boosted = np.zeros(len(priority), dtype=bool) if boosted is None else boosted

    @classmethod
    def default(cls, num_pages: int) -> PageRetention:
        """Every page at DEFAULT_PRIORITY for good."""
        return cls(np.full(num_pages, DEFAULT_PRIORITY, dtype=np.int16), np.full(num_pages, NEVER),
                   np.full(num_pages, DEFAULT_PRIORITY, dtype=np.int16))

    @classmethod
    def of(cls, num_pages: int, retention: Retention, now: float) -> PageRetention:
        """Every page at `retention`, set at `now`."""
        permanent = retention.priority if retention.duration_s is None else DEFAULT_PRIORITY
        return cls(np.full(num_pages, retention.priority, dtype=np.int16),
                   np.full(num_pages, retention.expiry(now)), np.full(num_pages, permanent, dtype=np.int16),
                   np.full(num_pages, retention.boost, dtype=bool))

    @classmethod
    def ensure(cls, current: PageRetention | None, num_pages: int) -> PageRetention:
        """`current`, or default retention for `num_pages` pages where there is none yet."""
        return cls.default(num_pages) if current is None else current

    def __len__(self) -> int:
        return len(self.priority)

    def split(self, num_pages: int) -> tuple[PageRetention, PageRetention]:
        """The first `num_pages` pages' retention and the rest's, as independent copies."""
        k = num_pages
        return (PageRetention(self.priority[:k].copy(), self.expiry[:k].copy(), self.floor[:k].copy(),
                              self.boosted[:k].copy()),
                PageRetention(self.priority[k:].copy(), self.expiry[k:].copy(), self.floor[k:].copy(),
                              self.boosted[k:].copy()))

    def truncate(self, num_pages: int) -> None:
        """Keeps the first `num_pages` pages (the tail was evicted)."""
        k = num_pages
        self.priority, self.expiry, self.floor = self.priority[:k], self.expiry[:k], self.floor[:k]
        self.boosted = self.boosted[:k]

    def effective(self, now: float) -> np.ndarray:
        """Per-page priority in force at `now`: an expired one reads as the page's floor."""
        return np.where(self.expiry > now, self.priority, self.floor)

    def tail_priority(self, now: float) -> int:
        """The effective priority of the last page (the one eviction takes first)."""
        return int(self.priority[-1] if self.expiry[-1] > now else self.floor[-1])

    @property
    def tail_boosted(self) -> bool:
        """Whether the last page (the one eviction takes first) is boosted."""
        return bool(self.boosted[-1])

    def raise_to(self, new: Retention, now: float, lo: int = 0, hi: int | None = None) -> bool:
        """Gives pages `lo:hi` `max(effective retention, new)`; returns whether any changed.

        Retentions compare by priority, then by later expiry; a retention without a duration
        also raises the floor; one with `boost` marks the pages boosted.
        """
        priority, expiry, floor = self.priority[lo:hi], self.expiry[lo:hi], self.floor[lo:hi]
        expired = expiry <= now
        priority[expired] = floor[expired]
        expiry[expired] = NEVER
        new_expiry = new.expiry(now)
        changed = False
        if new.boost:
            boosted = self.boosted[lo:hi]
            changed = not bool(boosted.all())
            boosted[:] = True
        if new.duration_s is None:
            raised = floor < new.priority
            floor[raised] = new.priority
            changed |= bool(raised.any())
        wins = (new.priority > priority) | ((new.priority == priority) & (new_expiry > expiry))
        if wins.any():
            priority[wins] = new.priority
            expiry[wins] = new_expiry
            changed = True
        return changed

    def end_temporary(self, priority: int, now: float, num_pages: int, first: int = 0) -> None:
        """Ends early, on pages `first:num_pages`, a temporary retention at `priority`: they
        fall back to their floor. Other levels are left as they are."""
        span = slice(first, max(first, num_pages))
        current, expiry, floor = self.priority[span], self.expiry[span], self.floor[span]
        ending = (expiry > now) & (expiry < NEVER) & (current == priority)
        current[ending] = floor[ending]
        expiry[ending] = NEVER

    def pending_expiries(self, now: float) -> list[float]:
        """The distinct future times at which some page's temporary retention decays."""
        pending = self.expiry[(self.expiry > now) & (self.expiry < NEVER)]
        return np.unique(pending).tolist()


PageRange = tuple[int, int, Retention]  # (first page, end page, retention)


def page_ranges(token_ranges: Iterable[tuple[int, int, Retention]], page_size: int) -> list[PageRange]:
    """Token ranges `[start, end)` as the ranges of pages they overlap (empty ones left out)."""
    return [(start // page_size, -(-end // page_size), r) for start, end, r in token_ranges if end > start]


def raise_retention(current: PageRetention | None, num_pages: int, first_page: int, retention: Retention | None,
                    ranges: list[PageRange], now: float) -> tuple[PageRetention | None, bool]:
    """A node's page retention after an insert raised it (`first_page`: index of the node's
    first page in the inserted sequence), and whether any page changed. A node left at the
    default keeps no arrays (`current` None) until something raises it."""
    changed = False
    if retention is not None and (current is not None or not retention.is_default):
        current = PageRetention.ensure(current, num_pages)
        changed = current.raise_to(retention, now)
    for start, end, r in ranges:
        lo, hi = max(start - first_page, 0), min(end - first_page, num_pages)
        if lo < hi:
            current = PageRetention.ensure(current, num_pages)
            changed |= current.raise_to(r, now, lo, hi)
    return current, changed
