"""The one checking layer between Python and the C kernels: every call into C passes here.

The kernels trust what they are given: a page index past the pool reads other memory (or, far
past, kills the process), an int64 index array read as int32 reads the wrong pages, a short
parameter array is read past its end. So each binding hands its inputs to a function here
first, which raises ValueError naming what is wrong before any C runs. The engine ends a
request whose forward pass or sampling raises with finish_reason "error", so a bad input fails
the one request that carries it, never the process.

What each kernel trusts, and where it is checked:

- paged attention, once per step (`paged_rows`, when the backend plans): the index arrays are
  integers (kv_indices converted to int32 once, explicitly, after a range check); every row
  sees at least one key and its pages lie inside kv_indices; the page indices the rows
  actually read are >= 0. Their largest page index and query row are kept for the per-call
  check.
- paged attention, every layer (`attention_call`): q, the caches and out are contiguous
  on the CPU, all float32 or all bfloat16, of consistent shapes ([T, Hq, D], [pages, page_size, Hkv, D]); Hkv
  divides Hq; the largest page index read is below the pool's page count and the largest
  query row below T. A handful of comparisons: the vectorised work was done at plan time.
- sampling, every call (`sampling_arguments`): float32 logits on the CPU with rows of unit
  stride and 1 <= vocab < 2^31 (token ids are int32 in C); one entry per row in every
  parameter array, converted to the dtype C reads; temperature >= 0 (not NaN); u in [0, 1].
- token mask, once per bitmask buffer (`mask_words`): int32 words on the CPU, rows of
  contiguous words; once per mask (`native_mask`, or the grammar layer's reused buffers,
  which build a NativeMask from checked words and their own row array): at most one mask row
  per masked row, every masked row index >= 0; every call (`token_mask_call`, a handful of
  integer comparisons): the logits as for sampling, ceil(vocab / 32) words per mask row, each
  masked row index below the logits' rows; for the greedy call (`greedy_call`), also at
  least one token per row.

NaN is not checked here (that would be a pass over every key read, on every layer): the
attention kernel propagates it instead (a NaN key makes the heads that read it NaN, as in
SDPA; see paged_attention.c), so NaN logits follow and the sampler reports those rows.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

INT32_MAX = 2**31 - 1


class CheckedRows(NamedTuple):
    """Decode rows that passed `paged_rows`: host arrays C can read as they are, and the
    bounds `attention_call` compares against each call's tensors."""

    kv_indices: np.ndarray  # int32, contiguous
    rows: np.ndarray  # int64 columns, one entry per row
    page_start: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    max_keys: int  # the most keys one row sees (0 without rows)
    max_row: int  # the largest query row (-1 without rows)
    max_page: int  # the largest page index the rows read (-1 without rows)


