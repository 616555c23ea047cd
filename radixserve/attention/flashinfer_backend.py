"""Paged attention with FlashInfer's batch kernels (CUDA only; `pip install radixserve[gpu]`).

`plan` schedules the step once: the decode wrapper when every sequence has one new token,
the prefill wrapper (causal, bottom-right aligned) otherwise; each layer's `forward` runs
the planned kernel on its own caches. FlashInfer is imported lazily, so this module imports
on machines without it.

Host tensors. FlashInfer's `plan` builds its schedule on the CPU: it copies the index
pointers and last-page lengths in CPU memory (`.to("cpu")`) and the page indices to the
device. Handing it device tensors would make each step copy them back, a device-to-host
copy that waits for every kernel queued before it. So the indptrs and last-page lengths come
from the metadata's CPU arrays (`meta.cpu`, int32 CPU tensors sharing their memory) and
only `kv_indices` is a device tensor.

Tensor cores for decode. FlashInfer's decode kernels run on CUDA cores; with
`use_tensor_cores=True` the decode wrapper runs its prefill kernels instead, which process
the query heads of a KV head group together on tensor cores. That pays once the group is
large enough to fill an MMA tile: FlashInfer's documentation says tensor cores are faster
"for large group size", and SGLang and vLLM switch them on for 16-bit KV caches when the
group size (query heads / KV heads) exceeds 4 (`TENSOR_CORE_MIN_GROUP`). So Llama-3-8B and
Mistral-7B (32/8 = 4) decode on CUDA cores, Qwen2.5-7B (28/4 = 7) and Llama-3-70B (64/8 = 8)
on tensor cores.

Sliding windows. FlashInfer takes the window at plan time (`window_left`: how many keys left
of the query's own it sees, so W - 1 for transformers' window W) and a wrapper holds one
plan, so each window the layers use gets its own wrappers, planned every step over the same
pages; they share the float workspace (kernels run one after the other on one stream) and
each has its own small integer workspace, as in SGLang's sliding-window setup. A model with
full and windowed layers (Qwen2 with `max_window_layers`) plans two.

FA2 prefill kernels, named. The prefill wrapper is made with `backend="fa2"`: left at "auto",
it picks the FA3 kernels on Hopper: another code path (CUTLASS, its own numerics) than
on every other GPU, and a just-in-time build several times longer per variant. SGLang's
FlashInfer backend names FA2 in the same way (it serves FA3 through a backend of its own).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
        # Made on first use: by (window, "prefill") or (window, "decode", use_tensor_cores).
        self._wrappers: dict[tuple, Any] = {}
        self._planned: dict[int | None, Any] = {}  # window -> the wrapper planned this step
        self._planned_scale = 1.0

    def _wrapper(self, window: int | None, decode: bool, tensor_cores: bool) -> Any:
        key = (window, "decode", tensor_cores) if decode else (window, "prefill")
        if key not in self._wrappers:
            fi = self._flashinfer
            self._wrappers[key] = (
                fi.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=tensor_cores)
                if decode else fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2"))
        return self._wrappers[key]

    def plan(
        self,
        meta: AttentionMetadata,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        """Plan the decode or prefill wrapper of each window for this step's batch layout."""
        # The softmax scale is fixed at plan time in FlashInfer but given per forward in our
        # interface: plan with the usual 1/sqrt(d) and rescale q in forward if it differs.
        self._planned_scale = 1.0 / math.sqrt(head_dim)
        cpu = meta.cpu
        kv_indptr = torch.from_numpy(cpu.kv_indptr)  # int32, CPU: see the module docstring
        last_page_len = torch.from_numpy(cpu.kv_last_page_len)
        tensor_cores = decode_uses_tensor_cores(num_qo_heads, num_kv_heads)
        self._planned = {}
        for window in dict.fromkeys(windows):
            if window is not None and window < 1:
                raise ValueError(f"a sliding window must be >= 1 token, got {window}")
            window_left = -1 if window is None else window - 1  # keys left of the query's own
            wrapper = self._wrapper(window, meta.is_decode, tensor_cores)
            common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=self._planned_scale,
                          window_left=window_left)
            if meta.is_decode:
                wrapper.plan(kv_indptr, meta.kv_indices, last_page_len, num_qo_heads, num_kv_heads,
                             head_dim, meta.page_size, **common)
            else:
                wrapper.plan(torch.from_numpy(cpu.qo_indptr), kv_indptr, meta.kv_indices, last_page_len,
                             num_qo_heads, num_kv_heads, head_dim, meta.page_size, causal=True, **common)
            self._planned[window] = wrapper

    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, sm_scale: float,
                window: int | None = None) -> Tensor:
        """See `AttentionBackend.forward`."""
        if not self._planned:
            raise RuntimeError("FlashInferBackend.forward called before plan()")
        if window not in self._planned:
            raise RuntimeError(f"FlashInferBackend.forward: window {window} was not planned")
        if not math.isclose(sm_scale, self._planned_scale, rel_tol=1e-6):
            q = q * (sm_scale / self._planned_scale)
        return self._planned[window].run(q.contiguous(), (k_cache, v_cache))
