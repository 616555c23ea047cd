"""Attention metadata and the torch backend against dense per-sequence attention."""

from __future__ import annotations

import math
import random

import pytest
import torch

from radixserve.attention import (
    AttentionMetadata,
    TorchBackend,
    create_backend,
    flashinfer_available,
    write_kv,
)


def test_metadata_of_the_worked_example() -> None:
    """The worked example (tests/test_worked_example.py): A has 6 tokens in pages [7, 2] (2 new),
    B 3 tokens in [9] (all new)."""
    meta = AttentionMetadata.build([[7, 2], [9]], [6, 3], [2, 3], page_size=4, device="cpu")
    assert meta.qo_indptr.tolist() == [0, 2, 5]
    assert meta.kv_indptr.tolist() == [0, 2, 3]
    assert meta.kv_indices.tolist() == [7, 2, 9]
    assert meta.kv_last_page_len.tolist() == [2, 3]
    assert meta.positions.tolist() == [4, 5, 0, 1, 2]
    assert meta.slot_mapping.tolist() == [2 * 4 + 0, 2 * 4 + 1, 36, 37, 38]
    assert not meta.is_decode
    assert meta.page_size == 4 and meta.batch_size == 2 and meta.num_tokens == 5
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert getattr(meta, name).dtype == torch.int32, name
    assert meta.positions.dtype == meta.slot_mapping.dtype == torch.int64


def test_metadata_edge_cases() -> None:
    """Full last pages, extra allocated pages, a sequence with no new tokens, an empty one."""
    meta = AttentionMetadata.build(
        [[5, 1, 8], [3], [4, 6], []], [8, 1, 5, 0], [1, 1, 0, 0], page_size=4, device="cpu"
    )
    assert meta.kv_indptr.tolist() == [0, 2, 3, 5, 5]  # page 8 of sequence 0 is not needed yet
    assert meta.kv_indices.tolist() == [5, 1, 3, 4, 6]
    assert meta.kv_last_page_len.tolist() == [4, 1, 1, 0]
    assert meta.qo_indptr.tolist() == [0, 1, 2, 2, 2]
    assert meta.positions.tolist() == [7, 0]
    assert meta.slot_mapping.tolist() == [1 * 4 + 3, 3 * 4 + 0]
    assert not meta.is_decode  # two sequences have no new token
    assert AttentionMetadata.build([[1], [2]], [3, 1], [1, 1], 4, "cpu").is_decode


