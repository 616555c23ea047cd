"""Binding of the CPU paged-attention kernel (`paged_attention.c`).

Torch has no paged attention for the CPU, so the torch backend would otherwise gather every
key and value a query sees into a dense copy before SDPA. This kernel reads them in place
from the pages. It is built at first use (see `build`); when it cannot be, `library()` returns
None and the torch backend gathers as before.

Two steps, both through `checks`: `PagedRows` checks a step's decode rows once, when the
backend plans (the vectorised part: every page index the rows read); `run` checks each
layer's tensors against them (a few comparisons) and calls C.
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch
from torch import Tensor

from radixserve.native import build, checks
from radixserve.native.scratch import threads_and_scratch

NAME = "paged_attention"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel's library with its signature declared; None when it cannot be built."""
    return build.declared_library(NAME, "radixserve_paged_attention", ctypes.c_int, [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # q, k, v, kv_indices
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # rows, page_start, lo, hi
        ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # rows, Hq, Hkv, D, S
        ctypes.c_float, ctypes.c_int64,  # scale, max_keys
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,  # out, scratch, threads, dtype
    ])


def unavailable_reason() -> str | None:
    """Why `library()` returned None, or None when the kernel is loaded."""
    return build.unavailable_reason(NAME)


class PagedRows:
    """The query rows one call attends, with each row's pages and key range, checked.

    Row i is row `rows[i]` of q; its sequence's pages start at `kv_indices[page_start[i]]`
    and it sees keys lo[i] .. hi[i] - 1, counted from the first listed page. Built once per
    step; the constructor raises ValueError on rows the kernel would misread (see
    `checks.paged_rows`), and converts int64 kv_indices to int32 once.
    """

    def __init__(self, kv_indices: Tensor | np.ndarray, rows: Tensor | np.ndarray,
                 page_start: Tensor | np.ndarray, lo: Tensor | np.ndarray, hi: Tensor | np.ndarray,
                 *, page_size: int) -> None:
        self.page_size = page_size
        self.checked = checks.paged_rows(kv_indices, rows, page_start, lo, hi, page_size)
        self.max_keys = self.checked.max_keys
        self._pointers = tuple(a.ctypes.data for a in self.checked[:5])  # the arrays live in `checked`

    def __len__(self) -> int:
        return len(self.checked.rows)


def run(q: Tensor, k_cache: Tensor, v_cache: Tensor, rows: PagedRows, out: Tensor, *, scale: float) -> None:
    """Writes attention for `rows` of q ([T, Hq, D]) into the same rows of out, reading K/V
    from the caches ([pages, page_size, Hkv, D]). Raises ValueError, before any C runs, on
    tensors or rows the kernel cannot read (see `checks.attention_call`)."""
    loaded = library()
    if loaded is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {unavailable_reason()}")
    checks.attention_call(q, k_cache, v_cache, out, rows.checked, rows.page_size)
    _, num_qo_heads, head_dim = q.shape
    threads, scratch = threads_and_scratch(NAME, *scratch_layout(num_qo_heads, head_dim, rows.max_keys, len(rows)))
    # Parts of rows are what the threads share out: a thread more than there are would only
    # join the region's barrier (the scratch holds the slices of the count passed).
    threads = min(threads, len(rows) * key_parts(rows.max_keys))
    status = loaded.radixserve_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *rows._pointers,
        len(rows), num_qo_heads, k_cache.shape[2], head_dim, rows.page_size, scale, rows.max_keys,
        out.data_ptr(), scratch.ctypes.data, threads, DTYPE_CODES[q.dtype],
    )
    if status != 0:  # the checks above refuse every shape the kernel refuses
        raise RuntimeError(f"radixserve_paged_attention returned {status}")


KEY_PART = 64  # keys per work item: paged_attention.c's KEY_PART


def key_parts(max_keys: int) -> int:
    """Work items per row of up to `max_keys` keys (at least one)."""
    return -(-max(max_keys, 1) // KEY_PART)


def scratch_layout(num_qo_heads: int, head_dim: int, max_keys: int, num_rows: int) -> tuple[int, int]:
    """(floats each thread uses, floats the threads share) of the kernel's scratch (the layout
    in paged_attention.c): per thread one score per key of a part and per head, the output
    and (bfloat16) the widened query and one K/V row; shared, each part's maxima, sums and
    weighted values, for `num_rows` rows of up to `max_keys` keys."""
    return (num_qo_heads * (min(max(max_keys, 1), KEY_PART) + 3 * head_dim),
            num_rows * key_parts(max_keys) * num_qo_heads * (head_dim + 2))
