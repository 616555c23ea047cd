"""Binding of the fused CPU sampler (`sampling.c`).

`radixserve.engine.sampler.sample` hands CPU float32 logits here when the kernel is built: one
C call filters and draws every row (see the C file for the method), instead of many torch and
numpy passes over [rows, vocab]. Semantics, seeds and errors are the torch path's; the two may
differ only where float rounding puts a token on the edge of top-p or of the draw. Every call
is checked first (`checks.sampling_arguments`; for a grammar's token mask, which the sampler
applies to a row in the pass that finds its maximum, or which `apply_token_mask` and
`apply_native_mask` apply alone, `checks.token_mask_call` on a `checks.NativeMask`: the mask's
memory is checked once when it is packed, so a step pays a few integer comparisons for it).
`greedy_tokens` serves the steps whose rows are all greedy and some constrained: each row's
mask, maximum and first index of it in one pass (`checks.greedy_call`).
"""

from __future__ import annotations

import ctypes
import functools
from array import array

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
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # grammar mask, its rows, count, words
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
    kernel cannot read (`checks.native_mask`, `checks.token_mask_call`); RuntimeError when not
    built."""
    if not checks.cpu_float_rows(logits):
        raise ValueError("the token mask needs 2-D float32 logits on the CPU with rows of unit stride, got "
                         f"{logits.dtype} on {logits.device}, shape {tuple(logits.shape)}")
    if not apply_native_mask(logits, checks.native_mask(bitmask, rows)):
        raise RuntimeError(f"the CPU sampler is unavailable: {build.unavailable_reason(NAME)}")


def apply_native_mask(logits: Tensor, mask: checks.NativeMask) -> bool:
    """`apply_token_mask` for a packed mask; False (nothing done) when these logits cannot be
    masked here (`usable` is false)."""
    loaded = mask_library()
    if loaded is None or not checks.cpu_float_rows(logits):
        return False
    rows, vocab = logits.shape
    checks.token_mask_call(rows, vocab, mask)
    loaded.radixserve_apply_token_mask(logits.data_ptr(), logits.stride(0), vocab, mask.rows_address, mask.count,
                                        mask.words.address, mask.words.words)
    return True


@functools.cache
def greedy_library() -> ctypes.CDLL | None:
    """The same library with the greedy function declared; None when it cannot be built."""
    return build.declared_library(NAME, "radixserve_greedy", ctypes.c_int64, [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # logits, stride, rows, vocab
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # grammar mask, its rows, count, words
        ctypes.c_void_p, ctypes.c_int,  # tokens, threads
    ])


def greedy_tokens(logits: Tensor, mask: checks.NativeMask | None) -> list[int] | None:
    """torch.argmax of every row of `logits` [R, V] once `mask` (None: no mask) is applied to
    its rows in place (forbidden tokens -inf), -1 for a row whose argmax would be a NaN or -inf
    logit: one C pass per row for the mask, the maximum and its first index. None (nothing
    done) when these logits cannot be read here (`usable` is false). Raises ValueError, before
    any C runs, when the mask does not fit the logits (`checks.greedy_call`).

    Lean on purpose: it runs right after the forward pass has written the logits, when the
    caches are cold and every Python-level conversion costs several times its warm price."""
    if not usable(logits):
        return None
    rows, vocab = logits.shape
    checks.greedy_call(rows, vocab, mask)
    words, row_ids, count, width = (None, None, 0, 0) if mask is None else (
        mask.words.address, mask.rows_address, mask.count, mask.words.words)
    tokens = array("q", bytes(8 * rows))
    failed = greedy_library().radixserve_greedy(  # type: ignore[union-attr]
        logits.data_ptr(), logits.stride(0), rows, vocab, words, row_ids, count, width, tokens.buffer_info()[0],
        max(1, torch.get_num_threads()))
    if failed < 0:
        raise MemoryError("the CPU sampler could not allocate its grammar mask's row lookup")
    return tokens.tolist()


def usable(logits: Tensor) -> bool:
    """Whether these logits can be sampled here (CPU, float32, rows of unit stride)."""
    return checks.cpu_float_rows(logits) and library() is not None


def run(logits: Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
        min_p: np.ndarray, u: np.ndarray, *, want_probs: bool = False,
        mask_rows: list[int] | None = None, mask: Tensor | checks.NativeMask | None = None
        ) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens (int64 [R], -1 where a row's logits are not finite) and, with `want_probs`,
    the filtered probabilities [R, V] of the sampled rows (greedy rows: untouched zeros).
    temperature 0 is greedy; the parameter arrays hold one entry per row (converted to
    float32, int64 for top_k, float64 for u). With a grammar `mask` (int32 [len(mask_rows),
    ceil(V / 32)], xgrammar's layout; or a `checks.NativeMask`, packed with its rows, and then
    `mask_rows` is not used), row `mask_rows[i]` of `logits` is masked in place by `mask[i]`
    (forbidden tokens -inf) before it is sampled. Raises ValueError, before any C runs, on
    arguments the kernel cannot read (see `checks.sampling_arguments` and
    `checks.token_mask_call`)."""
    loaded = library()
    if loaded is None:
        raise RuntimeError(f"the CPU sampler is unavailable: {build.unavailable_reason(NAME)}")
    arrays = checks.sampling_arguments(logits, temperature, top_k, top_p, min_p, u)
    rows, vocab = logits.shape
    if isinstance(mask, Tensor):
        mask = checks.native_mask(mask, mask_rows or [])
    if mask is not None:
        checks.token_mask_call(rows, vocab, mask)
    threads, scratch = threads_and_scratch(NAME, SCRATCH_PER_VOCAB * vocab)
    tokens = np.empty(rows, dtype=np.int64)
    probs = np.zeros((rows, vocab), dtype=np.float32) if want_probs else None
    failed = loaded.radixserve_sample(
        logits.data_ptr(), logits.stride(0), rows, vocab, *(a.ctypes.data for a in arrays),
        tokens.ctypes.data, None if probs is None else probs.ctypes.data,
        None if mask is None else mask.words.address, None if mask is None else mask.rows_address,
        0 if mask is None else mask.count, 0 if mask is None else mask.words.words, scratch.ctypes.data, threads)
    if failed < 0:
        raise MemoryError("the CPU sampler could not allocate its grammar mask's row lookup")
    return tokens, probs
