"""Per-thread scratch memory for the kernels, sized with the thread count the call runs with.

A kernel's OpenMP threads each take the slice of scratch at their thread number, so the
buffer must hold as many slices as the call has threads. Reading `torch.get_num_threads()`
once, here, and handing that one value to both the sizing and the call keeps the two from
disagreeing (a second read could see another count, set by another thread in between, and let
the kernel write past the buffer).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

_local = threading.local()  # engines in several threads call the kernels at once


def threads_and_scratch(kernel: str, floats_per_thread: int, shared_floats: int = 0) -> tuple[int, np.ndarray]:
    """The thread count for one call of `kernel`, and a float32 buffer of at least that many
    times `floats_per_thread` floats plus `shared_floats` (after the threads' slices), reused by
    this thread's later calls of the same kernel. Pass the count to the call unchanged."""
    threads = max(1, torch.get_num_threads())  # the one read: sizes the buffer and runs the call
    needed = threads * max(floats_per_thread, 1) + shared_floats
    buffers: dict[str, np.ndarray] = _local.__dict__.setdefault("buffers", {})
    buffer = buffers.get(kernel)
    if buffer is None or buffer.size < needed:
        buffer = buffers[kernel] = np.empty(needed, dtype=np.float32)
    return threads, buffer
