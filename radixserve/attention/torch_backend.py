"""Reference paged attention in plain torch: runs on any device, takes FlashInfer's inputs.

Decoding sequences on the CPU in float32 run the compiled kernel of
`radixserve.native.paged_attention`, which reads their keys and values in place from the
pages: faster than gathering them (docs/benchmark.md), and no copy of the cache however large
the batch. Its rows are checked once per step in `plan` and its tensors on every call, so a
page index past the pool raises ValueError instead of reading other memory. Everything else,
and decoding where the kernel is unavailable (another device or dtype, no C compiler, `RADIXSERVE_CPU_KERNEL=0`), takes
the path below.

Torch has no paged-attention kernel, so each layer gathers the keys and values a sequence
attends to and calls `scaled_dot_product_attention`. What this backend avoids is the cost
around that:

- *No padding to the longest sequence.* `plan` sorts the sequences with new tokens by
  length and cuts them into groups whose padded size is at most `MAX_PADDING` above the real
  one (decoding sequences and prefill chunks apart), so a batch of short decodes next to one
  long prompt does not pad every decode to the prompt's length.
- *Cheap, bounded gathers.* Keys and values are gathered with `index_select` on the flat
  slot view (advanced indexing on the 3-D cache is much slower on the CPU) into
  workspace buffers reused across layers and steps (fresh multi-megabyte buffers cost page
  faults on every layer), and a group never gathers more than `MAX_GATHER_ELEMENTS`.
- *No GQA copies, no mask when none is needed.* A decode group folds each KV head's query
  heads into the query axis (`[n, Hkv, group, D]` against `[n, Hkv, K, D]`), so K/V are never
  repeated per query head, and runs without a mask when its sequences are equally long.
  Fresh prompts (no cached prefix) are grouped by exact length and use SDPA's `is_causal`,
  which skips the masked half of the scores.

Padding keys re-read their sequence's last written key and padding queries repeat its last
query; both are masked or dropped, and no never-written slot is ever read (the tests fill
caches with NaN, which would poison even a masked softmax). `plan` runs on the CPU from
`meta.cpu`, once per step; each layer's `forward` is one gather and one SDPA per group.

Sliding windows. `plan` builds one set of groups per window the layers use. A windowed set
gathers, per sequence, only the keys its first new query can see (from position
first - W + 1 on; a decode reads at most W keys, however long the sequence) and masks each
query to its own last W keys; fresh prompts no longer than W keep SDPA's causal mode, since
the window cannot cut them. Where the window cuts no sequence of the step, the full-attention
groups serve it too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from radixserve.attention.base import AttentionBackend, AttentionMetadata, CpuIndices
from radixserve.native import paged_attention

MAX_PADDING = 0.125  # a group's padded attention area may exceed its real area by this much
MAX_GATHER_ELEMENTS = 1 << 26  # per group, per K (and per V): 256 MiB in float32
MIN_CAUSAL_PROMPT = 16  # fresh prompts this long are grouped by exact length, unmasked


@dataclass
class _Group:
    """n sequences attended together: queries padded to Q rows each, keys to K."""

    num_seqs: int
    num_queries: int  # Q
    num_keys: int  # K
    q_rows: Tensor  # int64 [n * Q]: row of q for each (sequence, query)
    kv_slots: Tensor  # int64 [n * K]: flat cache slot of each (sequence, key)
    mask: Tensor | None  # bool [n, 1, Q, K]; None: every query sees every key
    causal: bool  # one sequence whose queries are all its keys: SDPA's own causal mask
    out_rows: Tensor  # int64 [m]: output rows of the real queries
    real: Tensor | None  # int64 [m]: their positions in the flattened [n * Q]; None: all


class TorchBackend(AttentionBackend):
    """Paged attention via the CPU kernel for decodes and grouped gathers + SDPA for the
    rest; the default everywhere but CUDA with FlashInfer. See the module docstring.

    `use_kernel=False` keeps every sequence on the gather path (to compare the two)."""

    def __init__(self, use_kernel: bool = True) -> None:
        self.use_kernel = use_kernel
        self._groups: dict[int | None, list[_Group]] | None = None  # by window
        self._kernel_rows: dict[int | None, paged_attention.PagedRows] = {}  # decodes, by window
        self._workspace: Tensor | None = None

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
        """Group the sequences and build their gather indices and masks for this step, once
        per window in `windows`."""
        cpu = meta.cpu
        row_elements = num_kv_heads * head_dim
        device = meta.positions.device
        kernel = (self.use_kernel and device.type == "cpu" and dtype in paged_attention.DTYPE_CODES
                  and paged_attention.library() is not None)
        groups: dict[int | None, list[_Group]] = {}
        kernel_rows: dict[int | None, paged_attention.PagedRows] = {}
        longest = int(cpu.kv_lens.max(initial=0))
        for window in sorted(set(windows), key=lambda w: (w is not None, w or 0)):
            if window is not None and window < 1:
                raise ValueError(f"a sliding window must be >= 1 token, got {window}")
            if window is not None and window >= longest and None in groups:
                groups[window] = groups[None]  # the window cuts no sequence of this step
                if None in kernel_rows:
                    kernel_rows[window] = kernel_rows[None]
                continue
            groups[window], rows = _plan_window(cpu, meta.page_size, device, row_elements, window, kernel)
            if rows is not None:
                kernel_rows[window] = rows
        self._groups = groups
        self._kernel_rows = kernel_rows

    def forward(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, *, sm_scale: float,
                window: int | None = None) -> Tensor:
        """See `AttentionBackend.forward`."""
        if self._groups is None:
            raise RuntimeError("TorchBackend.forward called before plan()")
        if window not in self._groups:
            raise RuntimeError(f"TorchBackend.forward: window {window} was not planned "
                               f"(planned: {sorted(self._groups, key=str)})")
        num_qo_heads, head_dim = q.shape[1:]
        num_kv_heads = k_cache.shape[2]
        group_size = num_qo_heads // num_kv_heads
        keys = k_cache.view(-1, num_kv_heads * head_dim)
        values = v_cache.view(-1, num_kv_heads * head_dim)
        out = torch.empty_like(q)
        rows = self._kernel_rows.get(window)
        if rows is not None:  # raises ValueError on tensors the kernel cannot read
            paged_attention.run(q, k_cache, v_cache, rows, out, scale=sm_scale)
        for group in self._groups[window]:
            n, num_q, num_k = group.num_seqs, group.num_queries, group.num_keys
            k_buf, v_buf = self._buffers(n * num_k * num_kv_heads * head_dim, k_cache)
            k = torch.index_select(keys, 0, group.kv_slots, out=k_buf.view(n * num_k, -1))
            v = torch.index_select(values, 0, group.kv_slots, out=v_buf.view(n * num_k, -1))
            k = k.view(n, num_k, num_kv_heads, head_dim).transpose(1, 2)  # [n, Hkv, K, D]
            v = v.view(n, num_k, num_kv_heads, head_dim).transpose(1, 2)
            queries = q.index_select(0, group.q_rows)
            if num_q == 1:
                # Fold each KV head's query heads into the query axis: no K/V repeat per head.
                attended = F.scaled_dot_product_attention(
                    queries.view(n, num_kv_heads, group_size, head_dim), k, v,
                    attn_mask=group.mask, scale=sm_scale,
                )  # [n, Hkv, G, D]
                rows = attended.reshape(n, num_qo_heads, head_dim)
            else:
                attended = F.scaled_dot_product_attention(
                    queries.view(n, num_q, num_qo_heads, head_dim).transpose(1, 2), k, v,
                    attn_mask=group.mask, is_causal=group.causal, scale=sm_scale,
                    enable_gqa=group_size > 1,
                )  # [n, Hq, Q, D]
                rows = attended.transpose(1, 2).reshape(n * num_q, num_qo_heads, head_dim)
            if group.real is not None:
                rows = rows.index_select(0, group.real)
            out.index_copy_(0, group.out_rows, rows)
        return out

    def cpu_decode_rows(self, window: int | None = None) -> paged_attention.PagedRows | None:
        """See `AttentionBackend.cpu_decode_rows`."""
        if self._groups is None or self._groups.get(window, True):
            return None  # not planned, window not planned, or some rows go through SDPA
        return self._kernel_rows.get(window)

    def _buffers(self, elements: int, like: Tensor) -> tuple[Tensor, Tensor]:
        """Two reused workspace views of `elements` each, in `like`'s dtype and device."""
        ws = self._workspace
        if ws is None or ws.numel() < 2 * elements or ws.dtype != like.dtype or ws.device != like.device:
            ws = self._workspace = torch.empty(2 * elements, dtype=like.dtype, device=like.device)
        return ws[:elements], ws[elements: 2 * elements]


