"""Binding of the whole-stack decode kernel (`decoder.c`): every decoder layer in one C call.

The model (radixserve.models.llama) hands it, for a step where every row decodes, the residual
stream, the step's RoPE tables and K/V slots, each layer's tensors and the attention rows the
backend planned per window. Everything C will read is checked here first: the weights once,
when a `DecoderWeights` is built, and the step's tensors on every call (a few comparisons per
layer, and one pass over the step's K/V slots).
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from radixserve.native import build, checks
from radixserve.native.paged_attention import DTYPE_CODES, PagedRows, scratch_layout
from radixserve.native.scratch import threads_and_scratch

NAME = "decoder"
# The order of a layer's pointers in C (the enum at the top of decoder.c).
LAYER_TENSORS = ("input_norm", "q", "k", "v", "q_bias", "k_bias", "v_bias", "o", "o_bias", "post_norm",
                 "gate", "up", "gate_bias", "up_bias", "down", "down_bias")
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _RowSet(ctypes.Structure):
    _fields_ = [("kv_indices", _P), ("rows", _P), ("page_start", _P), ("lo", _P), ("hi", _P),
                ("count", _I), ("max_keys", _I)]


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", _I), ("q_heads", _I), ("kv_heads", _I), ("head_dim", _I), ("intermediate", _I),
                ("page_size", _I), ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel's library with its signature declared; None when it cannot be built."""
    return build.declared_library(NAME, "radixserve_decoder_layers", None, [
        _P, _I, _P, _I,  # x, tokens, layer pointers, layers
        _P, _P, _P, _P, _P,  # row sets, row set of each layer, cos, sin, slots
        _P, _P, _P, ctypes.c_int, ctypes.c_int,  # dims, workspace, scratch, threads, dtype
        _P, _P,  # final norm weight (or NULL), normed output
    ])


def unavailable_reason() -> str | None:
    """Why `library()` returned None, or None when the kernel is loaded."""
    return build.unavailable_reason(NAME)


class DecoderShape(NamedTuple):
    """The sizes every layer shares, and the norms' epsilon and the attention's scale."""

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    scale: float


