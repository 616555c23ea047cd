"""Building blocks of the Llama family: linear layers, RMSNorm and the gated SiLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from radixserve.native import fused_ops
from radixserve.native import linear as linear_kernel


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T (+ bias): the CPU kernel for float32 rows on the CPU, F.linear otherwise."""
    if linear_kernel.applies(x, weight):
        return linear_kernel.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_many(x: Tensor, projections: list[nn.Linear]) -> list[Tensor]:
    """Each projection of the same x (q, k and v): one kernel call on the CPU where it applies."""
    if linear_kernel.applies(x, projections[0].weight) and all(
            p.weight.dtype == x.dtype and p.weight.is_contiguous() for p in projections):
        return linear_kernel.linear_many(x, [p.weight for p in projections], [p.bias for p in projections])
    return [p(x) for p in projections]


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) whose forward is `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        """Apply the layer to x [rows, in_features]."""
        return linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding (same parameter, same checkpoint name) left unfilled on the meta device.

    Its default N(0, 1) fill of a meta tensor runs through torch's reference implementations,
    whose first use imports torch._dynamo and triton: over a second of every process's start
    (servers, replicas, TP ranks) and triton's leak warnings at exit, to compute nothing,
    since the loader overwrites every weight."""

    def reset_parameters(self) -> None:
        """nn.Embedding's fill, except on the meta device (nothing there to fill)."""
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    """x / rms(x) * weight, normalised in float32 and cast back before the scale (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """Normalise over the last dimension."""
        if fused_ops.applies(x) and x.is_contiguous():
            return fused_ops.add_rms_norm(x, None, self.weight, self.eps)
        return self._torch_forward(x)

    def add_and_norm(self, x: Tensor, delta: Tensor) -> Tensor:
        """x += delta (in place: x is the residual stream), then return the normalised x; one
        pass over the rows on the CPU."""
        if fused_ops.applies(x) and x.is_contiguous() and delta.is_contiguous() and delta.dtype == x.dtype:
            return fused_ops.add_rms_norm(x, delta, self.weight, self.eps)
        x.add_(delta)
        return self._torch_forward(x)

    def _torch_forward(self, x: Tensor) -> Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the MLP token-wise."""
        if linear_kernel.applies(x, self.gate_proj.weight) and self.up_proj.weight.is_contiguous():
            fused = linear_kernel.gated_linear(x, self.gate_proj.weight, self.up_proj.weight,
                                               self.gate_proj.bias, self.up_proj.bias)
            return self.down_proj(fused)
        gate, up = self.gate_proj(x), self.up_proj(x)
        if fused_ops.applies(gate) and gate.is_contiguous() and up.is_contiguous():
            return self.down_proj(fused_ops.silu_mul(gate, up))
        return self.down_proj(F.silu(gate) * up)
