"""Binding of the fused element-wise kernels of a decoder layer (`fused_ops.c`).

Each replaces several torch ops (and their dispatch) with one C call: residual add + RMSNorm,
RoPE on q and k together (in place), and silu(gate) * up. `radixserve.models.layers` and
`radixserve.models.rope` call them for contiguous float32 / bfloat16 tensors on the CPU when the
library is built (`applies`), and keep their torch path otherwise (CUDA, float16, no compiler,
`RADIXSERVE_CPU_KERNEL=0`). Results equal the torch path's up to float rounding. Every call is
checked first (`checks.fused_arguments`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from radixserve.native import build, checks

NAME = "fused_ops"
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def library() -> ctypes.CDLL | None:
    """The library with its three signatures declared; None when it cannot be built."""
    build.declared_library(NAME, "radixserve_add_rms_norm", None, [_P, _P, _P, _P, _I, _I, ctypes.c_float, _C, _C])
    build.declared_library(NAME, "radixserve_rope", None, [_P, _P, _P, _P, _I, _I, _I, _I, _I, _I, _C, _C])
    return build.declared_library(NAME, "radixserve_silu_mul", None, [_P, _P, _P, _I, _I, _C, _C])


def unavailable_reason() -> str | None:
    """Why `library()` returned None, or None when the kernels are loaded."""
    return build.unavailable_reason(NAME)


# The bfloat16 kernels widen and round element by element, which the compiler leaves scalar:
# they beat torch's dispatch at a decode step's few rows, not at a prefill's many.
BF16_MAX_ROWS = 32


def applies(x: Tensor) -> bool:
    """Whether the kernels take tensors like `x` (rows along dim 0): float32, or bfloat16 with
    at most BF16_MAX_ROWS rows, on the CPU, library built."""
    return ((x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and x.shape[0] <= BF16_MAX_ROWS))
            and x.is_cpu and library() is not None)


def _threads() -> int:
    return max(1, torch.get_num_threads())


def add_rms_norm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> Tensor:
    """x += delta in place (when given), then RMSNorm(x) * weight as a new tensor; x [rows, dim]."""
    checks.fused_arguments("add_rms_norm", x, [t for t in (delta,) if t is not None], x.shape)
    if weight.dtype != x.dtype:
        raise ValueError(f"the CPU add_rms_norm kernel needs the weight in x's dtype {x.dtype}, got {weight.dtype}")
    checks.fused_arguments("add_rms_norm weight", weight, [], (x.shape[-1],))
    out = torch.empty_like(x)
    dim = x.shape[-1]
    library().radixserve_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                      out.data_ptr(), x.numel() // max(dim, 1), dim, eps, DTYPE_CODES[x.dtype],
                                      _threads())
    return out


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Rotates q [T, Hq, D] and k [T, Hk, D] in place by cos/sin [T, D] (rotate-half)."""
    checks.rope_arguments(q, k, cos, sin)
    tokens, q_heads, head_dim = q.shape
    library().radixserve_rope(q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, q_heads,
                              k.shape[1], head_dim, q.stride(0), k.stride(0), DTYPE_CODES[q.dtype], _threads())


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up as a new tensor; gate and up [rows, dim]."""
    checks.fused_arguments("silu_mul", gate, [up], gate.shape)
    out = torch.empty_like(gate)
    dim = gate.shape[-1]
    library().radixserve_silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel() // max(dim, 1), dim,
                                  DTYPE_CODES[gate.dtype], _threads())
    return out