class DecoderWeights:
    """Each layer's tensors (contiguous on the CPU, all float32 or all bfloat16), checked once
    against `shape`.

    `layers[l]` maps the names in LAYER_TENSORS to tensors (biases may be None). The tensors
    are kept, not copied, and their addresses read once: a weight changed in place is used
    as it is, one given new storage afterwards (`param.data = ...`) needs a new view.
    `final_norm` [hidden] (the model's last norm, with the layers' epsilon), when given, is
    applied by the same call to every row after the last layer (`run_layers` returns them).
    """

    def __init__(self, layers: Sequence[dict[str, Tensor | None]], shape: DecoderShape,
                 dtype: torch.dtype = torch.float32, final_norm: Tensor | None = None) -> None:
        if dtype not in DTYPE_CODES:
            raise ValueError(f"the decoder kernel runs float32 or bfloat16, not {dtype}")
        if final_norm is not None and not (final_norm.dtype == dtype and final_norm.is_cpu
                                           and final_norm.is_contiguous()
                                           and tuple(final_norm.shape) == (shape.hidden,)):
            raise ValueError(f"final_norm: the decoder kernel needs contiguous {dtype} ({shape.hidden},) on the CPU, "
                             f"got {final_norm.dtype} {tuple(final_norm.shape)}")
        self.final_norm = final_norm
        self.dtype = dtype
        if shape.kv_heads < 1 or shape.q_heads % shape.kv_heads or shape.head_dim % 2:
            raise ValueError(f"the decoder kernel needs KV heads dividing {shape.q_heads} query heads and an even "
                             f"head_dim, got {shape.kv_heads} and {shape.head_dim}")
        self.shape = shape
        hidden, q_width = shape.hidden, shape.q_heads * shape.head_dim
        kv_width = shape.kv_heads * shape.head_dim
        expected = {"input_norm": (hidden,), "post_norm": (hidden,), "q": (q_width, hidden), "k": (kv_width, hidden),
                    "v": (kv_width, hidden), "o": (hidden, q_width), "gate": (shape.intermediate, hidden),
                    "up": (shape.intermediate, hidden), "down": (hidden, shape.intermediate)}
        self.tensors: list[Tensor | None] = []
        for index, layer in enumerate(layers):
            for name in LAYER_TENSORS:
                tensor = layer.get(name)
                if name.endswith("_bias"):
                    weight_shape = expected[name.removesuffix("_bias")]
                    want: tuple[int, ...] | None = (weight_shape[0],)
                else:
                    want = expected[name]
                if tensor is None and name.endswith("_bias"):
                    self.tensors.append(None)
                    continue
                if tensor is None or not (tensor.dtype == dtype and tensor.is_cpu and tensor.is_contiguous()
                                          and tuple(tensor.shape) == want):
                    got = "missing" if tensor is None else f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
                    raise ValueError(f"layer {index} {name}: the decoder kernel needs contiguous {dtype} {want} "
                                     f"on the CPU, got {got}")
                self.tensors.append(tensor)
        self.num_layers = len(layers)
        per_layer = len(LAYER_TENSORS) + 2  # and the layer's K and V caches, filled per call
        self._pointers = (ctypes.c_void_p * (per_layer * self.num_layers))()
        for index, tensor in enumerate(self.tensors):
            layer, slot = divmod(index, len(LAYER_TENSORS))
            self._pointers[layer * per_layer + slot] = None if tensor is None else tensor.data_ptr()
        self._bound: tuple[weakref.ref, ...] = ()  # the caches the pointers hold, by reference
        self._cache_shape = (0, 0)
        self._dims: dict[int, _Dims] = {}

    def dims(self, page_size: int) -> _Dims:
        """The shape and constants as C reads them, for caches of `page_size` (made once)."""
        dims = self._dims.get(page_size)
        if dims is None:
            shape = self.shape
            dims = self._dims[page_size] = _Dims(shape.hidden, shape.q_heads, shape.kv_heads, shape.head_dim,
                                                 shape.intermediate, page_size, shape.eps, shape.scale)
        return dims

    def bind_caches(self, k_caches: Sequence[Tensor], v_caches: Sequence[Tensor]) -> tuple[ctypes.Array, int, int]:
        """The C array of every layer's pointers with these caches', and the caches' (pages,
        page_size). The caches are checked (`_check_caches`) unless they are the very tensors
        of the last call: an engine's pool allocates its caches once and never resizes or
        re-points them in place, so the check runs once per pool, not once per step (weak
        references: a freed cache never passes for a new one at its address)."""
        caches = (*k_caches, *v_caches)
        bound = self._bound
        if len(caches) == len(bound) and all(ref() is cache for ref, cache in zip(bound, caches)):
            return self._pointers, *self._cache_shape
        self._cache_shape = _check_caches(k_caches, v_caches, self.num_layers, self.shape, self.dtype)
        per_layer = len(LAYER_TENSORS) + 2
        for layer in range(self.num_layers):
            self._pointers[layer * per_layer + per_layer - 2] = k_caches[layer].data_ptr()
            self._pointers[layer * per_layer + per_layer - 1] = v_caches[layer].data_ptr()
        self._bound = tuple(weakref.ref(cache) for cache in caches)
        return self._pointers, *self._cache_shape


def _check_caches(k_caches: Sequence[Tensor], v_caches: Sequence[Tensor], num_layers: int,
                  shape: DecoderShape, dtype: torch.dtype) -> tuple[int, int]:
    """Every layer's caches [pages, page_size, kv_heads, head_dim] in `dtype`, one shape for
    all; returns (pages, page_size)."""
    if len(k_caches) != num_layers or len(v_caches) != num_layers:
        raise ValueError(f"the decoder kernel needs {num_layers} K and V caches, got {len(k_caches)} and {len(v_caches)}")
    first = k_caches[0].shape
    ok = len(first) == 4 and tuple(first[2:]) == (shape.kv_heads, shape.head_dim) and all(
        c.shape == first and c.dtype == dtype and c.is_cpu and c.is_contiguous()
        for c in (*k_caches, *v_caches))
    if not ok:
        raise ValueError(f"the decoder kernel needs contiguous {dtype} K/V caches of one shape "
                         f"[pages, page_size, {shape.kv_heads}, {shape.head_dim}] on the CPU, got {tuple(first)}")
    return int(first[0]), int(first[1])


