"""The OpenMP runtime shared by torch and the CPU kernels: one thread's idle workers handed back.

libgomp keeps a team of worker threads per thread that has run a parallel region, and it
lets waiting workers spin only while all the threads it manages fit on the cores; past that
every worker sleeps in the kernel between regions and is woken by a system call at the next
one. A decode step runs a couple of hundred regions, so a second team (the thread that loaded
the model, then the thread that runs the steps) makes every step pay hundreds of wake-ups,
about a fifth of a small model's step on two cores. `release_thread_workers()`, called on the
thread that built the engine before another thread takes over its steps, ends that first
team: the stepping thread's team is then the only one.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

logger = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep nothing the program could see


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """libgomp as already loaded by torch (a library of that name is found loaded first), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        runtime = ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None
    if not hasattr(runtime, "omp_pause_resource_all"):  # OpenMP 5.0, GCC 9 and later
        return None
    runtime.omp_pause_resource_all.restype = ctypes.c_int
    runtime.omp_pause_resource_all.argtypes = [ctypes.c_int]
    return runtime


def release_thread_workers() -> bool:
    """Ends the calling thread's OpenMP worker team, if it has one; True when the runtime did.

    Harmless where there is no team or no libgomp: a later parallel region on this thread
    simply starts a new team. Must not be called inside a parallel region.
    """
    runtime = _runtime()
    if runtime is None:
        return False
    released = runtime.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not released:
        logger.debug("libgomp did not release this thread's workers")
    return released
