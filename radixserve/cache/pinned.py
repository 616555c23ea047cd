"""Page-locked host memory of exactly the size asked for, for the host tier's pool on CUDA.

`torch.zeros(..., pin_memory=True)` allocates through torch's caching host allocator, which
rounds every request up to the next power of two (ATen's CachingHostAllocator, unless the
process sets `pinned_max_round_threshold`): a host pool of 20 GiB of K and 20 GiB of V would
lock 64 GiB of the host's memory, and a pool sized near what the host has fails or starves
the machine. An ordinary allocation registered with the CUDA driver (`cudaHostRegister`,
as SGLang's host pool and torch's own checkpoint stager pin theirs) locks exactly its pages,
and copies between it and a device run asynchronously as from any pinned buffer. It is
registered *portable* (pinned for every device's context, not only the current one's: the
engine may run on `cuda:1` while device 0 is current), and unregistered when its memory is
freed (the last view of it collected).
"""

from __future__ import annotations

import math
import mmap
import weakref

import torch

_PORTABLE = 1  # cudaHostRegisterPortable


def page_locked_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor of `shape` whose memory, exactly its own bytes, is page-locked
    for CUDA copies (needs a CUDA build of torch and a device).

    The registered range is whole pages of the host that no other allocation shares: the
    driver locks whole pages, and a second registration touching a page of the first fails
    (two small pools allocated side by side on the heap would)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    page = mmap.PAGESIZE
    locked = -(-nbytes // page) * page
    raw = torch.zeros(locked + page, dtype=torch.uint8)
    start = -raw.data_ptr() % page
    region = raw[start:start + locked]
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(region.data_ptr(), locked, _PORTABLE))
    if error != 0:
        raise RuntimeError(f"page-locking {locked} bytes of host memory for the host tier failed "
                           f"(cudaHostRegister error {error}): is the locked-memory limit "
                           f"(`ulimit -l`) below the host pool's size?")
    tensor = region[:nbytes].view(dtype).view(shape)
    # Undone when the memory itself goes (the storage outlives the tensor while views of it live).
    weakref.finalize(raw.untyped_storage(), cudart.cudaHostUnregister, region.data_ptr())
    return tensor
