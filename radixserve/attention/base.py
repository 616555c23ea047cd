"""The batch metadata every attention backend reads, and the backend interface.

A step's batch is B sequences. Sequence b has `kv_lens[b]` tokens whose K/V live in pages
(`block_tables[b]`, FlashInfer's NHD layout: each layer's cache is
`[num_pages, page_size, num_kv_heads, head_dim]`), of which the last `num_new_tokens[b]` are
computed in this step. The model writes the new tokens' K/V into their slots first
(`write_kv`), then every query attends over all `kv_lens[b]` keys of its sequence, causally,
bottom-right aligned: query j of a sequence with Lq new and L total tokens sees keys
0 .. L - Lq + j.

Sliding window. A layer with window W attends as transformers' sliding-window mask does
(`kv_idx > q_idx - W`): the query at position p sees keys p - W + 1 .. p, its own included,
W at most. Backends are planned for the set of windows the model's layers use and each
layer's `forward` names its own. A sequence whose leading pages fell out of every layer's
window (the scheduler released them) lists only the pages it still holds: `kv_lens[b]`
counts the keys in those pages and `positions` stay absolute (see
`AttentionMetadata.from_page_arrays`, `kv_offsets`). Masks are relative to the last key, so
attention over the held pages equals attention over the whole sequence for every windowed
layer; a model with any full-attention layer never releases pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

if TYPE_CHECKING:
    from radixserve.native.paged_attention import PagedRows


@dataclass
class CpuIndices:
    """The step's index arrays in CPU memory (numpy), for whatever plans on the CPU.

    Backends plan from these rather than from the device tensors: on a GPU, reading a device
    tensor back would stall the CPU until the device catches up.
    """

    qo_indptr: np.ndarray  # int32 [B+1]
    kv_indptr: np.ndarray  # int32 [B+1]
    kv_indices: np.ndarray  # int32 [nnz]
    kv_last_page_len: np.ndarray  # int32 [B]
    kv_lens: np.ndarray  # int64 [B]: keys in the listed pages after this step's writes
    qo_lens: np.ndarray  # int64 [B]: new tokens
    kv_offsets: np.ndarray  # int64 [B]: tokens before the first listed page (released), usually 0


@dataclass
class AttentionMetadata:
    """Where a step's tokens come from and go to; built once per step, shared by all layers.

    Index tensors follow FlashInfer's paged-KV conventions and are int32; `positions` and
    `slot_mapping` are int64 (they index tensors directly). `cpu` holds the same indices as
    numpy arrays in CPU memory.
    """

    qo_indptr: Tensor  # int32 [B+1]: sequence b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: Tensor  # int32 [B+1]: sequence b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: Tensor  # int32 [nnz]: the pages, concatenated in logical order
    kv_last_page_len: Tensor  # int32 [B]: tokens in each last page, 1..page_size (0: no tokens)
    positions: Tensor  # int64 [T]: position of each new token in its sequence
    slot_mapping: Tensor  # int64 [T]: page * page_size + offset where its K/V are written
    page_size: int
    is_decode: bool  # every sequence has exactly one new token
    cpu: CpuIndices

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
        Raises ValueError on inconsistent inputs. (The engine's runner keeps the tables as
        arrays between steps instead: `radixserve.attention.metadata.MetadataBuilder`.)
        """
        if not len(block_tables) == len(kv_lens) == len(num_new_tokens):
            raise ValueError(
                f"block_tables, kv_lens and num_new_tokens differ in length: "
                f"{len(block_tables)}, {len(kv_lens)}, {len(num_new_tokens)}"
            )
        kv = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
        pages_needed = -(-kv // max(page_size, 1))
        tables = [
            np.fromiter(table[:n], dtype=np.int32, count=n) if n <= len(table) else None
            for table, n in zip(block_tables, pages_needed.tolist())
        ]
        for b, table in enumerate(tables):
            if table is None:
                raise ValueError(
                    f"sequence {b}: {kv[b]} tokens need {pages_needed[b]} pages of {page_size}, "
                    f"block table has {len(block_tables[b])}"
                )
        return cls.from_page_arrays(tables, kv, np.asarray(num_new_tokens, dtype=np.int64),
                                    page_size, device)

    @classmethod
    def from_page_arrays(
        cls,
        tables: Sequence[np.ndarray],
        kv_lens: np.ndarray,
        qo_lens: np.ndarray,
        page_size: int,
        device: str | torch.device,
        kv_offsets: np.ndarray | None = None,
    ) -> AttentionMetadata:
        """The metadata of sequences whose used pages are given as int32 arrays, exactly
        ceil(kv_len / page_size) each; vectorised over the batch (numpy on the CPU, one copy
        per tensor to the device).

        `kv_offsets[b]` (a multiple of page_size; default 0) counts sequence b's tokens
        before its first listed page: pages released out of a sliding window. `kv_lens`
        then counts the keys in the listed pages only, and `positions` add the offset back.
        """
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        kv_lens = kv_lens.reshape(-1)
        qo_lens = qo_lens.reshape(-1)
        bad = np.flatnonzero((qo_lens < 0) | (qo_lens > kv_lens))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"sequence {b}: need 0 <= num_new_tokens ({qo_lens[b]}) <= kv_len ({kv_lens[b]})"
            )
        num_seqs = len(kv_lens)
        pages_per_seq = np.fromiter(map(len, tables), dtype=np.int64, count=num_seqs)
        kv_indices = np.concatenate(tables) if num_seqs else np.zeros(0, np.int32)
        qo_indptr = _indptr(qo_lens)
        kv_indptr = _indptr(pages_per_seq)
        last_page_len = np.where(kv_lens > 0, kv_lens - np.maximum(pages_per_seq - 1, 0) * page_size, 0)
        is_decode = num_seqs > 0 and bool((qo_lens == 1).all())
        if is_decode:
            positions = kv_lens - 1
            seq_of_token = np.arange(num_seqs)
        else:
            # Each new token's sequence, then its position and the slot its K/V go to.
            seq_of_token = np.repeat(np.arange(num_seqs), qo_lens)
            starts = (kv_lens - qo_lens - qo_indptr[:-1])[seq_of_token]
            positions = np.arange(len(seq_of_token), dtype=np.int64) + starts
        pages_of_token = kv_indices[kv_indptr[seq_of_token] + positions // page_size].astype(np.int64)
        slot_mapping = pages_of_token * page_size + positions % page_size
        if kv_offsets is not None:
            positions = positions + kv_offsets.reshape(-1)[seq_of_token]

        cpu = CpuIndices(
            qo_indptr=qo_indptr.astype(np.int32), kv_indptr=kv_indptr.astype(np.int32),
            kv_indices=kv_indices.astype(np.int32, copy=False),
            kv_last_page_len=last_page_len.astype(np.int32), kv_lens=kv_lens.astype(np.int64),
            qo_lens=qo_lens.astype(np.int64),
            kv_offsets=np.zeros(num_seqs, np.int64) if kv_offsets is None else kv_offsets.astype(np.int64),
        )

        def on_device(array: np.ndarray) -> Tensor:
            return torch.from_numpy(array).to(device)

        return cls(
            qo_indptr=on_device(cpu.qo_indptr),
            kv_indptr=on_device(cpu.kv_indptr),
            kv_indices=on_device(cpu.kv_indices),
            kv_last_page_len=on_device(cpu.kv_last_page_len),
            positions=on_device(np.ascontiguousarray(positions, dtype=np.int64)),
            slot_mapping=on_device(slot_mapping),
            page_size=page_size,
            is_decode=is_decode,
            cpu=cpu,
        )


def _indptr(lengths: np.ndarray) -> np.ndarray:
    """[0, l0, l0+l1, ...] as int64."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


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
        windows: Sequence[int | None] = (None,),
    ) -> None:
        """Prepare everything that depends only on the batch layout (indices, masks, kernel
        schedules) so that each layer's `forward` does only the attention itself.
        `dtype` is the dtype of the queries and of the K/V caches; `windows` the sliding
        windows the layers use (None: full attention), each planned once."""

    @abstractmethod
    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, sm_scale: float,
                window: int | None = None) -> Tensor:
        """Attention of the step's queries over their sequences' paged K/V.

        q: [T, num_qo_heads, head_dim], the new tokens of all sequences concatenated in
        `qo_indptr` order. k_cache, v_cache: [num_pages, page_size, num_kv_heads, head_dim],
        already holding the new tokens' K/V. Softmax of `sm_scale * q.k`, causal and
        bottom-right aligned, grouped-query when num_qo_heads > num_kv_heads; with `window`
        W (one of the planned windows), only the last W keys up to each query's own.
        Returns [T, num_qo_heads, head_dim] in q's dtype.
        """

    def cpu_decode_rows(self, window: int | None = None) -> PagedRows | None:
        """The planned step's rows for the CPU paged-attention kernel at `window` when every
        row of the step is one of them (all sequences decode through the kernel), else None.
        The model then runs its whole layer stack in C (`radixserve.native.decoder`) with the
        same kernel; backends without it return None."""
        return None


def write_kv(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, slot_mapping: Tensor) -> None:
    """Store new tokens' K/V ([T, num_kv_heads, head_dim]) at their flat slots
    (page * page_size + offset) of one layer's caches."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    # index_copy_ of flat rows: several times faster on the CPU than an index_put.
    row = num_kv_heads * head_dim
    k_cache.view(-1, row).index_copy_(0, slot_mapping, k.reshape(-1, row).to(k_cache.dtype))
    v_cache.view(-1, row).index_copy_(0, slot_mapping, v.reshape(-1, row).to(v_cache.dtype))


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