def _host_integers(name: str, values: Tensor | np.ndarray) -> np.ndarray:
    """`values` as a 1-D numpy integer array (no copy for a CPU tensor)."""
    if isinstance(values, Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {values.device}")
        values = values.numpy()
    array = np.asarray(values)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a 1-D integer array, got {array.dtype} of shape {array.shape}")
    return array


def paged_rows(kv_indices: Tensor | np.ndarray, rows: Tensor | np.ndarray, page_start: Tensor | np.ndarray,
               lo: Tensor | np.ndarray, hi: Tensor | np.ndarray, page_size: int) -> CheckedRows:
    """Checks one step's decode rows for the paged-attention kernel: row i is query row
    rows[i], whose pages are kv_indices[page_start[i]:] and which sees keys lo[i] .. hi[i] - 1
    counted from the first of them. Raises ValueError on anything the kernel would misread."""
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    pages = _host_integers("kv_indices", kv_indices)
    columns = [np.ascontiguousarray(_host_integers(name, values), dtype=np.int64)
               for name, values in (("rows", rows), ("page_start", page_start), ("lo", lo), ("hi", hi))]
    rows_, page_start_, lo_, hi_ = columns
    if len({len(c) for c in columns}) != 1:
        raise ValueError(f"rows, page_start, lo and hi differ in length: {[len(c) for c in columns]}")
    if not len(rows_):
        return CheckedRows(np.ascontiguousarray(pages, dtype=np.int32), *columns, 0, -1, -1)
    first = page_start_ + lo_ // page_size  # the entries of kv_indices row i reads
    last = page_start_ + (hi_ - 1) // page_size
    conditions = ((rows_ >= 0, "query rows must be >= 0", rows_),
                  (page_start_ >= 0, "page_start must be >= 0", page_start_),
                  (lo_ >= 0, "lo (a row's first key) must be >= 0", lo_),
                  (hi_ > lo_, "every row must see at least one key (hi > lo)", hi_),
                  (last < len(pages), f"a row's pages run past the end of kv_indices ({len(pages)} entries)", last))
    if not np.logical_and.reduce([condition for condition, _, _ in conditions]).all():
        for condition, message, values in conditions:  # name the first that fails
            _require_all(condition, message, values)
    # The page indices the rows read: the entries covered by some [first, last] (marks +1 at
    # each range's start, -1 past its end, summed).
    marks = np.bincount(first, minlength=len(pages) + 1) - np.bincount(last + 1, minlength=len(pages) + 1)
    used = pages[np.cumsum(marks[:len(pages)]) > 0]
    low, high = int(used.min()), int(used.max())
    if low < 0:
        raise ValueError(f"page index {low} is negative: kv_indices must lie in [0, number of pages)")
    if high > INT32_MAX:
        raise ValueError(f"page index {high} is past any pool: kv_indices must fit in int32")
    # int64 (or any integer) indices become int32 here, once: the kernel reads int32.
    return CheckedRows(np.ascontiguousarray(pages, dtype=np.int32), *columns,
                       max_keys=int((hi_ - lo_).max()), max_row=int(rows_.max()), max_page=high)


def _require_all(condition: np.ndarray, message: str, values: np.ndarray) -> None:
    """Raises ValueError with `message` and the first offending row when `condition` fails."""
    if not condition.all():
        row = int(np.flatnonzero(~condition)[0])
        raise ValueError(f"{message}; row {row} has {values[row].item()}")


def _fault(t: Tensor, dtype: torch.dtype = torch.float32) -> str | None:
    """Why a kernel cannot read `t` as dense `dtype` on the CPU, or None when it can."""
    if t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous():
        return None
    return f"{t.dtype}" + ("" if t.device.type == "cpu" else f" on {t.device}") + (
        "" if t.is_contiguous() else " (not contiguous)")


def attention_call(q: Tensor, k_cache: Tensor, v_cache: Tensor, out: Tensor, rows: CheckedRows,
                   page_size: int) -> None:
    """Checks one paged-attention call over checked `rows` (planned for `page_size`): the
    tensors' dtype, device, layout and shapes, and the rows' bounds against them."""
    # Once per layer: one expression in the usual case, the message only on failure.
    dense = (q.dtype == k_cache.dtype == v_cache.dtype == out.dtype and q.dtype in (torch.float32, torch.bfloat16)
             and q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and out.is_cpu and q.is_contiguous()
             and k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous())
    if not dense:
        want = q.dtype if q.dtype in (torch.float32, torch.bfloat16) else torch.float32
        faults = {"q": _fault(q, want), "k_cache": _fault(k_cache, want), "v_cache": _fault(v_cache, want),
                  "out": _fault(out, want)}
        if faults["k_cache"] == faults["v_cache"]:
            faults["caches"] = faults.pop("k_cache")
            del faults["v_cache"]
        got = ", ".join(f"{name} {fault}" for name, fault in faults.items() if fault)
        raise ValueError("the CPU attention kernel needs contiguous q, caches and out on the CPU, all float32 or all "
                         f"bfloat16 (q is {q.dtype}), got {got}")
    q_shape, cache_shape = q.shape, k_cache.shape
    if len(q_shape) != 3 or len(cache_shape) != 4 or v_cache.shape != cache_shape or out.shape != q_shape:
        raise ValueError(f"shapes: q {tuple(q_shape)} must be [T, Hq, D], out {tuple(out.shape)} the same, "
                         f"caches {tuple(cache_shape)} and {tuple(v_cache.shape)} [pages, page_size, Hkv, D]")
    num_tokens, num_qo_heads, head_dim = q_shape
    num_pages, cache_page_size, num_kv_heads, cache_head_dim = cache_shape
    if cache_head_dim != head_dim:
        raise ValueError(f"q's head_dim {head_dim} differs from the caches' {cache_head_dim}")
    if num_kv_heads < 1 or num_qo_heads % num_kv_heads:
        raise ValueError(f"{num_qo_heads} query heads cannot share {num_kv_heads} KV heads")
    if cache_page_size != page_size:
        raise ValueError(f"the rows were planned for pages of {page_size} tokens, the caches hold {cache_page_size}")
    if rows.max_page >= num_pages:
        raise ValueError(f"page index {rows.max_page} is past the pool: kv_indices must lie in [0, {num_pages})")
    if rows.max_row >= num_tokens:
        raise ValueError(f"query row {rows.max_row} is attended, but q has {num_tokens} rows")


def sampling_arguments(logits: Tensor, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                       min_p: np.ndarray, u: np.ndarray) -> list[np.ndarray]:
    """Checks one sampler call and returns the per-row parameters as the contiguous arrays C
    reads (float32, int64 for top_k, float64 for u), in the order given."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu" or (
            logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError("the CPU sampler needs 2-D float32 logits on the CPU with rows of unit stride, got "
                         f"{logits.dtype} on {logits.device}, shape {tuple(logits.shape)}, strides {logits.stride()}")
    rows, vocab = logits.shape
    if not 1 <= vocab <= INT32_MAX:
        raise ValueError(f"the CPU sampler needs a vocabulary of 1 .. 2^31 - 1 tokens, got {vocab}")
    arrays = []
    for name, values, dtype in (("temperature", temperature, np.float32), ("top_k", top_k, np.int64),
                                ("top_p", top_p, np.float32), ("min_p", min_p, np.float32), ("u", u, np.float64)):
        array = np.ascontiguousarray(values, dtype=dtype)
        if array.shape != (rows,):
            raise ValueError(f"{name} must hold one entry per row ({rows}), got shape {array.shape}")
        arrays.append(array)
    temperature_, u_ = arrays[0], arrays[4]
    _require_all(temperature_ >= 0, "temperature must be >= 0 (0: greedy)", temperature_)
    _require_all((u_ >= 0) & (u_ <= 1), "u must lie in [0, 1]", u_)
    return arrays


class MaskWords(NamedTuple):
    """A grammar bitmask's memory as C reads it, checked once by `mask_words` (a buffer reused
    step after step is checked when allocated, not at every use): `rows` rows of `words` int32
    words each, contiguous, at `address`, which `owner` keeps alive."""

    address: int
    rows: int
    words: int
    owner: Tensor


class NativeMask(NamedTuple):
    """A grammar mask as the C sampler reads it: mask row i (of `words`) applies to logits row
    `row_ids[i]` for i < `count` (int64, at `rows_address`; `row_ids` keeps that memory alive).
    `low` and `high` are the smallest and largest of those rows (0 and -1 when `count` is 0).
    Built by `native_mask`, or by the grammar layer from checked words and its own row array."""

    words: MaskWords
    row_ids: array
    rows_address: int
    count: int
    low: int
    high: int


def mask_words(bitmask: Tensor) -> MaskWords:
    """Checks a bitmask buffer (contiguous int32 [rows, words] on the CPU) and returns where C
    reads it."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 or not bitmask.is_contiguous():
        raise ValueError(f"the token mask must be contiguous int32 [rows, words] on the CPU, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)} strides {bitmask.stride()} on {bitmask.device}")
    return MaskWords(bitmask.data_ptr(), bitmask.shape[0], bitmask.shape[1], bitmask)


