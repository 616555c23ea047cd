"""Factual check of cached K/V: recompute a token prefix and compare with the stored pages.

A page table can be structurally perfect and still point at another request's data; the only
proof that cached pages hold the right K/V is to compute them again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.attention.torch_backend import TorchBackend
from radixserve.models.llama import CausalLM


def default_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) that absorb batch-shape-dependent rounding but not wrong data."""
    if dtype == torch.float32:
        return 1e-3, 1e-3
    return 5e-2, 5e-2


def verify_cached_kv(
    model: CausalLM,
    k_caches: list[Tensor],
    v_caches: list[Tensor],
    tokens: Sequence[int],
    pages: Sequence[int],
    page_size: int,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    backend: AttentionBackend | None = None,
) -> int | None:
    """Index into `pages` of the first page whose stored K/V differ from a fresh computation.

    `pages[i]` is expected to hold tokens[i*page_size:(i+1)*page_size] (the last page may be
    partial; slots past the tokens are ignored). The fresh forward runs the whole prefix in
    one step into scratch pages with `backend` (default: the torch backend), so it does not
    depend on how the stored pages were produced. Returns None when every page matches within
    |stored - fresh| <= atol + rtol * |fresh| in every layer (defaults: `default_tolerances`).
    """
    num_tokens = len(tokens)
    num_pages = -(-num_tokens // page_size)
    if len(pages) < num_pages:
        raise ValueError(
            f"{num_tokens} tokens need {num_pages} pages of {page_size}, got {len(pages)}"
        )
    if num_tokens == 0:
        return None
    device, dtype = k_caches[0].device, k_caches[0].dtype
    default_atol, default_rtol = default_tolerances(dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol

    shape = (num_pages, page_size, model.num_kv_heads, model.head_dim)
    fresh_k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    fresh_v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    meta = AttentionMetadata.build(
        [range(num_pages)], [num_tokens], [num_tokens], page_size, device
    )
    backend = backend or TorchBackend()
    model.plan_attention(backend, meta, dtype)
    model(
        torch.tensor(list(tokens), dtype=torch.int64, device=device),
        meta,
        backend,
        fresh_k,
        fresh_v,
        torch.tensor([num_tokens - 1], device=device),
    )

    page_ids = torch.tensor(list(pages[:num_pages]), dtype=torch.int64, device=device)
    slot_positions = torch.arange(num_pages * page_size, device=device).view(num_pages, page_size)
    slot_used = slot_positions < num_tokens
    page_differs = torch.zeros(num_pages, dtype=torch.bool, device=device)
    for stored_caches, fresh_caches in ((k_caches, fresh_k), (v_caches, fresh_v)):
        for stored_cache, fresh in zip(stored_caches, fresh_caches, strict=True):
            stored = stored_cache[page_ids].float()
            fresh = fresh.float()
            # `~(diff <= tol)` rather than `diff > tol`: a NaN in a stored page is a mismatch.
            bad_slots = (~((stored - fresh).abs() <= atol + rtol * fresh.abs())).flatten(2).any(-1)
            page_differs |= (bad_slots & slot_used).any(-1)
    differing = page_differs.nonzero()
    return int(differing[0]) if differing.numel() else None