def _plan_window(cpu: CpuIndices, page_size: int, device: torch.device, row_elements: int,
                 window: int | None, kernel: bool) -> tuple[list[_Group], paged_attention.PagedRows | None]:
    """The groups of one window (None: full attention) over the sequences with new tokens;
    with `kernel`, decoding sequences are left out of them and returned as kernel rows."""
    qo_lens, kv_lens = cpu.qo_lens, cpu.kv_lens
    # Each sequence's first key any of its queries sees, counted from its first held page
    # (full attention: position 0, before the released pages if there are any).
    first_seen = -cpu.kv_offsets if window is None else kv_lens - qo_lens - window + 1
    short = np.flatnonzero((first_seen < 0) & (cpu.kv_offsets > 0) & (qo_lens > 0))
    if short.size:  # a released page is needed: the scheduler's window rule and this disagree
        b = int(short[0])
        raise ValueError(f"sequence {b}: a {'full' if window is None else f'window of {window}'} attention "
                         f"reaches {-int(first_seen[b])} tokens before its first held page")
    key_start = np.maximum(first_seen, 0)
    decoding = np.flatnonzero(qo_lens == 1)
    # Fresh prompts (every key is new) of one length need no mask: SDPA's causal mode
    # skips the upper triangle, half the work a masked call does. A window longer than the
    # prompt cuts nothing.
    fresh = (qo_lens == kv_lens) & (qo_lens >= MIN_CAUSAL_PROMPT)
    if window is not None:
        fresh &= qo_lens <= window
    prefilling = np.flatnonzero((qo_lens > 1) & ~fresh)
    by_length = [np.flatnonzero(fresh & (qo_lens == n)) for n in np.unique(qo_lens[fresh]).tolist()]
    rows = None
    if kernel and decoding.size:
        # A decode's one query sees keys key_start .. kv_len - 1 of its held pages.
        rows = paged_attention.PagedRows(cpu.kv_indices, cpu.qo_indptr[decoding], cpu.kv_indptr[decoding],
                                         key_start[decoding], kv_lens[decoding], page_size=page_size)
        decoding = decoding[:0]
    # Sequences without new tokens need no attention and belong to no group.
    groups = [
        _build_group(members, cpu, key_start, page_size, device, window)
        for seqs in (decoding, prefilling, *by_length)
        for members in _split(seqs, kv_lens - key_start, qo_lens, row_elements)
    ]
    return groups, rows


