"""Retention priorities and the order in which cached pages are evicted.

A cached page carries a retention priority (0..100, TensorRT-LLM's scale, default 35) that may
expire: after `duration_s` it decays back to the default. Eviction takes pages from the tail of
unlocked leaves; an `EvictionPolicy` turns a leaf's tail-page priority and its recency into a
sort key, smallest evicted first.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

DEFAULT_PRIORITY = 35
NEVER = math.inf  # expiry time of a priority that does not decay

EvictionKey = tuple[int, ...]


@dataclass(frozen=True)
class Retention:
    """How long cached KV should be kept: higher priority is evicted later.

    After `duration_s` seconds (from when it was set) the priority decays to DEFAULT_PRIORITY;
    None keeps it for good.
    """

    priority: int = DEFAULT_PRIORITY
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.priority <= 100:
            raise ValueError(f"priority: must be in 0..100, got {self.priority}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration_s: must be > 0 or None, got {self.duration_s}")

    @property
    def is_default(self) -> bool:
        """True when this retention changes nothing on a default page."""
        return self.priority == DEFAULT_PRIORITY and self.duration_s is None

    def expiry(self, now: float) -> float:
        """The clock time at which this retention, set at `now`, decays."""
        return NEVER if self.duration_s is None else now + self.duration_s


def effective_priorities(priority: np.ndarray, expiry: np.ndarray, floor: np.ndarray,
                         now: float) -> np.ndarray:
    """Per-page priority in force at `now`: an expired one reads as the page's floor."""
    return np.where(expiry > now, priority, floor)


def raise_retention(priority: np.ndarray, expiry: np.ndarray, floor: np.ndarray, new: Retention,
                    now: float) -> bool:
    """Gives each page `max(effective retention, new)`, in place; returns whether any changed.

    A page keeps two levels: the retention in force (`priority` until `expiry`) and its
    `floor`, the highest retention without a duration it was given, which it falls back to
    when a temporary one expires. So a temporary boost over a permanent 50 decays to 50, not
    to the default. Retentions compare by priority, then by later expiry.
    """
    expired = expiry <= now
    priority[expired] = floor[expired]
    expiry[expired] = NEVER
    new_expiry = new.expiry(now)
    changed = False
    if new.duration_s is None:
        raised = floor < new.priority
        floor[raised] = new.priority
        changed = bool(raised.any())
    wins = (new.priority > priority) | ((new.priority == priority) & (new_expiry > expiry))
    if wins.any():
        priority[wins] = new.priority
        expiry[wins] = new_expiry
        changed = True
    return changed


class EvictionPolicy(ABC):
    """Orders unlocked leaves for eviction; the smallest key is evicted first.

    `tick` is the tree's recency counter for the leaf (larger = used more recently; every
    leaf has a distinct tick), `priority` the effective priority of the leaf's tail page.
    """

    name: ClassVar[str]

    @abstractmethod
    def key(self, priority: int, tick: int) -> EvictionKey:
        """Sort key of a leaf whose tail page has `priority`."""

    @abstractmethod
    def tail_run(self, priorities: np.ndarray, tick: int, bound: EvictionKey | None) -> int:
        """How many pages from the tail of a leaf (pages `priorities`, in edge order) sort
        before `bound`, the next leaf's key (None: no other leaf). At least 1: the caller has
        already chosen this leaf as the minimum."""


class PriorityPolicy(EvictionPolicy):
    """Lowest effective priority first, least recently used among equals."""

    name = "priority"

    def key(self, priority: int, tick: int) -> EvictionKey:
        return (priority, tick)

    def tail_run(self, priorities: np.ndarray, tick: int, bound: EvictionKey | None) -> int:
        if bound is None:
            return len(priorities)
        bound_priority, bound_tick = bound
        before = (priorities < bound_priority) | ((priorities == bound_priority) & (tick < bound_tick))
        from_tail = before[::-1]
        run = int(from_tail.argmin()) if not from_tail.all() else len(from_tail)
        return max(run, 1)


class LRUPolicy(EvictionPolicy):
    """Least recently used first; priorities are ignored."""

    name = "lru"

    def key(self, priority: int, tick: int) -> EvictionKey:
        return (tick,)

    def tail_run(self, priorities: np.ndarray, tick: int, bound: EvictionKey | None) -> int:
        # Every page of a leaf shares its tick, so the whole leaf goes before the next one.
        return len(priorities)


POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (PriorityPolicy, LRUPolicy)}


def make_policy(name: str) -> EvictionPolicy:
    """The eviction policy called `name` ("priority" or "lru")."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"eviction_policy: unknown {name!r}, expected one of {sorted(POLICIES)}") from None
