"""The seam between the Llama-family model and the whole-stack decode kernel.

On the CPU, a step where every row decodes through the paged-attention kernel runs all decoder
layers in one C call (`radixserve.native.decoder`) instead of about ten calls per layer from
Python: the same kernels in the same order, so the logits are the per-layer path's bit for
bit. float32 at any batch; bfloat16 at the rows the linear kernel takes on the per-layer path
too (up to `linear.BF16_MAX_ROWS`; torch's bfloat16 GEMM runs more). Models it cannot take (another
dtype or device, per-head q/k norms, projection modules other than this package's `Linear`, as
tensor parallelism installs) keep the per-layer path, as do steps with a prefill among their
rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from radixserve.attention.base import AttentionBackend
from radixserve.models.layers import GatedMLP, Linear, RMSNorm
from radixserve.native import decoder
from radixserve.native import linear as linear_kernel
from radixserve.native.paged_attention import PagedRows

if TYPE_CHECKING:
    from radixserve.models.llama import CausalLM


def _projection_tensors(prefix: str, module: nn.Module) -> dict[str, Tensor | None]:
    if type(module) is not Linear:
        raise ValueError(f"{prefix}: {type(module).__name__} is not the package's Linear")
    return {prefix: module.weight, f"{prefix}_bias": module.bias}


def decoder_weights(model: CausalLM) -> decoder.DecoderWeights | None:
    """The model's layers as the kernel reads them, or None when it cannot take this model
    (or its linear layers run on the CPU's vectors in no build here: `linear.vectorised`).
    The tensors are the model's parameters themselves (no copy)."""
    dtype = model.model.embed_tokens.weight.dtype
    if decoder.library() is None or not linear_kernel.vectorised() or dtype not in (torch.float32, torch.bfloat16):
        return None
    layers = []
    try:
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            if attention.q_norm is not None or type(mlp) is not GatedMLP or not all(
                    type(norm) is RMSNorm and norm.eps == model.config.rms_norm_eps
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm)):
                return None
            tensors: dict[str, Tensor | None] = {"input_norm": layer.input_layernorm.weight,
                                                 "post_norm": layer.post_attention_layernorm.weight}
            for name in ("q", "k", "v", "o"):
                tensors |= _projection_tensors(name, getattr(attention, f"{name}_proj"))
            for name in ("gate", "up", "down"):
                tensors |= _projection_tensors(name, getattr(mlp, f"{name}_proj"))
            layers.append(tensors)
        first = model.model.layers[0].self_attn
        shape = decoder.DecoderShape(
            hidden=model.config.hidden_size, q_heads=first.num_qo_heads, kv_heads=first.num_kv_heads,
            head_dim=first.head_dim, intermediate=model.config.intermediate_size,
            eps=model.config.rms_norm_eps, scale=first.sm_scale)
        final = model.model.norm
        final_norm = final.weight if type(final) is RMSNorm and final.eps == model.config.rms_norm_eps else None
        return decoder.DecoderWeights(layers, shape, dtype, final_norm)
    except (ValueError, IndexError):
        return None  # a layout the kernel does not take: the per-layer path runs it


def layer_rows(model: CausalLM, backend: AttentionBackend, x: Tensor,
               weights: decoder.DecoderWeights) -> list[PagedRows] | None:
    """Each layer's planned decode rows when this step can run in the kernel, else None."""
    if x.dtype != weights.dtype or not x.is_cpu or (
            x.dtype == torch.bfloat16 and x.shape[0] > linear_kernel.BF16_MAX_ROWS):
        return None
    by_window: dict[int | None, PagedRows | None] = {w: backend.cpu_decode_rows(w) for w in model.attention_windows}
    if any(rows is None for rows in by_window.values()):
        return None
    return [by_window[w] for w in model.layer_windows]  # type: ignore[misc]
