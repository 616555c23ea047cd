"""The host tier: a second page pool in host memory under the radix tree, and its rules.

Each cached page lives on the device, on the host, or on both. The tree (radix.py) keeps
the placement per node and moves pages between tiers; this module says what may move:

- **write policy** — `write-back` (the default): a page is copied to host when the device
  evicts it, and keeps its host copy when loaded back (its next eviction then costs no
  copy); `write-through-selective`: a page is also copied to host, into free host pages,
  once it has been hit `write_through_hits` times, so that its later eviction costs no
  copy; `exclusive`: as
  write-back, but a page loaded back (or recomputed over its host copy) gives up its host
  copy, so each page lives on one tier and the tiers hold their combined size; every
  device eviction of a page then copies it again (docs/benchmark.md weighs the two);
- **offload floor** — a device-only page whose effective retention priority is below
  `offload_min_priority` is dropped on eviction instead of copied (TensorRT-LLM's
  `secondary_offload_min_priority`; the default priority, 35, is offloaded);
- **host room** for pages the device evicts comes from free host pages, then from the host
  copies of pages that are also on the device (all of them are freed at once: no page is
  lost, each is copied again when it leaves the device; kept, they could fill the host and
  leave no room for any page the device evicts), then from **host eviction**, which follows
  the tree's eviction policy (priority, then LRU), leaf first among host-only pages.

The copies themselves go through a `KVCopier` (transfer.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from radixserve.cache.pool import PagePool
from radixserve.cache.retention import DEFAULT_PRIORITY
from radixserve.cache.transfer import KVCopier, PageCopier

WRITE_BACK = "write-back"
WRITE_THROUGH_SELECTIVE = "write-through-selective"
EXCLUSIVE = "exclusive"
WRITE_POLICIES = (WRITE_BACK, WRITE_THROUGH_SELECTIVE, EXCLUSIVE)
DEFAULT_OFFLOAD_MIN_PRIORITY = DEFAULT_PRIORITY
DEFAULT_WRITE_THROUGH_HITS = 2


@dataclass
class HostTier:
    """The host tier handed to `RadixTree(host=...)`: its pool, copier and placement rules."""

    pool: PagePool
    copier: KVCopier
    write_policy: str = WRITE_BACK
    offload_min_priority: int = DEFAULT_OFFLOAD_MIN_PRIORITY
    write_through_hits: int = DEFAULT_WRITE_THROUGH_HITS
    bytes_per_page: int = field(default=0)  # for byte counters; 0 when the pools hold no tensors

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"host_write_policy: unknown {self.write_policy!r}, expected one of {list(WRITE_POLICIES)}")
        if not 0 <= self.offload_min_priority <= 101:
            raise ValueError(f"host_offload_min_priority: must be in 0..101, got {self.offload_min_priority}")
        if self.write_through_hits < 1:
            raise ValueError(f"write_through_hits: must be >= 1, got {self.write_through_hits}")

    @classmethod
    def over(cls, device_pool: PagePool, host_pool: PagePool, **rules: object) -> HostTier:
        """A host tier copying between the tensors of `device_pool` and `host_pool`."""
        per_page = sum(t[0].numel() * t.element_size() for t in (*host_pool.k_cache, *host_pool.v_cache))
        return cls(host_pool, PageCopier(device_pool, host_pool), bytes_per_page=per_page, **rules)

    def offloads(self, priority: int | np.ndarray) -> bool | np.ndarray:
        """Whether a device-only page at this effective priority goes to host on eviction
        (elementwise for an array of priorities)."""
        return priority >= self.offload_min_priority

    @property
    def keeps_device_copies_on_host(self) -> bool:
        """Whether a page back on the device keeps its host copy (all but `exclusive`)."""
        return self.write_policy != EXCLUSIVE

    @property
    def copies_on_hit(self) -> bool:
        """Whether matches may copy device pages to host (write-through-selective)."""
        return self.write_policy == WRITE_THROUGH_SELECTIVE

    def writes_through(self, hits: int) -> bool:
        """Whether a device-only page hit `hits` times is copied to host now."""
        return self.copies_on_hit and hits >= self.write_through_hits
