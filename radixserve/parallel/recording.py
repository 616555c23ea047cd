"""Rank 0's page copies, recorded for the other ranks to repeat.

The tree and the scheduler copy KV pages outside the forward pass: copy-on-write and
copy-on-partial-reuse (`PagePool.copy_page`) and the host tier's offloads and loads (its
`KVCopier`). On rank 0 they copy rank 0's heads as before and are also logged; the next plan
carries the log, and every worker repeats the copies on its own heads before its forward, so
they land in the same order relative to the forward passes as on rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from radixserve.cache.pool import PagePool
from radixserve.cache.tiers import HostTier
from radixserve.cache.transfer import KVCopier, LoadHandle
from radixserve.parallel.plan import COPY_PAGE, LOAD, OFFLOAD, KvOpLog


class RecordingCopier(KVCopier):
    """A KVCopier that copies through `inner` and logs each copy into `log`."""

    def __init__(self, inner: KVCopier, log: KvOpLog) -> None:
        self.inner = inner
        self.log = log

    @property
    def offload_seconds(self) -> float:  # type: ignore[override]
        """The inner copier's offload time."""
        return self.inner.offload_seconds

    @property
    def load_seconds(self) -> float:  # type: ignore[override]
        """The inner copier's load time."""
        return self.inner.load_seconds

    def offload(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self.inner.offload(device_pages, host_pages)
        self.log.record(OFFLOAD, device_pages, host_pages)

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LoadHandle | None:
        handle = self.inner.load(host_pages, device_pages)
        self.log.record(LOAD, host_pages, device_pages)
        return handle

    def fence(self, handle: LoadHandle) -> None:
        self.inner.fence(handle)


def record_page_copies(pool: PagePool, host_tier: HostTier | None, log: KvOpLog) -> None:
    """Makes every later page copy of `pool` and `host_tier` also go into `log`."""
    copy_page = pool.copy_page

    def recorded_copy_page(src: int, dst: int, num_slots: int | None = None) -> None:
        copy_page(src, dst, num_slots)
        log.record(COPY_PAGE, [src], [dst], pool.page_size if num_slots is None else num_slots)

    pool.copy_page = recorded_copy_page  # type: ignore[method-assign]
    if host_tier is not None:
        host_tier.copier = RecordingCopier(host_tier.copier, log)
