"""Ctypes binding of the fused CPU sampler (`radixserve/native/sampling.c`).

`sampler.sample` hands CPU float32 logits here when the kernel is built: one C call filters
and draws every row (see the C file for the method), instead of a dozen torch and numpy
passes over [rows, vocab]. Semantics, seeds and errors are the torch path's; the two may
differ only where float rounding puts a token on the edge of top-p or of the draw.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import numpy as np
import torch
from torch import Tensor

from radixserve import native

NAME = "sampling"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The sampler's library with its signature declared; None when it cannot be built."""
    library = native.load(NAME)
    if library is None:
        return None
    function = library.radixserve_sample
    function.restype = ctypes.c_int64
    function.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # logits, stride, rows, vocab
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # T, top_k, top_p, min_p
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # u, tokens, probs
        ctypes.c_void_p, ctypes.c_int,  # scratch, threads
    ]
    return library


def usable(logits: Tensor) -> bool:
    """Whether these logits can be sampled here (CPU, float32, rows of unit stride)."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and load() is not None)


_local = threading.local()  # scratch per thread: engines in other threads sample at once


def run(logits: Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
        min_p: np.ndarray, u: np.ndarray, *, want_probs: bool = False
        ) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens (int64 [R], -1 where a row's logits are not finite) and, with `want_probs`,
    the filtered probabilities [R, V] of the sampled rows (greedy rows: untouched zeros).
    temperature 0 is greedy; the parameter arrays are per row (float32, int64 for top_k),
    u float64. Callers check `usable` first."""
    library = load()
    assert library is not None
    rows, vocab = logits.shape
    threads = torch.get_num_threads()
    needed = threads * 6 * vocab
    scratch = getattr(_local, "scratch", None)
    if scratch is None or scratch.size < needed:
        scratch = _local.scratch = np.empty(needed, dtype=np.float32)
    arrays = [np.ascontiguousarray(a, dtype=t) for a, t in (
        (temperature, np.float32), (top_k, np.int64), (top_p, np.float32), (min_p, np.float32),
        (u, np.float64))]
    tokens = np.empty(rows, dtype=np.int64)
    probs = np.zeros((rows, vocab), dtype=np.float32) if want_probs else None
    library.radixserve_sample(
        logits.data_ptr(), logits.stride(0), rows, vocab, *(a.ctypes.data for a in arrays),
        tokens.ctypes.data, None if probs is None else probs.ctypes.data, scratch.ctypes.data, threads)
    return tokens, probs
