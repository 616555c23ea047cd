"""Reference paged attention in plain torch: runs on any device, takes FlashInfer's inputs.

Once per step `plan` turns the page indices into padded batches: for each sequence the flat
slot ids of its keys (padded to the longest sequence), the rows of its queries (padded to the
most new tokens) and a boolean mask (causal, bottom-right aligned, padding masked). Decoding
sequences (one new token) and prefilling ones (several) form two separate groups, so a long
prefill chunk in a step of many decodes does not pad every decode to the chunk's length.
Each layer's `forward` is then, per group, one gather of K and V, one
`scaled_dot_product_attention` and one scatter of the real rows; no Python loop over
sequences or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from radixserve.attention.base import AttentionBackend, AttentionMetadata


@dataclass
class _PaddedGroup:
    """Index tensors for attention over a group of B sequences, padded to [B, Q] queries and
    [B, K] keys."""

    kv_slots: Tensor  # int64 [B, K]: flat cache slot of each key
    q_rows: Tensor  # int64 [B, Q]: row of q for each query
    mask: Tensor  # bool [B, 1, Q, K]: True where the query sees the key
    real: Tensor  # int64 [n]: positions in the flattened [B * Q] that are real queries
    out_rows: Tensor  # int64 [n]: the output rows those real queries fill


class TorchBackend(AttentionBackend):
    """Paged attention via gather + SDPA; the default everywhere but CUDA with FlashInfer."""

    def __init__(self) -> None:
        self._groups: list[_PaddedGroup] | None = None

    def plan(
        self,
        meta: AttentionMetadata,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        """Build the gather indices and masks for this step (shapes and dtype unused)."""
        qo_indptr = meta.qo_indptr.long()
        kv_indptr = meta.kv_indptr.long()
        qo_lens = qo_indptr.diff()
        pages = kv_indptr.diff()
        kv_lens = torch.where(pages > 0, (pages - 1) * meta.page_size + meta.kv_last_page_len, 0)
        self._groups = []
        # Sequences without new tokens need no attention and belong to no group.
        for members in (qo_lens == 1, qo_lens > 1):
            seq_ids = members.nonzero().squeeze(1)
            if seq_ids.numel():
                self._groups.append(
                    _pad_group(
                        qo_indptr[seq_ids],
                        qo_lens[seq_ids],
                        kv_indptr[seq_ids],
                        kv_lens[seq_ids],
                        meta.kv_indices.long(),
                        meta.page_size,
                    )
                )

    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, sm_scale: float) -> Tensor:
        """See `AttentionBackend.forward`."""
        if self._groups is None:
            raise RuntimeError("TorchBackend.forward called before plan()")
        num_qo_heads, head_dim = q.shape[1:]
        num_kv_heads = k_cache.shape[2]
        keys = k_cache.view(-1, num_kv_heads, head_dim)
        values = v_cache.view(-1, num_kv_heads, head_dim)
        out = torch.empty_like(q)
        for group in self._groups:
            attended = F.scaled_dot_product_attention(
                q[group.q_rows].transpose(1, 2),  # [B, Hq, Q, D]
                keys[group.kv_slots].transpose(1, 2),  # [B, Hkv, K, D]
                values[group.kv_slots].transpose(1, 2),
                attn_mask=group.mask,
                scale=sm_scale,
                enable_gqa=num_qo_heads != num_kv_heads,
            )
            rows = attended.transpose(1, 2).reshape(-1, num_qo_heads, head_dim)
            out[group.out_rows] = rows[group.real]
        return out


def _pad_group(
    q_start: Tensor,
    q_lens: Tensor,
    page_start: Tensor,
    kv_lens: Tensor,
    kv_indices: Tensor,
    page_size: int,
) -> _PaddedGroup:
    """Padded indices for sequences that each have >= 1 new token (hence >= 1 key)."""
    device = q_lens.device
    key_pos = torch.arange(int(kv_lens.max()), device=device)
    key_valid = key_pos < kv_lens[:, None]  # [B, K]
    # Padding keys re-read their sequence's last key: it was written, so it is finite, and a
    # never-written slot (NaN garbage) cannot leak through a masked-out position.
    readable_pos = torch.minimum(key_pos, kv_lens[:, None] - 1)
    kv_slots = (
        kv_indices[page_start[:, None] + readable_pos // page_size] * page_size
        + readable_pos % page_size
    )
    q_offset = torch.arange(int(q_lens.max()), device=device)
    q_valid = q_offset < q_lens[:, None]  # [B, Q]
    # Padding queries repeat their sequence's last query; their outputs are dropped.
    q_rows = q_start[:, None] + torch.minimum(q_offset, q_lens[:, None] - 1)
    # Query j of a sequence with Lq new and L total tokens sees keys 0 .. L - Lq + j (padding
    # queries see all keys, so no softmax row is empty).
    last_visible = (kv_lens - q_lens)[:, None] + q_offset  # [B, Q]
    mask = (key_pos <= last_visible[:, :, None]) & key_valid[:, None, :]
    real = q_valid.flatten().nonzero().squeeze(1)
    return _PaddedGroup(
        kv_slots=kv_slots,
        q_rows=q_rows,
        mask=mask[:, None],
        real=real,
        out_rows=q_rows.flatten()[real],
    )
