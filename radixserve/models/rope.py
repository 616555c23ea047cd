"""Rotary position embeddings, including Llama-3 and linear frequency scaling.

RoPE settings live in `config.rope_parameters` (transformers 5) or in `config.rope_theta` and
`config.rope_scaling` (transformers 4); both are read.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from radixserve.native import fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(config: PretrainedConfig) -> dict[str, Any]:
    """The RoPE parameters of `config` as one dict with `rope_type` and `rope_theta` set."""
    params = dict(
        getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    )
    params.setdefault("rope_type", params.get("type", "default"))
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    return params


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> Tensor:
    """float32 [head_dim // 2] rotation frequencies, computed on the CPU exactly as HF does."""
    params = rope_settings(config)
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {supported})")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    base = float(params["rope_theta"])
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_scaling(inv_freq, params, config)
    return inv_freq


def _llama3_scaling(inv_freq: Tensor, params: dict[str, Any], config: PretrainedConfig) -> Tensor:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, interpolate in between."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context = params.get("original_max_position_embeddings") or config.max_position_embeddings
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for a step's positions; computed once per step, shared by all layers.

    On the CPU the rows come from a table of every position so far (grown by doubling, up to
    TABLE_POSITIONS), one index per step instead of the seven ops that compute them: the same
    bits, since cos and sin are elementwise (a decode step's rows cost about 0.1 ms computed,
    cache-cold after the weights stream through). Positions past the table are computed.
    """

    TABLE_POSITIONS = 16384

    def __init__(self, inv_freq: Tensor) -> None:
        super().__init__()
        # Kept out of the module's buffers so that meta-device construction and `.to(dtype)`
        # leave the float32 frequencies intact; copied to each device once.
        self._inv_freq_by_device: dict[torch.device, Tensor] = {inv_freq.device: inv_freq}
        self._tables: dict[torch.dtype, tuple[Tensor, Tensor]] = {}  # CPU: dtype -> (cos, sin)

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin of shape [T, head_dim] in `dtype` for int positions [T]."""
        if positions.device.type == "cpu" and positions.numel():
            needed = int(positions.max()) + 1
            if needed <= self.TABLE_POSITIONS:
                cos, sin = self._table(needed, dtype)
                return cos[positions], sin[positions]
        return self._compute(positions, dtype)

    def _table(self, needed: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The CPU table in `dtype`, covering at least `needed` positions."""
        table = self._tables.get(dtype)
        if table is None or len(table[0]) < needed:
            size = min(self.TABLE_POSITIONS, max(needed, 2 * len(table[0]) if table else 1024))
            table = self._tables[dtype] = self._compute(torch.arange(size), dtype)
        return table

    def _compute(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        device = positions.device
        inv_freq = self._inv_freq_by_device.get(device)
        if inv_freq is None:
            any_copy = next(iter(self._inv_freq_by_device.values()))
            inv_freq = self._inv_freq_by_device[device] = any_copy.to(device)
        freqs = positions[:, None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] by the angles of its token (rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_qk(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """`apply_rotary` on q [T, Hq, D] and k [T, Hk, D]; on the CPU one in-place C pass over both
    (q and k must then be tensors the caller may overwrite)."""
    if (fused_ops.applies(q) and q.dtype == k.dtype == cos.dtype and q.stride(-1) == 1 and k.stride(-1) == 1
            and q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2] and cos.is_contiguous() and sin.is_contiguous()):
        fused_ops.rope(q, k, cos, sin)
        return q, k
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