def _split(seqs: np.ndarray, num_keys: np.ndarray, qo_lens: np.ndarray, row_elements: int) -> list[np.ndarray]:
    """Cuts sequences (most keys gathered first) into groups of bounded padding and gather size."""
    if not len(seqs):
        return []
    kv_lens = num_keys[seqs]
    qo_lens = qo_lens[seqs]
    order = np.lexsort((-qo_lens, -kv_lens))
    seqs, kv_lens, qo_lens = seqs[order], kv_lens[order].tolist(), qo_lens[order].tolist()
    max_keys = max(1, MAX_GATHER_ELEMENTS // row_elements)
    groups: list[np.ndarray] = []
    start, area, max_q = 0, 0, 0
    for i, (num_k, num_q) in enumerate(zip(kv_lens, qo_lens)):
        if i > start:
            longest = kv_lens[start]  # sorted: the group's first sequence has the most keys
            new_max_q = max(max_q, num_q)
            padded = (i - start + 1) * new_max_q * longest
            if padded > (1 + MAX_PADDING) * (area + num_q * num_k) or (i - start + 1) * longest > max_keys:
                groups.append(seqs[start:i])
                start, area, max_q = i, 0, 0
        area += num_q * num_k
        max_q = max(max_q, num_q)
    groups.append(seqs[start:])
    return groups


def _build_group(seqs: np.ndarray, cpu: CpuIndices, key_start: np.ndarray, page_size: int,
                 device: torch.device, window: int | None) -> _Group:
    """Gather indices, query rows and mask of sequences that each have >= 1 new token; each
    gathers its keys from `key_start` on, and with `window` each query sees its last
    `window` keys only."""
    kv_lens = cpu.kv_lens[seqs]
    q_lens = cpu.qo_lens[seqs]
    first_key = key_start[seqs]
    num_keys = kv_lens - first_key
    q_start = cpu.qo_indptr[seqs].astype(np.int64)
    page_start = cpu.kv_indptr[seqs].astype(np.int64)
    n, num_k, num_q = len(seqs), int(num_keys.max()), int(q_lens.max())
    key_slot = np.arange(num_k)
    # Padding keys re-read their sequence's last key: it was written, so it is finite.
    key_pos = first_key[:, None] + np.minimum(key_slot, num_keys[:, None] - 1)  # [n, K]
    pages = cpu.kv_indices[page_start[:, None] + key_pos // page_size].astype(np.int64)
    kv_slots = pages * page_size + key_pos % page_size
    # Padding queries repeat their sequence's last query; their outputs are dropped.
    q_offset = np.arange(num_q)
    q_last = np.minimum(q_offset, q_lens[:, None] - 1)  # [n, Q]
    q_rows = q_start[:, None] + q_last
    q_valid = q_offset < q_lens[:, None]  # [n, Q]
    # Fresh prompts of one length that no window cuts: SDPA's own causal mask is exact.
    causal = (num_q > 1 and bool((q_lens == num_q).all() and (kv_lens == num_q).all())
              and (window is None or num_q <= window))
    mask = None
    if not causal and (num_q > 1 or (num_keys != num_k).any()):
        # Query j of a sequence with Lq new and L total tokens is at position L - Lq + j and
        # sees keys 0 .. that position, or with a window W the last W of them (padding
        # queries see what their sequence's last query sees, so no softmax row is empty).
        q_pos = (kv_lens - q_lens)[:, None] + q_last  # [n, Q]
        real_key = (key_slot < num_keys[:, None])[:, None, :]  # [n, 1, K]
        visible = (key_pos[:, None, :] <= q_pos[:, :, None]) & real_key
        if window is not None:
            visible &= key_pos[:, None, :] > q_pos[:, :, None] - window
        mask = torch.from_numpy(visible[:, None]).to(device)
    real = None if q_valid.all() else torch.from_numpy(np.flatnonzero(q_valid)).to(device)
    out_rows = q_rows.reshape(-1)[q_valid.reshape(-1)]

    def tensor(array: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64).reshape(-1)).to(device)

    return _Group(n, num_q, num_k, tensor(q_rows), tensor(kv_slots), mask, causal,
                  tensor(out_rows), real)
