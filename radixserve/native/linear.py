"""Binding of the CPU linear kernel (`linear.c`): y = x @ weight.T (+ bias).

torch's CPU matmul goes to the BLAS it ships, which on some CPUs (those it does not
recognise, AMD's among them) takes a generic path: at a decode step's few rows it reads the
weights at a fraction of the memory bandwidth, and its float32 prefill GEMMs run below the
CPU's vector width. This kernel streams the weights with the CPU's own vectors
(`-march=native`: AVX-512, or AVX2 with FMA; a build with neither, `vectorised()` false, is
left unused: its portable loops run far below torch's BLAS). Each output is the same sum in
the same order whatever the number of rows and threads, so a row's result does not depend on
which other rows share its step.

`radixserve.models.layers.linear` calls it where it `applies`: float32 on the CPU at any row
count, and bfloat16 up to BF16_MAX_ROWS rows (a decode step's; past them torch's bfloat16
GEMM: see docs/benchmark.md); F.linear otherwise (CUDA, float16,
no compiler, `RADIXSERVE_CPU_KERNEL=0`). Every call is checked first (`checks.linear_arguments`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from radixserve.native import build, checks

NAME = "linear"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_WEIGHTS = 8  # weights per linear_many call (MAX_SEGMENTS in linear.c)
BF16_MAX_ROWS = 16
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel's library with its signatures declared; None when it cannot be built."""
    build.declared_library(NAME, "radixserve_linear_many", None, [_P, _C, _P, _P, _P, _P, _I, _I, _C, _C])
    build.declared_library(NAME, "radixserve_gated_linear", None, [_P, _P, _P, _P, _P, _P, _I, _I, _I, _C, _C])
    build.declared_library(NAME, "radixserve_linear_vector_width", _C, [])
    return build.declared_library(NAME, "radixserve_linear", None, [_P, _P, _P, _P, _I, _I, _I, _C, _C])


def unavailable_reason() -> str | None:
    """Why `library()` returned None, or None when the kernel is loaded."""
    return build.unavailable_reason(NAME)


@functools.cache
def vectorised() -> bool:
    """Whether the library is built and runs on the CPU's vectors (AVX-512, or AVX2 with FMA)."""
    loaded = library()
    return loaded is not None and loaded.radixserve_linear_vector_width() > 0


def applies(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernel takes x [rows, in] against weight [out, in]: float32, or bfloat16
    with at most BF16_MAX_ROWS rows, on the CPU, weight contiguous, library built on vectors."""
    return (x.dim() == 2 and x.dtype == weight.dtype
            and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.shape[0] <= BF16_MAX_ROWS))
            and x.is_cpu and weight.is_cpu and weight.is_contiguous() and vectorised())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x [rows, in] @ weight [out, in].T (+ bias [out]) as a new tensor [rows, out] in x's dtype."""
    x = x.contiguous()
    checks.linear_arguments(x, weight, bias)
    rows, out_features = x.shape[0], weight.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    if rows and out_features:
        library().radixserve_linear(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                    out.data_ptr(), rows, x.shape[1], out_features, DTYPE_CODES[x.dtype],
                                    max(1, torch.get_num_threads()))
    return out


def _pointers(tensors: list[Tensor | None]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))


def linear_many(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> list[Tensor]:
    """[x @ w.T (+ b) for each weight and bias] in one call: the weights' outputs split between
    the threads as one range (q, k and v: one parallel region instead of three)."""
    if not 1 <= len(weights) <= MAX_WEIGHTS or len(biases) != len(weights):
        raise ValueError(f"linear_many takes 1 to {MAX_WEIGHTS} weights with one bias (or None) each, "
                         f"got {len(weights)} weights and {len(biases)} biases")
    x = x.contiguous()
    for weight, bias in zip(weights, biases, strict=True):
        checks.linear_arguments(x, weight, bias)
    outs = [torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype) for weight in weights]
    if x.shape[0]:
        sizes = (ctypes.c_int64 * len(weights))(*(weight.shape[0] for weight in weights))
        library().radixserve_linear_many(x.data_ptr(), len(weights), _pointers(weights), _pointers(biases),
                                         _pointers(outs), sizes, x.shape[0], x.shape[1], DTYPE_CODES[x.dtype],
                                         max(1, torch.get_num_threads()))
    return outs


def gated_linear(x: Tensor, gate: Tensor, up: Tensor, gate_bias: Tensor | None = None,
                 up_bias: Tensor | None = None) -> Tensor:
    """silu(x @ gate.T + gate_bias) * (x @ up.T + up_bias) [rows, out], without the gate and
    up projections ever in memory (rounded as the separate ops would in bfloat16)."""
    x = x.contiguous()
    checks.linear_arguments(x, gate, gate_bias)
    checks.linear_arguments(x, up, up_bias)
    if gate.shape != up.shape:
        raise ValueError(f"gated_linear needs gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    rows, out_features = x.shape[0], gate.shape[0]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    if rows and out_features:
        library().radixserve_gated_linear(x.data_ptr(), gate.data_ptr(), up.data_ptr(),
                                          None if gate_bias is None else gate_bias.data_ptr(),
                                          None if up_bias is None else up_bias.data_ptr(), out.data_ptr(), rows,
                                          x.shape[1], out_features, DTYPE_CODES[x.dtype], max(1, torch.get_num_threads()))
    return out
