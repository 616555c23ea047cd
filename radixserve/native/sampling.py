"""Binding of the fused CPU sampler (`sampling.c`).

`radixserve.engine.sampler.sample` hands CPU float32 logits here when the kernel is built: one
C call filters and draws every row (see the C file for the method), instead of many torch and
numpy passes over [rows, vocab]. Semantics, seeds and errors are the torch path's; the two may
differ only where float rounding puts a token on the edge of top-p or of the draw. Every call
is checked first (`checks.sampling_arguments`, and `checks.token_mask_arguments` for a
grammar's token mask, which the sampler applies to a row just before sampling it, or which
`apply_token_mask` applies alone).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch
from torch import Tensor

from radixserve.native import build, checks
from radixserve.native.scratch import threads_and_scratch

NAME = "sampling"
SCRATCH_PER_VOCAB = 6  # floats per token per thread: probabilities, selection, two candidate lists


@functools.cache
def library() -> ctypes.CDLL | None:
    """The sampler's library with its signature declared; None when it cannot be built."""
    return build.declared_library(NAME, "radixserve_sample", ctypes.c_int64, [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # logits, stride, rows, vocab
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # T, top_k, top_p, min_p
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # u, tokens, probs
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # grammar mask, its row per logits row, words
        ctypes.c_void_p, ctypes.c_int,  # scratch, threads
    ])


@functools.cache
def mask_library() -> ctypes.CDLL | None:
    """The same library with the token-mask function declared; None when it cannot be built."""
    return build.declared_library(NAME, "radixserve_apply_token_mask", None, [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # logits, stride, vocab
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,  # rows, count, bitmask, words
    ])


def apply_token_mask(logits: Tensor, rows: list[int], bitmask: Tensor) -> None:
    """Sets to -inf, in place, the logits of row `rows[i]` whose bit is clear in `bitmask[i]`
    (int32 words, xgrammar's layout). Raises ValueError, before any C runs, on arguments the
    kernel cannot read (`checks.token_mask_arguments`); RuntimeError when not built."""
    loaded = mask_library()
    if loaded is None:
        raise RuntimeError(f"the CPU sampler is unavailable: {build.unavailable_reason(NAME)}")
    indices, words = checks.token_mask_arguments(logits, rows, bitmask)
    loaded.radixserve_apply_token_mask(logits.data_ptr(), logits.stride(0), logits.shape[1], indices.ctypes.data,
                                        len(indices), words.ctypes.data, words.shape[1])


def usable(logits: Tensor) -> bool:
    """Whether these logits can be sampled here (CPU, float32, rows of unit stride)."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and library() is not None)


def run(logits: Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
        min_p: np.ndarray, u: np.ndarray, *, want_probs: bool = False,
        mask_rows: list[int] | None = None, mask: Tensor | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens (int64 [R], -1 where a row's logits are not finite) and, with `want_probs`,
    the filtered probabilities [R, V] of the sampled rows (greedy rows: untouched zeros).
    temperature 0 is greedy; the parameter arrays hold one entry per row (converted to
    float32, int64 for top_k, float64 for u). With a grammar `mask` (int32 [len(mask_rows),
    ceil(V / 32)], xgrammar's layout), row `mask_rows[i]` of `logits` is masked in place by
    `mask[i]` (forbidden tokens -inf) before it is sampled. Raises ValueError, before any C
    runs, on arguments the kernel cannot read (see `checks.sampling_arguments` and
    `checks.token_mask_arguments`)."""
    loaded = library()
    if loaded is None:
        raise RuntimeError(f"the CPU sampler is unavailable: {build.unavailable_reason(NAME)}")
    arrays = checks.sampling_arguments(logits, temperature, top_k, top_p, min_p, u)
    rows, vocab = logits.shape
    mask_words: np.ndarray | None = None
    mask_index = np.full(rows, -1, dtype=np.int64)
    if mask is not None:
        indices, mask_words = checks.token_mask_arguments(logits, mask_rows or [], mask)
        mask_index[indices] = np.arange(len(indices))
    threads, scratch = threads_and_scratch(NAME, SCRATCH_PER_VOCAB * vocab)
    tokens = np.empty(rows, dtype=np.int64)
    probs = np.zeros((rows, vocab), dtype=np.float32) if want_probs else None
    loaded.radixserve_sample(
        logits.data_ptr(), logits.stride(0), rows, vocab, *(a.ctypes.data for a in arrays),
        tokens.ctypes.data, None if probs is None else probs.ctypes.data,
        None if mask_words is None else mask_words.ctypes.data, mask_index.ctypes.data,
        0 if mask_words is None else mask_words.shape[1], scratch.ctypes.data, threads)
    return tokens, probs