def native_mask(bitmask: Tensor, rows: Sequence[int]) -> NativeMask:
    """Checks a mask given as a tensor and its rows (mask row i for logits row rows[i]) and
    packs it for C (`token_mask_call` checks it against each call's logits)."""
    words = mask_words(bitmask)
    row_ids = array("q", rows)  # OverflowError / TypeError for what is not an int64
    if words.rows != len(row_ids):
        raise ValueError(f"the token mask must be int32 [{len(row_ids)}, words], one row per masked row, got "
                         f"{bitmask.dtype} {tuple(bitmask.shape)}")
    low, high = (min(row_ids), max(row_ids)) if row_ids else (0, -1)
    if low < 0:
        raise ValueError(f"masked rows must be >= 0, got {low}")
    return NativeMask(words, row_ids, row_ids.buffer_info()[0], len(row_ids), low, high)


def token_mask_call(num_rows: int, vocab: int, mask: NativeMask) -> None:
    """Checks one call that applies `mask` to logits [num_rows, vocab] (already checked as the
    sampler's or `cpu_float_rows`): integer comparisons only, every call."""
    words = mask.words
    if words.words != (vocab + 31) // 32 or mask.count > words.rows or mask.count > len(mask.row_ids):
        raise ValueError(f"the token mask must be int32 [{mask.count}, {(vocab + 31) // 32}] on the CPU "
                         f"for {vocab} logits, got [{words.rows}, {words.words}] for {mask.count} masked rows")
    if mask.count and (mask.low < 0 or mask.high >= num_rows):
        raise ValueError(f"masked rows must lie in [0, {num_rows}), got {mask.low} .. {mask.high}")


def greedy_call(num_rows: int, vocab: int, mask: NativeMask | None) -> None:
    """Checks one greedy call on logits [num_rows, vocab] that `cpu_float_rows` accepted: at
    least one token per row, and the mask (if any) as `token_mask_call` checks it."""
    if vocab < 1:
        raise ValueError(f"greedy sampling needs at least one token per row, got {vocab}")
    if mask is not None:
        token_mask_call(num_rows, vocab, mask)


def cpu_float_rows(logits: Tensor) -> bool:
    """Whether C can read `logits` as rows of float32 on the CPU (2-D, rows of unit stride)."""
    return logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1


def _dense_cpu(t: Tensor, dtype: torch.dtype) -> bool:
    return t.dtype == dtype and t.is_cpu and t.is_contiguous()


