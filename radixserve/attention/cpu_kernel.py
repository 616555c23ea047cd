"""Ctypes binding of the CPU paged-attention kernel (`radixserve/native/paged_attention.c`).

Torch has no paged attention for the CPU, so the torch backend would otherwise gather every
key and value a query sees into a dense copy before SDPA. This kernel reads them in place
from the pages. It is built at first use (see `radixserve.native`); when it cannot be,
`load()` returns None and the torch backend gathers as before.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from radixserve import native

NAME = "paged_attention"
_C_INT64_P = ctypes.POINTER(ctypes.c_int64)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel's library with its signature declared; None when it cannot be built."""
    library = native.load(NAME)
    if library is None:
        return None
    function = library.radixserve_paged_attention
    function.restype = ctypes.c_int
    function.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # q, k, v, kv_indices
        _C_INT64_P, _C_INT64_P, _C_INT64_P, _C_INT64_P,  # rows, page_start, lo, hi
        ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # rows, Hq, Hkv, D, S
        ctypes.c_float, ctypes.c_int64,  # scale, max_keys
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # out, scratch, threads
    ]
    return library


def unavailable_reason() -> str | None:
    """Why `load()` returned None, or None when the kernel is loaded."""
    return native.unavailable_reason(NAME)


def supports(q: Tensor, k_cache: Tensor, v_cache: Tensor) -> bool:
    """Whether the kernel can run attention for these tensors (CPU, float32, contiguous)."""
    tensors = (q, k_cache, v_cache)
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
            and load() is not None)


class KernelRows:
    """The query rows one call attends, with each row's pages and key range (host arrays).

    Row i is row `rows[i]` of q; its sequence's pages start at `kv_indices[page_start[i]]`
    and it sees keys lo[i] .. hi[i] - 1, counted from the first listed page.
    """

    def __init__(self, rows: Tensor, page_start: Tensor, lo: Tensor, hi: Tensor) -> None:
        self.rows, self.page_start, self.lo, self.hi = (
            t.to(torch.int64).contiguous() for t in (rows, page_start, lo, hi))
        self.max_keys = int((self.hi - self.lo).max()) if len(self.rows) else 0

    def __len__(self) -> int:
        return len(self.rows)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, kv_indices: Tensor,
                    rows: KernelRows, out: Tensor, *, scale: float, scratch: Tensor) -> None:
    """Writes attention for `rows` of q ([T, Hq, D]) into the same rows of out, reading K/V
    from the caches ([P, S, Hkv, D]). `scratch` holds at least
    `scratch_elements(rows, Hq, D)` floats. Callers check `supports` first."""
    library = load()
    assert library is not None and q.is_contiguous() and out.is_contiguous()
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    threads = torch.get_num_threads()
    status = library.radixserve_paged_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_indices.data_ptr(),
        *(ctypes.cast(t.data_ptr(), _C_INT64_P) for t in (rows.rows, rows.page_start, rows.lo, rows.hi)),
        len(rows), q.shape[1], num_kv_heads, head_dim, page_size, scale, rows.max_keys,
        out.data_ptr(), scratch.data_ptr(), threads,
    )
    if status != 0:
        raise ValueError(f"{q.shape[1]} query heads cannot share {num_kv_heads} KV heads")


def scratch_elements(rows: KernelRows, num_qo_heads: int, head_dim: int) -> int:
    """Floats of scratch a call over `rows` needs."""
    return torch.get_num_threads() * num_qo_heads * (max(rows.max_keys, 1) + head_dim)
