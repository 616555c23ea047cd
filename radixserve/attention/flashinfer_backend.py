"""Paged attention with FlashInfer's batch kernels (CUDA only; `pip install radixserve[gpu]`).

`plan` schedules the step once: the decode wrapper when every sequence has one new token,
the prefill wrapper (causal, bottom-right aligned) otherwise; each layer's `forward` runs
the planned kernel on its own caches. FlashInfer is imported lazily, so this module imports
on machines without it.

Host tensors. FlashInfer's `plan` builds its schedule on the CPU: it copies the index
pointers and last-page lengths to the host (`.to("cpu")`) and the page indices to the
device. Handing it device tensors would make each step copy them back, a device-to-host
copy that waits for every kernel queued before it. So the indptrs and last-page lengths come
from the metadata's host arrays (`meta.host`, int32 CPU tensors sharing their memory) and
only `kv_indices` is a device tensor.

Tensor cores for decode. FlashInfer's decode kernels run on CUDA cores; with
`use_tensor_cores=True` the decode wrapper runs its prefill kernels instead, which process
the query heads of a KV head group together on tensor cores. That pays once the group is
large enough to fill an MMA tile: FlashInfer's documentation says tensor cores are faster
"for large group size", and SGLang and vLLM switch them on for 16-bit KV caches when the
group size (query heads / KV heads) exceeds 4 (`TENSOR_CORE_MIN_GROUP`). So Llama-3-8B and
Mistral-7B (32/8 = 4) decode on CUDA cores, Qwen2.5-7B (28/4 = 7) and Llama-3-70B (64/8 = 8)
on tensor cores.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from radixserve.attention.base import FLASHINFER_UNAVAILABLE, AttentionBackend, AttentionMetadata

WORKSPACE_BYTES = 128 * 1024 * 1024
TENSOR_CORE_MIN_GROUP = 5  # decode on tensor cores when query heads / KV heads >= this


def decode_uses_tensor_cores(num_qo_heads: int, num_kv_heads: int) -> bool:
    """Whether decode runs FlashInfer's tensor-core kernels for this head layout."""
    return num_qo_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP


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
        self._flashinfer = flashinfer
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode: dict[bool, Any] = {}  # by use_tensor_cores, made on first use
        self._planned: Any = None
        self._planned_scale = 1.0

    def _decode_wrapper(self, tensor_cores: bool) -> Any:
        if tensor_cores not in self._decode:
            self._decode[tensor_cores] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=tensor_cores)
        return self._decode[tensor_cores]

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
        host = meta.host
        kv_indptr = torch.from_numpy(host.kv_indptr)  # int32, CPU: see the module docstring
        last_page_len = torch.from_numpy(host.kv_last_page_len)
        if meta.is_decode:
            wrapper = self._decode_wrapper(decode_uses_tensor_cores(num_qo_heads, num_kv_heads))
            wrapper.plan(
                kv_indptr,
                meta.kv_indices,
                last_page_len,
                num_qo_heads,
                num_kv_heads,
                head_dim,
                meta.page_size,
                q_data_type=dtype,
                kv_data_type=dtype,
                sm_scale=self._planned_scale,
            )
            self._planned = wrapper
        else:
            self._prefill.plan(
                torch.from_numpy(host.qo_indptr),
                kv_indptr,
                meta.kv_indices,
                last_page_len,
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
