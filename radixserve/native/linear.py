"""Binding of the CPU linear kernel (`linear.c`): y = x @ weight.T (+ bias) in float32.

torch's CPU matmul goes to the BLAS it ships, which on some CPUs (those it does not
recognise, AMD's among them) takes a generic path: at a decode step's few rows it reads the
weights at a fraction of the memory bandwidth, and its prefill GEMMs run below the CPU's
vector width. This kernel streams the weights with the CPU's own vectors (`-march=native`).
Each output is the same sum in the same order whatever the number of rows, so a row's result
does not depend on which other rows share its step. `radixserve.models.layers.linear` calls it
for float32 on the CPU when the library is built (`applies`), and F.linear otherwise (CUDA,
bfloat16, no compiler, `RADIXSERVE_CPU_KERNEL=0`). Every call is checked first
(`checks.linear_arguments`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from radixserve.native import build, checks

NAME = "linear"
_P, _I = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel's library with its signature declared; None when it cannot be built."""
    return build.declared_library(NAME, "radixserve_linear", None, [_P, _P, _P, _P, _I, _I, _I, ctypes.c_int])


def unavailable_reason() -> str | None:
    """Why `library()` returned None, or None when the kernel is loaded."""
    return build.unavailable_reason(NAME)


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernel takes x [rows, in] against weight [out, in]: both float32 on the CPU,
    weight contiguous, library built."""
    return (x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
            and x.is_cpu and weight.is_cpu and weight.is_contiguous() and library() is not None)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias [out]) as a new float32 tensor [rows, out]."""
    x = x.contiguous()
    checks.linear_arguments(x, weight, bias)
    rows, out_features = x.shape[0], weight.shape[0]
    out = torch.empty(rows, out_features, dtype=torch.float32)
    if rows and out_features:
        library().radixserve_linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                    out.data_ptr(), rows, x.shape[1], out_features, max(1, torch.get_num_threads()))
    return out
