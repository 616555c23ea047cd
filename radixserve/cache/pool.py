"""The page pool: a free list and reference counts over fixed-size KV pages.

Each page holds `page_size` token slots of K and V for every layer. Tensors are laid out as
FlashInfer's "NHD": per layer `[num_pages, page_size, num_kv_heads, head_dim]`. Ownership rule:
a page's refcount equals the number of its holders (the radix tree once per cached page, and
each live sequence whose block table lists it); a page is free exactly when its refcount is 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from radixserve.cache.pinned import page_locked_zeros


def as_int64(values: Iterable[int] | np.ndarray) -> np.ndarray:
    """Integers as a 1-D int64 array; no copy for an int64 array. Lists go through
    `np.fromiter` (about 10 ns a Python int: page sequences kept as arrays skip it)."""
    if isinstance(values, np.ndarray):
        return values.astype(np.int64, copy=False)
    if isinstance(values, (list, tuple, range)):
        return np.fromiter(values, dtype=np.int64, count=len(values))
    return np.asarray(values, dtype=np.int64)


# A block-table entry whose page its sequence has released: the page lay wholly before the
# sliding attention window (see engine/scheduler.py, Scheduler.trim_window). Never a page id.
OUT_OF_WINDOW_PAGE = -1


class OutOfPages(RuntimeError):
    """Raised by `PagePool.allocate` when fewer pages are free than were asked for."""


class PagePool:
    """Free list + reference counts over `num_pages` pages of `page_size` slots,
    optionally backed by per-layer K/V tensors in FlashInfer's NHD layout (views of one K
    and one V tensor holding every layer).

    With `num_layers == 0` the pool holds no tensors (simulation and tree tests). `pin_memory`
    page-locks a host pool's tensors, exactly their bytes (pinned.py), so copies to and from a
    CUDA device run asynchronously.
    Page arguments may be any iterable of ints or an integer numpy array; the counting is
    vectorised, so releasing a long block table costs C time, not a Python loop. At page
    size 1 a block table has a page per token, and turning Python ints into an array is then
    most of the cost: callers that keep pages as arrays (`allocate_array`, the tree's
    `MatchResult.page_array`) pass them as they are, and `decref_count` skips building the
    list of freed pages when only their number matters.
    """

    def __init__(self, num_pages: int, page_size: int, *, num_layers: int = 0,
                 num_kv_heads: int = 0, head_dim: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 pin_memory: bool = False) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages: must be >= 1, got {num_pages}")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size: must be a power of two >= 1, got {page_size}")
        if num_layers and (num_kv_heads < 1 or head_dim < 1):
            raise ValueError("num_kv_heads and head_dim: must be >= 1 when num_layers > 0")
        if pin_memory and torch.device(device).type != "cpu":
            raise ValueError(f"pin_memory: only a host pool is pinned, not one on {device}")
        self.num_pages = num_pages
        self.page_size = page_size
        # K and V are each one backing tensor [num_layers, num_pages, page_size, heads, dim];
        # `k_cache[i]` / `v_cache[i]` are views of layer i (contiguous, the per-layer NHD shape),
        # made once, so every user sees plain per-layer tensors while `copy_page` moves a page
        # of every layer in one op. No tensors (and no backing) when num_layers == 0.
        self._k_all: torch.Tensor | None = None
        self._v_all: torch.Tensor | None = None
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        if num_layers:
            shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
            if pin_memory:  # exactly the pool's bytes (torch's pinned allocator rounds up: pinned.py)
                self._k_all, self._v_all = page_locked_zeros(shape, dtype), page_locked_zeros(shape, dtype)
            else:
                self._k_all = torch.zeros(shape, dtype=dtype, device=device)
                self._v_all = torch.zeros(shape, dtype=dtype, device=device)
            self.k_cache = [self._k_all[i] for i in range(num_layers)]
            self.v_cache = [self._v_all[i] for i in range(num_layers)]
        # The free list is a stack in an array (`_free[:_num_free]`), so whole block tables
        # move in and out at C speed. Popped from the end: a fresh pool hands out 0, 1, 2, ...
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = num_pages
        self._refcounts = np.zeros(num_pages, dtype=np.int32)
        self._scratch = np.zeros(num_pages, dtype=np.int32)  # for duplicate detection
        self._positions = np.arange(num_pages, dtype=np.int32)

    @staticmethod
    def bytes_per_page(page_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        """Bytes of K plus V that one page occupies across all layers."""
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize

    @classmethod
    def from_memory_budget(cls, budget_bytes: int, page_size: int, *, num_layers: int,
                           num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                           device: str | torch.device, pin_memory: bool = False) -> PagePool:
        """A pool with as many pages as fit in `budget_bytes` of K/V memory."""
        per_page = cls.bytes_per_page(page_size, num_layers, num_kv_heads, head_dim, dtype)
        num_pages = budget_bytes // per_page
        if num_pages < 1:
            raise ValueError(f"budget_bytes: {budget_bytes} bytes hold no page of {per_page} bytes")
        return cls(num_pages, page_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, dtype=dtype, device=device, pin_memory=pin_memory)

    @property
    def num_free(self) -> int:
        """Pages with refcount 0."""
        return self._num_free

    @property
    def num_used(self) -> int:
        """Pages with at least one holder."""
        return self.num_pages - self._num_free

    def free_pages(self) -> frozenset[int]:
        """The free list as a set (for checkers)."""
        return frozenset(self._free[: self._num_free].tolist())

    def refcount(self, page: int) -> int:
        """Number of holders of `page`."""
        return int(self._refcounts[page])

    def refcounts(self) -> np.ndarray:
        """A copy of every page's refcount (for checkers)."""
        return self._refcounts.copy()

    def allocate(self, n: int) -> list[int]:
        """Takes `n` free pages, each with refcount 1; all or nothing."""
        return self.allocate_array(n).tolist()

    def allocate_array(self, n: int) -> np.ndarray:
        """`allocate`, as an int64 array (a fresh copy)."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        if n > self._num_free:
            raise OutOfPages(f"asked for {n} pages, {self._num_free} free of {self.num_pages}")
        self._num_free -= n
        pages = self._free[self._num_free:self._num_free + n][::-1].copy()
        self._refcounts[pages] = 1
        return pages

    def incref(self, pages: Iterable[int] | np.ndarray, *, distinct: bool = False) -> None:
        """Adds a holder to each page (a page listed twice gains two); pages must be in use.

        `distinct`: the caller guarantees that no page is listed twice (a tree node's pages,
        a block table), which skips the duplicate check; a page listed twice then gains one.
        """
        idx, counts = self._index(pages, distinct)
        if idx.size == 0:
            return
        before = self._refcounts[idx]
        if (before <= 0).any():
            page = int(idx[np.flatnonzero(before <= 0)[0]])
            raise ValueError(f"incref: page {page} is free (allocate it first)")
        self._refcounts[idx] = before + counts

    def decref(self, pages: Iterable[int] | np.ndarray, *, distinct: bool = False) -> list[int]:
        """Removes a holder from each page; returns the pages that became free. `distinct`
        as for `incref` (a page listed twice then loses one holder)."""
        return self._decref(pages, distinct).tolist()

    def decref_count(self, pages: Iterable[int] | np.ndarray, *, distinct: bool = False) -> int:
        """`decref`, returning how many pages became free."""
        return len(self._decref(pages, distinct))

    def _decref(self, pages: Iterable[int] | np.ndarray, distinct: bool) -> np.ndarray:
        idx, counts = self._index(pages, distinct)
        if idx.size == 0:
            return idx
        before = self._refcounts[idx]
        if (before < counts).any():
            page = int(idx[np.flatnonzero(before < counts)[0]])
            raise ValueError(f"decref: page {page} would drop below refcount 0 (freed twice?)")
        after = before - counts
        self._refcounts[idx] = after
        freed = idx[after == 0]
        self._free[self._num_free:self._num_free + len(freed)] = freed
        self._num_free += len(freed)
        return freed

    def copy_page(self, src: int, dst: int, num_slots: int | None = None) -> None:
        """Copies the first `num_slots` slots (default all) of page `src` into `dst`, K and V,
        every layer: for copy-on-write and copy-on-partial-reuse."""
        n = self.page_size if num_slots is None else num_slots
        if not 0 <= n <= self.page_size:
            raise ValueError(f"num_slots: must be in 0..{self.page_size}, got {n}")
        if src == dst:
            raise ValueError(f"copy_page: source and destination are both page {src}")
        if self._k_all is None or self._v_all is None:
            return
        # One op for K and one for V over the backing tensors (every layer at once), not one
        # per layer per K/V: at 30 layers the 60 small copies' dispatch dominated this call.
        self._k_all[:, dst, :n].copy_(self._k_all[:, src, :n])
        self._v_all[:, dst, :n].copy_(self._v_all[:, src, :n])

    def _index(self, pages: Iterable[int] | np.ndarray, distinct: bool = False
               ) -> tuple[np.ndarray, np.ndarray | int]:
        """Pages as a checked int array, plus how often each occurs (1 unless repeated)."""
        idx = as_int64(pages)
        if idx.size == 0:
            return idx, 1
        if idx.view(np.uint64).max() >= self.num_pages:  # one pass: negatives wrap to huge
            bad = int(idx[(idx < 0) | (idx >= self.num_pages)][0])
            raise ValueError(f"page {bad} is not in 0..{self.num_pages - 1}")
        if distinct:
            return idx, 1
        # A repeated page would be counted once by fancy indexing; the last write of each
        # page's position reveals repeats in O(n).
        order = self._positions[: idx.size]
        self._scratch[idx] = order
        if not np.array_equal(self._scratch[idx], order):
            return np.unique(idx, return_counts=True)
        return idx, 1
