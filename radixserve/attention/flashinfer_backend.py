"""Paged attention with FlashInfer's batch kernels (CUDA only; `pip install radixserve[gpu]`).

`plan` schedules the step once: the decode wrapper when every sequence has one new token,
the prefill wrapper (causal, bottom-right aligned) otherwise; each layer's `forward` runs
the planned kernel on its own caches. FlashInfer is imported lazily, so this module imports
on machines without it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from radixserve.attention.base import FLASHINFER_UNAVAILABLE, AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    """BatchPrefill/BatchDecodeWithPagedKVCacheWrapper over NHD caches, sharing one workspace."""

    def __init__(self, device: str | torch.device) -> None:
        try:
            import flashinfer
        except ImportError as exc:
            raise RuntimeError(FLASHINFER_UNAVAILABLE) from exc
        device = torch.device(device)
        if device.type != "cuda":
            raise RuntimeError(FLASHINFER_UNAVAILABLE)
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._planned: Any = None
        self._planned_scale = 1.0

    def plan(
        self,
        meta: AttentionMetadata,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        """Plan the decode or prefill wrapper for this step's batch layout."""
        # The softmax scale is fixed at plan time in FlashInfer but given per forward in our
        # interface: plan with the usual 1/sqrt(d) and rescale q in forward if it differs.
        self._planned_scale = 1.0 / math.sqrt(head_dim)
        if meta.is_decode:
            self._decode.plan(
                meta.kv_indptr,
                meta.kv_indices,
                meta.kv_last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                meta.page_size,
                q_data_type=dtype,
                kv_data_type=dtype,
                sm_scale=self._planned_scale,
            )
            self._planned = self._decode
        else:
            self._prefill.plan(
                meta.qo_indptr,
                meta.kv_indptr,
                meta.kv_indices,
                meta.kv_last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                meta.page_size,
                causal=True,
                q_data_type=dtype,
                kv_data_type=dtype,
                sm_scale=self._planned_scale,
            )
            self._planned = self._prefill

    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, sm_scale: float) -> Tensor:
        """See `AttentionBackend.forward`."""
        if self._planned is None:
            raise RuntimeError("FlashInferBackend.forward called before plan()")
        if not math.isclose(sm_scale, self._planned_scale, rel_tol=1e-6):
            q = q * (sm_scale / self._planned_scale)
        return self._planned.run(q.contiguous(), (k_cache, v_cache))
