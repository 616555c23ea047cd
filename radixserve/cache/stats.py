"""What the prefix cache counts: lookups, hits, evictions and the age of KV when it is used.

Kept apart from the tree so the tree's code is only about its shape; the tree reports each
event here and `RadixTree.stats()` / `histograms()` read it back.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

from radixserve.cache.events import DEVICE, HOST

AGE_BUCKETS_S = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0)
REUSE_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


@dataclass
class Histogram:
    """Fixed-bucket histogram: `counts[i]` observations in (bounds[i-1], bounds[i]], the last
    one above bounds[-1] (Prometheus `le` semantics, not cumulative)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, weight: int = 1) -> None:
        """Records `value` `weight` times."""
        self.counts[bisect_left(self.bounds, value)] += weight
        self.sum += value * weight
        self.count += weight

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= bound) pairs ending with +inf, as Prometheus wants."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            out.append((bound, total))
        return out


@dataclass
class CacheStats:
    """Cumulative counters of one tree.

    A lookup is a counted `match` (tokens asked for, tokens found on the device and on the
    host only); a touched node records the age of its KV once per page; a device eviction
    records how old the pages were and how often they had been hit. With a host tier, pages
    leaving the device are offloaded (copied to host) or dropped; pages reach the host by
    write-through too, come back by load-back, and leave it by host eviction (lost) or,
    where the device holds them too, by freeing that copy for room (`host_copies_freed`).
    """

    lookups: int = 0
    lookup_tokens: int = 0
    hit_tokens: int = 0
    host_hit_tokens: int = 0
    evicted_pages: int = 0
    offloaded_pages: int = 0
    dropped_pages: int = 0
    written_through_pages: int = 0
    loaded_pages: int = 0
    host_evicted_pages: int = 0
    host_copies_freed_pages: int = 0
    hit_age: Histogram = field(default_factory=lambda: Histogram(AGE_BUCKETS_S))
    evict_age: Histogram = field(default_factory=lambda: Histogram(AGE_BUCKETS_S))
    evict_reuse: Histogram = field(default_factory=lambda: Histogram(REUSE_BUCKETS))

    def lookup(self, num_tokens: int) -> None:
        """A counted match of `num_tokens` tokens began."""
        self.lookups += 1
        self.lookup_tokens += num_tokens

    def hit(self, num_tokens: int, host_tokens: int = 0) -> None:
        """A counted match found `num_tokens` tokens on the device, then `host_tokens` more
        on the host only."""
        self.hit_tokens += num_tokens + host_tokens
        self.host_hit_tokens += host_tokens

    def used(self, age_s: float, num_pages: int) -> None:
        """A match used `num_pages` pages cached `age_s` seconds ago."""
        self.hit_age.observe(age_s, num_pages)

    def evicted(self, num_pages: int, age_s: float, hits: int) -> None:
        """`num_pages` pages cached `age_s` seconds ago, hit `hits` times, were evicted."""
        self.evicted_pages += num_pages
        self.evict_age.observe(age_s, num_pages)
        self.evict_reuse.observe(hits, num_pages)

    def offloaded(self, num_pages: int) -> None:
        """Pages leaving the device were copied to host."""
        self.offloaded_pages += num_pages

    def dropped(self, num_pages: int) -> None:
        """Pages leaving the device were not kept on host (priority below the floor, no
        host room, or under a page that was dropped)."""
        self.dropped_pages += num_pages

    def written_through(self, num_pages: int) -> None:
        """Device pages hit often enough were copied to host (write-through-selective)."""
        self.written_through_pages += num_pages

    def loaded(self, num_pages: int) -> None:
        """Host-only pages were copied back to the device."""
        self.loaded_pages += num_pages

    def host_evicted(self, num_pages: int) -> None:
        """Host-only pages were evicted from the host (and so from the cache)."""
        self.host_evicted_pages += num_pages

    def host_copies_freed(self, num_pages: int) -> None:
        """Host copies of pages the device holds too were freed for room (nothing lost)."""
        self.host_copies_freed_pages += num_pages

    def histograms(self) -> dict[str, Histogram]:
        """Age of cached KV when hit and when evicted (seconds since insertion, one
        observation per page) and how often each evicted page had been hit."""
        return {"hit_age_seconds": self.hit_age, "evict_age_seconds": self.evict_age,
                "evict_reuse": self.evict_reuse}

    def as_dict(self) -> dict[str, float]:
        """The counters, the hit rate of counted lookups, and each histogram's sum and count."""
        out: dict[str, float] = {
            "lookups": self.lookups,
            "lookup_tokens": self.lookup_tokens,
            "hit_tokens": self.hit_tokens,
            "device_hit_tokens": self.hit_tokens - self.host_hit_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            "hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            "evicted_pages": self.evicted_pages,
            "offloaded_pages": self.offloaded_pages,
            "dropped_pages": self.dropped_pages,
            "written_through_pages": self.written_through_pages,
            "loaded_pages": self.loaded_pages,
            "host_evicted_pages": self.host_evicted_pages,
            "host_copies_freed_pages": self.host_copies_freed_pages,
        }
        for name, hist in self.histograms().items():
            out[f"{name}_sum"] = hist.sum
            out[f"{name}_count"] = hist.count
        return out


class PagesFreed(int):
    """What a flush freed: the device pages, as the plain int `reset` has always returned,
    with `host` the host-tier pages freed too (0 without a host tier)."""

    host: int

    def __new__(cls, device: int, host: int = 0) -> PagesFreed:
        freed = super().__new__(cls, device)
        freed.host = host
        return freed

    def tiers(self) -> dict[str, int]:
        """Pages freed per tier, by tier name."""
        return {DEVICE: int(self), HOST: self.host}