def run_layers(x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, weights: DecoderWeights,
               k_caches: Sequence[Tensor], v_caches: Sequence[Tensor],
               rows_of_layer: Sequence[PagedRows], *, final_norm: bool = True) -> Tensor | None:
    """Runs every layer over x [T, hidden] (updated in place: the residual stream), each new
    token's K/V written at `slots` [T] and every row attending through its layer's planned
    decode rows (one row per token, in order); returns x's rows through the weights' final
    norm, or None when they have none or `final_norm` is False. Raises ValueError before any
    C runs on anything the kernel would misread."""
    loaded = library()
    if loaded is None:
        raise RuntimeError(f"the decoder kernel is unavailable: {unavailable_reason()}")
    shape = weights.shape
    tokens = x.shape[0] if x.dim() == 2 else -1
    dtype = weights.dtype
    if not (tokens >= 1 and x.shape[1] == shape.hidden and x.dtype == dtype and x.is_cpu
            and x.is_contiguous()):
        raise ValueError(f"the decoder kernel needs x as contiguous {dtype} [T, {shape.hidden}] on the CPU, "
                         f"got {x.dtype} {tuple(x.shape)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if not (table.dtype == dtype and table.is_cpu and table.is_contiguous()
                and tuple(table.shape) == (tokens, shape.head_dim)):
            raise ValueError(f"{name}: the decoder kernel needs {dtype} [{tokens}, {shape.head_dim}], "
                             f"got {table.dtype} {tuple(table.shape)}")
    pointers, pages, page_size = weights.bind_caches(k_caches, v_caches)
    slot_array = checks.slot_indices(slots, tokens, pages * page_size)
    if len(rows_of_layer) != weights.num_layers:
        raise ValueError(f"the decoder kernel needs one row set per layer ({weights.num_layers}), "
                         f"got {len(rows_of_layer)}")
    distinct = list({id(rows): rows for rows in rows_of_layer}.values())  # one per window, in order
    index_of = {id(rows): index for index, rows in enumerate(distinct)}
    row_sets = (_RowSet * len(distinct))()
    for index, rows in enumerate(distinct):
        checks.decode_rows(rows.checked, tokens, rows.page_size, page_size, pages)
        row_sets[index] = _RowSet(*rows._pointers, len(rows), rows.max_keys)
    set_of_layer = np.array([index_of[id(rows)] for rows in rows_of_layer], dtype=np.int64)
    max_keys = max(rows.max_keys for rows in distinct)
    # One reused buffer per thread (scratch.py): the attention's scratch, then the step's
    # workspace (its size in float32 slots, each element of the dtype taking a whole slot or half).
    per_thread, shared = scratch_layout(shape.q_heads, shape.head_dim, max_keys, tokens)
    q_width, kv_width = shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim
    workspace_elements = tokens * (3 * shape.hidden + 2 * q_width + 2 * kv_width + shape.intermediate)
    workspace_floats = -(-workspace_elements * x.element_size() // 4) + 16  # + 16: room to align it
    threads, scratch = threads_and_scratch(NAME, per_thread, shared + workspace_floats)
    workspace = -(-(scratch.ctypes.data + (threads * max(per_thread, 1) + shared) * 4) // 64) * 64  # a cache line
    norm_weight = weights.final_norm if final_norm else None
    normed = None if norm_weight is None else torch.empty_like(x)
    loaded.radixserve_decoder_layers(
        x.data_ptr(), tokens, pointers, weights.num_layers, row_sets,
        set_of_layer.ctypes.data, cos.data_ptr(), sin.data_ptr(), slot_array.ctypes.data,
        ctypes.byref(weights.dims(page_size)), workspace, scratch.ctypes.data, threads, DTYPE_CODES[dtype],
        None if norm_weight is None else norm_weight.data_ptr(), None if normed is None else normed.data_ptr())
    return normed
