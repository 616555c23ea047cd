"""Incremental step metadata and the torch backend's grouping, against direct computation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from radixserve.attention import AttentionMetadata, TorchBackend
from radixserve.attention import torch_backend
from radixserve.attention.metadata import MetadataBuilder
from tests.test_attention import dense_attention, fill_caches, random_batch

FIELDS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "positions", "slot_mapping")


def assert_same(a: AttentionMetadata, b: AttentionMetadata) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert a.is_decode == b.is_decode and a.page_size == b.page_size
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "qo_lens"):
        assert np.array_equal(getattr(a.cpu, name), getattr(b.cpu, name)), name


@pytest.mark.parametrize("page_size", [1, 4])
def test_mirrored_tables_give_the_metadata_of_a_fresh_build(page_size: int) -> None:
    """Sequences decode (tables grow by appends), prefill in chunks, get preempted (a new,
    shorter list), have pages swapped for the tree's (a new list), finish and arrive."""
    rng = random.Random(page_size)
    builder = MetadataBuilder(page_size, "cpu", verify=True)
    next_page = iter(range(10**6))
    seqs: dict[int, dict] = {}
    for step in range(120):
        if len(seqs) < 6 or rng.random() < 0.2:
            seqs[step] = {"table": [], "computed": 0, "tokens": rng.randint(1, 40)}
        for sid in list(seqs):
            if rng.random() < 0.05:
                del seqs[sid]  # finished
        batch = []
        for sid, s in seqs.items():
            roll = rng.random()
            if roll < 0.05:  # preempted: starts over in a new list
                s["table"], s["computed"] = [], 0
            elif roll < 0.1 and s["table"]:  # pages replaced by the tree's: a new list
                s["table"] = [next(next_page) for _ in s["table"]]
            if roll > 0.9:
                continue  # not scheduled this step
            new = min(rng.randint(1, 9), s["tokens"] - s["computed"]) if s["computed"] < s["tokens"] else 1
            s["tokens"] = max(s["tokens"], s["computed"] + new)
            need = -(-(s["computed"] + new) // page_size)
            while len(s["table"]) < need + rng.randint(0, 1):
                s["table"].append(next(next_page))  # in place: the mirror copies only these
            batch.append((sid, s, new))
        meta = builder.build([sid for sid, _, _ in batch], [s["table"] for _, s, _ in batch],
                             [s["computed"] + new for _, s, new in batch], [new for *_, new in batch])
        fresh = AttentionMetadata.build([s["table"] for _, s, _ in batch],
                                        [s["computed"] + new for _, s, new in batch],
                                        [new for *_, new in batch], page_size, "cpu")
        assert_same(meta, fresh)
        for _, s, new in batch:
            s["computed"] += new
    assert builder.num_mirrors <= len(seqs) + 64 + 10


def test_a_table_changed_in_place_is_caught_when_verifying() -> None:
    table = [3, 4]
    builder = MetadataBuilder(4, "cpu", verify=True)
    builder.build([7], [table], [6], [6])
    table[0] = 9  # breaks the contract: replace the list instead
    with pytest.raises(AssertionError, match="changed in place"):
        builder.build([7], [table], [7], [1])
    trusting = MetadataBuilder(4, "cpu")
    trusting.build([7], [[3, 4]], [6], [6])


def test_too_short_a_table_is_refused() -> None:
    with pytest.raises(ValueError, match="block table has 1"):
        MetadataBuilder(4, "cpu").build([0], [[5]], [6], [6])


@pytest.mark.parametrize("max_elements", [1 << 26, 2048])
def test_groups_bound_padding_and_gather_size_and_stay_exact(monkeypatch: pytest.MonkeyPatch,
                                                             max_elements: int) -> None:
    """Lengths from 1 to 900 tokens: several groups, each padded by at most MAX_PADDING (or a
    single sequence), each gathering at most the bound (unless one sequence needs more)."""
    monkeypatch.setattr(torch_backend, "MAX_GATHER_ELEMENTS", max_elements)
    rng = random.Random(11)
    shapes = [(rng.choice([1, 3, 40, 41, 300, 310, 900]), 1) for _ in range(24)]
    shapes += [(rng.randint(2, 900), rng.randint(2, 60)) for _ in range(8)]
    shapes = [(max(kv, new), new) for kv, new in shapes]
    shapes += [(30, 30), (30, 30), (45, 45), (8, 8), (8, 8)]  # fresh prompts: causal groups
    tables, kv_lens, num_new, num_pages = random_batch(rng, 4, shapes)
    generator = torch.Generator().manual_seed(2)
    k_cache, v_cache = fill_caches(tables, kv_lens, num_pages, 4, 2, 8, torch.float32, generator)
    q = torch.randn(sum(num_new), 4, 8, generator=generator)
    meta = AttentionMetadata.build(tables, kv_lens, num_new, 4, "cpu")
    backend = TorchBackend(use_kernel=False)  # the gather path's groups, decodes included
    backend.plan(meta, num_qo_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    groups = backend._groups[None] if backend._groups is not None else None
    assert groups is not None and len(groups) >= 4
    assert sum(g.causal and g.mask is None for g in groups) >= 2  # the 30s together, the 45 alone
    row_elements = 2 * 8
    seen = 0
    for group in groups:
        real = group.out_rows.numel()
        seen += group.num_seqs
        if group.num_seqs > 1:
            assert group.num_seqs * group.num_keys * row_elements <= max_elements
            padded = group.num_seqs * group.num_queries * group.num_keys
            members = [i for i in range(len(shapes)) if num_new[i] and
                       int(meta.qo_indptr[i]) in set(group.out_rows.tolist())]
            area = sum(num_new[i] * kv_lens[i] for i in members)
            assert padded <= (1 + torch_backend.MAX_PADDING) * area
        assert real <= group.num_seqs * group.num_queries
    assert seen == sum(1 for n in num_new if n)
    out = backend.forward(q, k_cache, v_cache, sm_scale=0.3)
    expected = dense_attention(q, k_cache, v_cache, tables, kv_lens, num_new, 0.3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_released_pages_leave_the_metadata_and_windowed_attention_is_unchanged(page_size: int) -> None:
    """Sequences whose leading pages left the window of 8 list only the pages they hold
    (released entries are -1 in their tables, the pages themselves NaN): positions stay
    absolute, slots point into held pages, and windowed attention equals dense attention over
    the whole sequence."""
    window = 8
    rng = random.Random(page_size)
    shapes = [(70, 1), (33, 1), (9, 1), (64, 5), (40, 12), (5, 5)]
    tables, kv_lens, num_new, num_pages = random_batch(rng, page_size, shapes)
    generator = torch.Generator().manual_seed(page_size)
    k_cache, v_cache = fill_caches(tables, kv_lens, num_pages, page_size, 2, 8, torch.float32, generator)
    q = torch.randn(sum(num_new), 4, 8, generator=generator)
    # What the scheduler releases before a chunk: pages wholly before its first query's window.
    dropped = [max(0, kv - new - window + 1) // page_size for kv, new in shapes]
    assert sum(dropped) > 0
    held_tables = []
    for table, d in zip(tables, dropped):
        k_cache[table[:d]] = float("nan")
        v_cache[table[:d]] = float("nan")
        held_tables.append([-1] * d + table[d:])
    builder = MetadataBuilder(page_size, "cpu", verify=True)
    meta = builder.build(list(range(len(shapes))), held_tables, kv_lens, num_new, dropped)
    whole = AttentionMetadata.build(tables, kv_lens, num_new, page_size, "cpu")
    assert torch.equal(meta.positions, whole.positions)
    assert torch.equal(meta.slot_mapping, whole.slot_mapping)
    assert meta.cpu.kv_lens.tolist() == [kv - d * page_size for kv, d in zip(kv_lens, dropped)]
    assert (meta.cpu.kv_indices >= 0).all()
    backend = TorchBackend()
    backend.plan(meta, num_qo_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, windows=[window])
    out = backend.forward(q, k_cache, v_cache, sm_scale=0.3, window=window)
    expected = dense_attention(q, k_cache, v_cache, tables, kv_lens, num_new, 0.3, window)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    # Attention that would need a released page fails loudly: a full layer, a wider window.
    for windows in ([None], [window + page_size]):
        with pytest.raises(ValueError, match="tokens before its first held page"):
            TorchBackend().plan(meta, num_qo_heads=4, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                                windows=windows)
    # A released page inside what is attended is caught in debug mode.
    with pytest.raises(AssertionError, match="has released one of them"):
        builder.build([0], [held_tables[0]], [kv_lens[0]], [num_new[0]], [0])
