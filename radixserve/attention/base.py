"""The batch metadata every attention backend reads, and the backend interface.

A step's batch is B sequences. Sequence b has `kv_lens[b]` tokens whose K/V live in pages
(`block_tables[b]`, FlashInfer's NHD layout: each layer's cache is
`[num_pages, page_size, num_kv_heads, head_dim]`), of which the last `num_new_tokens[b]` are
computed in this step. The model writes the new tokens' K/V into their slots first
(`write_kv`), then every query attends over all `kv_lens[b]` keys of its sequence, causally,
bottom-right aligned: query j of a sequence with Lq new and L total tokens sees keys
0 .. L - Lq + j.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class AttentionMetadata:
    """Where a step's tokens come from and go to; built once per step, shared by all layers.

    Index tensors follow FlashInfer's paged-KV conventions and are int32; `positions` and
    `slot_mapping` are int64 (they index tensors directly).
    """

    qo_indptr: Tensor  # int32 [B+1]: sequence b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: Tensor  # int32 [B+1]: sequence b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: Tensor  # int32 [nnz]: the pages, concatenated in logical order
    kv_last_page_len: Tensor  # int32 [B]: tokens in each last page, 1..page_size (0: no tokens)
    positions: Tensor  # int64 [T]: position of each new token in its sequence
    slot_mapping: Tensor  # int64 [T]: page * page_size + offset where its K/V are written
    page_size: int
    is_decode: bool  # every sequence has exactly one new token

    @property
    def batch_size(self) -> int:
        """Number of sequences B."""
        return self.kv_last_page_len.shape[0]

    @property
    def num_tokens(self) -> int:
        """Number of new tokens T over the whole batch."""
        return self.positions.shape[0]

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        kv_lens: Sequence[int],
        num_new_tokens: Sequence[int],
        page_size: int,
        device: str | torch.device,
    ) -> AttentionMetadata:
        """Compute a step's metadata from per-sequence block tables and lengths.

        `kv_lens[b]` counts every token of sequence b whose K/V are in its pages after this
        step's writes, so it includes the `num_new_tokens[b]` new ones (0 is allowed: a
        sequence with nothing to compute). A block table may list more pages than the tokens
        need (pages allocated ahead); only the first ceil(kv_len / page_size) are used.
        Raises ValueError on inconsistent inputs.
        """
        if not len(block_tables) == len(kv_lens) == len(num_new_tokens):
            raise ValueError(
                f"block_tables, kv_lens and num_new_tokens differ in length: "
                f"{len(block_tables)}, {len(kv_lens)}, {len(num_new_tokens)}"
            )
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        used_tables: list[Sequence[int]] = []
        for b, (table, kv_len, new) in enumerate(zip(block_tables, kv_lens, num_new_tokens)):
            if not 0 <= new <= kv_len:
                raise ValueError(
                    f"sequence {b}: need 0 <= num_new_tokens ({new}) <= kv_len ({kv_len})"
                )
            num_pages = -(-kv_len // page_size)
            if len(table) < num_pages:
                raise ValueError(
                    f"sequence {b}: {kv_len} tokens need {num_pages} pages of {page_size}, "
                    f"block table has {len(table)}"
                )
            used_tables.append(table[:num_pages])

        kv_lens_t = torch.tensor(kv_lens, dtype=torch.int64)
        qo_lens = torch.tensor(num_new_tokens, dtype=torch.int64)
        pages_per_seq = torch.tensor([len(t) for t in used_tables], dtype=torch.int64)
        kv_indices = torch.tensor(
            list(itertools.chain.from_iterable(used_tables)), dtype=torch.int64
        )
        qo_indptr = _indptr(qo_lens)
        kv_indptr = _indptr(pages_per_seq)
        last_page_len = torch.where(
            kv_lens_t > 0, kv_lens_t - (pages_per_seq - 1).clamp(min=0) * page_size, 0
        )

        # Each new token's sequence, then its position and the slot its K/V go to.
        seq_of_token = torch.repeat_interleave(torch.arange(len(kv_lens)), qo_lens)
        num_tokens = int(qo_lens.sum())
        positions = (
            torch.arange(num_tokens)
            - qo_indptr[seq_of_token]
            + (kv_lens_t - qo_lens)[seq_of_token]
        )
        pages_of_token = kv_indices[kv_indptr[seq_of_token] + positions // page_size]
        slot_mapping = pages_of_token * page_size + positions % page_size

        return cls(
            qo_indptr=qo_indptr.to(device=device, dtype=torch.int32),
            kv_indptr=kv_indptr.to(device=device, dtype=torch.int32),
            kv_indices=kv_indices.to(device=device, dtype=torch.int32),
            kv_last_page_len=last_page_len.to(device=device, dtype=torch.int32),
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            page_size=page_size,
            is_decode=len(num_new_tokens) > 0 and all(n == 1 for n in num_new_tokens),
        )


def _indptr(lengths: Tensor) -> Tensor:
    """[0, l0, l0+l1, ...] as int64."""
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


class AttentionBackend(ABC):
    """Paged attention over the page-index contract of `AttentionMetadata`.

    Per step the caller invokes `plan` once, then `forward` once per layer (each layer has its
    own caches; the metadata and head shapes are the same for all layers).
    """

    @abstractmethod
    def plan(
        self,
        meta: AttentionMetadata,
        *,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> None:
        """Prepare everything that depends only on the batch layout (indices, masks, kernel
        schedules) so that each layer's `forward` does only the attention itself.
        `dtype` is the dtype of the queries and of the K/V caches."""

    @abstractmethod
    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, sm_scale: float) -> Tensor:
        """Attention of the step's queries over their sequences' paged K/V.

        q: [T, num_qo_heads, head_dim], the new tokens of all sequences concatenated in
        `qo_indptr` order. k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim],
        already holding the new tokens' K/V. Softmax of `sm_scale * q.k`, causal and
        bottom-right aligned, grouped-query when num_qo_heads > num_kv_heads.
        Returns [T, num_qo_heads, head_dim] in q's dtype.
        """


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store new tokens' K/V ([T, num_kv_heads, head_dim]) at their flat slots
    (page * page_size + offset) of one layer's caches."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v


FLASHINFER_UNAVAILABLE = "the flashinfer backend needs CUDA and `pip install radixserve[gpu]`"


def flashinfer_available() -> bool:
    """Whether the `flashinfer` package imports (says nothing about a GPU being present)."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)  # its prefill kernels load 16-bit tiles only


def create_backend(name: str | None, device: str | torch.device,
                   dtype: torch.dtype | None = None) -> AttentionBackend:
    """The attention backend `name` ("torch" or "flashinfer") for `device` and model `dtype`.

    None picks "flashinfer" when the device is CUDA, FlashInfer imports and the dtype is
    float16 or bfloat16 (its kernels take no float32), else "torch". Asking for "flashinfer"
    without CUDA and FlashInfer raises RuntimeError, with float32 ValueError; an unknown
    name, ValueError.
    """
    device = torch.device(device)
    if name is None:
        usable = dtype is None or dtype in FLASHINFER_DTYPES
        name = "flashinfer" if device.type == "cuda" and usable and flashinfer_available() else "torch"
    if name == "flashinfer" and dtype is not None and dtype not in FLASHINFER_DTYPES:
        raise ValueError(f"the flashinfer backend runs float16 or bfloat16 models, not {dtype}; "
                         "use --dtype bfloat16 or the torch backend")
    if name == "torch":
        from radixserve.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "flashinfer":
        if device.type != "cuda" or not torch.cuda.is_available() or not flashinfer_available():
            raise RuntimeError(FLASHINFER_UNAVAILABLE)
        from radixserve.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'flashinfer'")