@pytest.mark.parametrize(
    ("tables", "kv_lens", "new", "message"),
    [
        ([[1]], [5], [1], "need 2 pages"),
        ([[1]], [2], [3], "num_new_tokens"),
        ([[1], [2]], [1], [1], "differ in length"),
    ],
)
def test_metadata_rejects_inconsistent_input(
    tables: list[list[int]], kv_lens: list[int], new: list[int], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(tables, kv_lens, new, page_size=4, device="cpu")


def test_write_kv_writes_exactly_the_slots() -> None:
    k_cache = torch.zeros(3, 4, 2, 8)
    v_cache = torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    write_kv(k_cache, v_cache, k, v, torch.tensor([9, 2]))  # page 2 slot 1, page 0 slot 2
    assert torch.equal(k_cache[2, 1], k[0]) and torch.equal(k_cache[0, 2], k[1])
    assert torch.equal(v_cache[2, 1], v[0]) and torch.equal(v_cache[0, 2], v[1])
    k_cache[2, 1] = k_cache[0, 2] = 0
    assert not k_cache.any()


def random_batch(
    rng: random.Random, page_size: int, shapes: list[tuple[int, int]]
) -> tuple[list[list[int]], list[int], list[int], int]:
    """Block tables over shuffled page ids (some tables with spare pages) for
    (kv_len, num_new) shapes; returns tables, kv_lens, num_new, pool size."""
    need = [-(-kv // page_size) + rng.randint(0, 1) for kv, _ in shapes]
    num_pages = sum(need) + 3
    ids = list(range(num_pages))
    rng.shuffle(ids)
    tables, start = [], 0
    for n in need:
        tables.append(ids[start : start + n])
        start += n
    return tables, [kv for kv, _ in shapes], [new for _, new in shapes], num_pages


def fill_caches(
    tables: list[list[int]], kv_lens: list[int], num_pages: int, page_size: int,
    num_kv_heads: int, head_dim: int, dtype: torch.dtype, generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN caches (never-written slots must not matter) with random K/V in every used slot."""
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for table, kv_len in zip(tables, kv_lens):
        for pos in range(kv_len):
            page, offset = table[pos // page_size], pos % page_size
            k_cache[page, offset] = torch.randn(num_kv_heads, head_dim, generator=generator)
            v_cache[page, offset] = torch.randn(num_kv_heads, head_dim, generator=generator)
    return k_cache, v_cache


def dense_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: list[list[int]],
    kv_lens: list[int], num_new: list[int], sm_scale: float, window: int | None = None,
) -> torch.Tensor:
    """Float64 attention one sequence at a time, reading keys through the block table; with
    `window` W, the query at position p sees keys p - W + 1 .. p (transformers' rule
    kv_idx > q_idx - W). Keys no query sees are not read."""
    page_size = k_cache.shape[1]
    outputs, row = [], 0
    for table, kv_len, new in zip(tables, kv_lens, num_new):
        if new == 0:
            continue
        first = 0 if window is None else max(0, kv_len - new - window + 1)
        zero = torch.zeros_like(k_cache[0, 0])
        keys = torch.stack([k_cache[table[p // page_size], p % page_size] if p >= first else zero
                            for p in range(kv_len)])
        values = torch.stack([v_cache[table[p // page_size], p % page_size] if p >= first else zero
                              for p in range(kv_len)])
        group = q.shape[1] // keys.shape[1]
        keys = keys.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = values.double().repeat_interleave(group, dim=1)
        queries = q[row : row + new].double()  # [Lq, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * sm_scale
        query_pos = torch.arange(kv_len - new, kv_len)[:, None]
        key_pos = torch.arange(kv_len)[None, :]
        hidden = key_pos > query_pos
        if window is not None:
            hidden |= key_pos <= query_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
        row += new
    return torch.cat(outputs)


RAGGED_SHAPES = [  # (kv_len, num_new)
    (37, 37),  # fresh prefill
    (1, 1),  # single token
    (20, 0),  # nothing new this step
    (29, 5),  # continuation after cached prefix (chunked prefill / cache hit)
    (16, 1),  # decode at a page boundary
    (9, 1),  # decode in a partial page
    (0, 0),  # empty sequence
    (50, 13),
]


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("num_qo_heads", "num_kv_heads"), [(4, 2), (4, 4), (8, 1)])
def test_torch_backend_matches_dense_attention(
    page_size: int, num_qo_heads: int, num_kv_heads: int, use_kernel: bool
) -> None:
    rng = random.Random(page_size * 100 + num_qo_heads * 10 + num_kv_heads)
    shapes = RAGGED_SHAPES[:]
    rng.shuffle(shapes)
    head_dim = 16
    generator = torch.Generator().manual_seed(rng.randint(0, 1 << 30))
    tables, kv_lens, num_new, num_pages = random_batch(rng, page_size, shapes)
    k_cache, v_cache = fill_caches(
        tables, kv_lens, num_pages, page_size, num_kv_heads, head_dim, torch.float32, generator
    )
    q = torch.randn(sum(num_new), num_qo_heads, head_dim, generator=generator)
    sm_scale = 0.7 / math.sqrt(head_dim)

    meta = AttentionMetadata.build(tables, kv_lens, num_new, page_size, "cpu")
    backend = TorchBackend(use_kernel=use_kernel)
    backend.plan(meta, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, dtype=torch.float32)
    out = backend.forward(q, k_cache, v_cache, sm_scale=sm_scale)

    expected = dense_attention(q, k_cache, v_cache, tables, kv_lens, num_new, sm_scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_path_matches_dense_attention(page_size: int, use_kernel: bool) -> None:
    rng = random.Random(page_size)
    shapes = [(rng.randint(1, 70), 1) for _ in range(7)]
    generator = torch.Generator().manual_seed(page_size)
    tables, kv_lens, num_new, num_pages = random_batch(rng, page_size, shapes)
    k_cache, v_cache = fill_caches(tables, kv_lens, num_pages, page_size, 2, 16,
                                   torch.float32, generator)
    q = torch.randn(len(shapes), 4, 16, generator=generator)
    meta = AttentionMetadata.build(tables, kv_lens, num_new, page_size, "cpu")
    assert meta.is_decode
    backend = TorchBackend(use_kernel=use_kernel)
    backend.plan(meta, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
    out = backend.forward(q, k_cache, v_cache, sm_scale=0.25)
    expected = dense_attention(q, k_cache, v_cache, tables, kv_lens, num_new, 0.25)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


WINDOW_SHAPES = RAGGED_SHAPES + [(70, 1), (64, 40), (20, 20), (33, 1), (100, 3)]


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "gather"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 32])
def test_windowed_layers_match_dense_sliding_window_attention(page_size: int, window: int,
                                                              use_kernel: bool) -> None:
    """One plan for a full and a windowed layer (Qwen2 with max_window_layers): each forward
    equals dense attention with its own mask, on NaN caches."""
    rng = random.Random(page_size * 1000 + window)
    shapes = WINDOW_SHAPES[:]
    rng.shuffle(shapes)
    generator = torch.Generator().manual_seed(window)
    tables, kv_lens, num_new, num_pages = random_batch(rng, page_size, shapes)
    k_cache, v_cache = fill_caches(tables, kv_lens, num_pages, page_size, 2, 16, torch.float32, generator)
    q = torch.randn(sum(num_new), 4, 16, generator=generator)
    meta = AttentionMetadata.build(tables, kv_lens, num_new, page_size, "cpu")
    backend = TorchBackend(use_kernel=use_kernel)
    backend.plan(meta, num_qo_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
                 windows=[None, window])
    for layer_window in (None, window):
        out = backend.forward(q, k_cache, v_cache, sm_scale=0.3, window=layer_window)
        expected = dense_attention(q, k_cache, v_cache, tables, kv_lens, num_new, 0.3, layer_window)
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="window 7 was not planned"):
        backend.forward(q, k_cache, v_cache, sm_scale=0.3, window=7)


def test_window_mask_boundary_is_exact() -> None:
    """The query at position p sees p - W + 1 .. p: W keys, not W + 1 or W - 1. Values are
    one-hot per position, so the output says exactly which keys were averaged."""
    window, kv_len = 4, 10
    k_cache = torch.zeros(kv_len, 1, 1, 16)  # page size 1; equal scores: a plain average
    v_cache = torch.eye(16)[:kv_len].view(kv_len, 1, 1, 16)
    meta = AttentionMetadata.build([list(range(kv_len))], [kv_len], [kv_len], 1, "cpu")
    backend = TorchBackend()
    backend.plan(meta, num_qo_heads=1, num_kv_heads=1, head_dim=16, dtype=torch.float32, windows=[window])
    out = backend.forward(torch.ones(kv_len, 1, 16), k_cache, v_cache, sm_scale=1.0, window=window)
    for p in range(kv_len):
        seen = list(range(max(0, p - window + 1), p + 1))
        expected = torch.zeros(16)
        expected[seen] = 1.0 / len(seen)
        torch.testing.assert_close(out[p, 0], expected)


def test_bfloat16_attention_is_close_to_exact() -> None:
    rng = random.Random(7)
    generator = torch.Generator().manual_seed(7)
    tables, kv_lens, num_new, num_pages = random_batch(rng, 4, RAGGED_SHAPES)
    k_cache, v_cache = fill_caches(tables, kv_lens, num_pages, 4, 2, 32, torch.bfloat16, generator)
    q = torch.randn(sum(num_new), 4, 32, generator=generator).to(torch.bfloat16)
    meta = AttentionMetadata.build(tables, kv_lens, num_new, 4, "cpu")
    backend = TorchBackend()
    backend.plan(meta, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.bfloat16)
    out = backend.forward(q, k_cache, v_cache, sm_scale=32**-0.5)
    assert out.dtype == torch.bfloat16
    expected = dense_attention(q, k_cache, v_cache, tables, kv_lens, num_new, 32**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_batch_without_new_tokens_gives_empty_output() -> None:
    meta = AttentionMetadata.build([[0], []], [3, 0], [0, 0], 4, "cpu")
    backend = TorchBackend()
    backend.plan(meta, num_qo_heads=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    out = backend.forward(torch.empty(0, 2, 8), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8),
                          sm_scale=1.0)
    assert out.shape == (0, 2, 8)


def test_create_backend_picks_torch_without_cuda() -> None:
    assert isinstance(create_backend(None, "cpu"), TorchBackend)
    assert isinstance(create_backend("torch", "cpu"), TorchBackend)
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        create_backend("xformers", "cpu")


@pytest.mark.skipif(torch.cuda.is_available() and flashinfer_available(),
                    reason="flashinfer is usable here")
def test_create_backend_explains_missing_flashinfer() -> None:
    with pytest.raises(RuntimeError, match=r"needs CUDA and `pip install radixserve\[gpu\]`"):
        create_backend("flashinfer", "cpu")


def test_flashinfer_is_not_chosen_or_allowed_for_float32() -> None:
    assert isinstance(create_backend(None, "cpu", torch.float32), TorchBackend)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        create_backend("flashinfer", "cuda", torch.float32)


def test_decode_uses_tensor_cores_above_a_group_of_four() -> None:
    """FlashInfer's decode on tensor cores pays for large GQA groups (SGLang, vLLM: > 4)."""
    from radixserve.attention.flashinfer_backend import decode_uses_tensor_cores

    assert not decode_uses_tensor_cores(32, 32)  # MHA
    assert not decode_uses_tensor_cores(32, 8)  # Llama-3-8B, Mistral-7B: 4
    assert decode_uses_tensor_cores(28, 4)  # Qwen2.5-7B: 7
    assert decode_uses_tensor_cores(64, 8)  # Llama-3-70B: 8