def fused_arguments(kernel: str, x: Tensor, others: list[Tensor], shape: tuple[int, ...] | torch.Size) -> None:
    """Checks a fused element-wise call: x and `others` contiguous on the CPU, float32 or
    bfloat16 alike, all of `shape` (x has at least one dimension)."""
    ok = (x.dtype in (torch.float32, torch.bfloat16) and x.dim() >= 1 and _dense_cpu(x, x.dtype)
          and tuple(x.shape) == tuple(shape)
          and all(_dense_cpu(t, x.dtype) and tuple(t.shape) == tuple(shape) for t in others))
    if not ok:
        got = ", ".join(f"{t.dtype} {tuple(t.shape)} on {t.device}" + ("" if t.is_contiguous() else " (strided)")
                        for t in (x, *others))
        raise ValueError(f"the CPU {kernel} kernel needs contiguous float32 or bfloat16 tensors of shape "
                         f"{tuple(shape)} on the CPU, got {got}")


def rope_arguments(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Checks a RoPE call: q [T, Hq, D] and k [T, Hk, D] with unit-stride heads (rows may be
    strided), cos and sin [T, D] contiguous, all on the CPU in one of float32 / bfloat16."""
    ok = (q.dtype in (torch.float32, torch.bfloat16) and q.dim() == 3 and k.dim() == 3
          and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2] and q.shape[2] % 2 == 0
          and q.dtype == k.dtype and q.is_cpu and k.is_cpu
          and q.stride(2) == 1 and k.stride(2) == 1 and q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2]
          and all(_dense_cpu(t, q.dtype) and tuple(t.shape) == (q.shape[0], q.shape[2]) for t in (cos, sin)))
    if not ok:
        got = ", ".join(f"{name} {t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}"
                        for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)))
        raise ValueError(f"the CPU RoPE kernel needs q [T, Hq, D], k [T, Hk, D] (heads of unit stride, D even) "
                         f"and contiguous cos, sin [T, D], all float32 or all bfloat16 on the CPU; got {got}")


def linear_arguments(x: Tensor, weight: Tensor, bias: Tensor | None) -> None:
    """Checks a linear call: x [rows, in], weight [out, in] and bias [out] (or None), all
    contiguous on the CPU, all float32 or all bfloat16."""
    dtype = x.dtype
    ok = (dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and weight.dim() == 2
          and x.shape[1] == weight.shape[1] and _dense_cpu(x, dtype) and _dense_cpu(weight, dtype)
          and (bias is None or (_dense_cpu(bias, dtype) and tuple(bias.shape) == (weight.shape[0],))))
    if not ok:
        got = ", ".join(f"{name} {t.dtype} {tuple(t.shape)} on {t.device}" + ("" if t.is_contiguous() else " (strided)")
                        for name, t in (("x", x), ("weight", weight), ("bias", bias)) if t is not None)
        raise ValueError("the CPU linear kernel needs contiguous x [rows, in], weight [out, in] and bias [out] on "
                         f"the CPU, all float32 or all bfloat16; got {got}")


def slot_indices(slots: Tensor, tokens: int, num_slots: int) -> np.ndarray:
    """Checks a step's K/V slots for the decoder kernel: int64 [tokens] on the CPU, each in
    [0, num_slots) (C writes each token's K/V row there); returns them as a host array."""
    if not (slots.dtype == torch.int64 and slots.is_cpu and tuple(slots.shape) == (tokens,)):
        raise ValueError(f"slots: the decoder kernel needs int64 [{tokens}] on the CPU, "
                         f"got {slots.dtype} {tuple(slots.shape)} on {slots.device}")
    array = np.ascontiguousarray(slots.numpy())
    if tokens and (int(array.min()) < 0 or int(array.max()) >= num_slots):
        raise ValueError(f"slots: every K/V slot must lie in [0, {num_slots}), "
                         f"got {int(array.min())} .. {int(array.max())}")
    return array


def decode_rows(rows: CheckedRows, tokens: int, planned_page_size: int, page_size: int, num_pages: int) -> None:
    """Checks decode rows for the decoder kernel: one row per token, in order (every row of
    the step decodes, so every row of the attention output is written), planned for the
    caches' page size, reading pages inside the pool."""
    if planned_page_size != page_size:
        raise ValueError(f"the rows were planned for pages of {planned_page_size} tokens, the caches hold {page_size}")
    if len(rows.rows) != tokens or not np.array_equal(rows.rows, np.arange(tokens)):
        raise ValueError(f"the decoder kernel needs one decode row per token (0 .. {tokens - 1}), "
                         f"got {len(rows.rows)} rows")
    if rows.max_page >= num_pages:
        raise ValueError(f"page index {rows.max_page} is past the pool: kv_indices must lie in [0, {num_pages})")
