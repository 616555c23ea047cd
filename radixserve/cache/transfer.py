"""Copies of KV pages between the device pool and the host pool: the host tier's data path.

The tree decides which pages move (tiers.py holds the rules); a `KVCopier` moves their
contents. Both pools have the same page shape, so a page is copied layer by layer, K and V,
with runs of consecutive pages on both sides merged into one slice copy each.

Ordering on CUDA (what makes the copies safe without synchronising the host):
- offload (device -> pinned host) runs on the compute stream, non-blocking: it reads a page
  after every kernel that wrote it and before any later kernel that reuses the page, so the
  tree may free the device page right after asking for the copy;
- load (pinned host -> device) runs on a side stream that first waits for the compute
  stream (earlier offloads into the same host pages, earlier readers of the fresh device
  pages), so it overlaps the steps that follow; it returns a `LoadHandle`, and the scheduler
  runs no sequence over the loaded pages until the handle is done;
- `fence(handle)`: when pages of an unfinished load are freed (an aborted request), the
  compute stream waits for the load before any later kernel, so nothing reuses them early.
On the CPU every copy is a plain synchronous copy and `load` returns None (done).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import torch

from radixserve.cache.pool import PagePool


class LoadHandle(Protocol):
    """A load still in flight: done() turns True once its pages hold the host data."""

    def done(self) -> bool:
        """Whether the copy has completed."""


class KVCopier(ABC):
    """Moves page contents between the device pool and the host pool; counts what it moved.

    `offload_seconds` / `load_seconds` are host wall time spent issuing (on the CPU: doing)
    the copies.
    """

    def __init__(self) -> None:
        self.offload_seconds = 0.0
        self.load_seconds = 0.0

    @abstractmethod
    def offload(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """Copies device page `device_pages[i]` into host page `host_pages[i]`; the device
        pages may be freed right after the call."""

    @abstractmethod
    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LoadHandle | None:
        """Copies host page `host_pages[i]` into device page `device_pages[i]`; returns None
        when the copy is complete, else a handle to wait on."""

    def fence(self, handle: LoadHandle) -> None:
        """Orders every later use of the pages of the unfinished load `handle` after it."""


def page_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source page, first destination page, length) of the maximal runs in which
    both `src[i]` and `dst[i]` go up by one."""
    runs: list[list[int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [(s, d, n) for s, d, n in runs]


class _CudaLoad:
    """A load on the side stream, done when its event has completed."""

    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def done(self) -> bool:
        return self.event.query()


class PageCopier(KVCopier):
    """Copies between the tensors of two pools (pools without tensors: copies are no-ops).

    On CUDA the host pool should be pinned (`PagePool(pin_memory=True)`), or the non-blocking
    copies fall back to synchronous ones.
    """

    def __init__(self, device_pool: PagePool, host_pool: PagePool) -> None:
        super().__init__()
        if device_pool.page_size != host_pool.page_size:
            raise ValueError(f"page_size: host pool {host_pool.page_size} != device pool {device_pool.page_size}")
        if len(device_pool.k_cache) != len(host_pool.k_cache):
            raise ValueError("host pool: must have the device pool's layers (or neither has tensors)")
        for dev, host in zip(device_pool.k_cache[:1], host_pool.k_cache[:1]):
            if dev.shape[1:] != host.shape[1:] or dev.dtype != host.dtype:
                raise ValueError(f"host pool: page shape {tuple(host.shape[1:])} {host.dtype} differs from the "
                                 f"device pool's {tuple(dev.shape[1:])} {dev.dtype}")
        self.device_pool = device_pool
        self.host_pool = host_pool
        device = device_pool.k_cache[0].device if device_pool.k_cache else torch.device("cpu")
        self._cuda = device if device.type == "cuda" else None
        self._side = torch.cuda.Stream(device) if self._cuda is not None else None

    def _layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        dev, host = self.device_pool, self.host_pool
        return list(zip(dev.k_cache, host.k_cache)) + list(zip(dev.v_cache, host.v_cache))

    def offload(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        start = time.perf_counter()
        runs = page_runs(device_pages, host_pages)
        asynchronous = self._cuda is not None
        for dev, host in self._layers():
            for d, h, n in runs:
                host[h:h + n].copy_(dev[d:d + n], non_blocking=asynchronous)
        self.offload_seconds += time.perf_counter() - start

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LoadHandle | None:
        start = time.perf_counter()
        runs = page_runs(host_pages, device_pages)
        layers = self._layers()
        handle: LoadHandle | None = None
        if self._side is None or not layers:
            for dev, host in layers:
                for h, d, n in runs:
                    dev[d:d + n].copy_(host[h:h + n])
        else:
            self._side.wait_stream(torch.cuda.current_stream(self._cuda))
            with torch.cuda.stream(self._side):
                for dev, host in layers:
                    for h, d, n in runs:
                        dev[d:d + n].copy_(host[h:h + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._side)
            handle = _CudaLoad(event)
        self.load_seconds += time.perf_counter() - start
        return handle

    def fence(self, handle: LoadHandle) -> None:
        if isinstance(handle, _CudaLoad) and self._cuda is not None:
            torch.cuda.current_stream(self._cuda).wait_event(handle.event)
