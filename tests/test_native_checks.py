"""The checking layer in front of the C kernels: what a kernel would misread is refused with a
ValueError before C runs, one thread-count read sizes the scratch and runs the call, and in an
engine a bad input fails its one request, not the process."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from radixserve import Engine
from radixserve.attention import AttentionMetadata, TorchBackend
from radixserve.native import paged_attention, sampling, scratch
from tests.test_cpu_kernel import plan_decodes
from tests.test_engine_isolation import GREEDY, INNOCENT, run

HEADS = dict(num_qo_heads=4, num_kv_heads=2, head_dim=16)


def decode_batch(seed: int = 1) -> tuple:
    """Three decodes over 4-token pages: tables, caches, q and the metadata."""
    return plan_decodes([(20, 1), (9, 1), (13, 1)], 4, 4, 2, 16, seed=seed)


def kernel_output(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor) -> torch.Tensor:
    backend = TorchBackend()
    backend.plan(meta, **HEADS, dtype=torch.float32)
    return backend.forward(q, k_cache, v_cache, sm_scale=0.25)


def rows_of(meta: AttentionMetadata, kv_indices: torch.Tensor | np.ndarray | None = None
            ) -> paged_attention.PagedRows:
    """Every sequence of a decode-only `meta` as kernel rows over all its keys."""
    cpu = meta.cpu
    return paged_attention.PagedRows(cpu.kv_indices if kv_indices is None else kv_indices,
                                     cpu.qo_indptr[:-1], cpu.kv_indptr[:-1], np.zeros(len(cpu.kv_lens), np.int64),
                                     cpu.kv_lens, page_size=meta.page_size)


def with_page(meta: AttentionMetadata, sequence: int, page: int) -> AttentionMetadata:
    """`meta` with the first page of `sequence` replaced by `page` (a copy)."""
    kv = meta.cpu.kv_indices.astype(np.int64)
    kv[meta.cpu.kv_indptr[sequence]] = page
    cpu = dataclasses.replace(meta.cpu, kv_indices=kv)
    return dataclasses.replace(meta, kv_indices=torch.from_numpy(kv), cpu=cpu)


@pytest.mark.parametrize("past", [0, 1, 2**30, 2**31 - 1 - 40, 2**40])
def test_a_page_index_past_the_pool_raises_before_the_kernel_reads_it(past: int) -> None:
    """Just past (the pool's size), far past (once a segfault), and past int32 (once wrapped)."""
    _, _, _, k_cache, v_cache, q, meta = decode_batch()
    bad = with_page(meta, 1, k_cache.shape[0] + past)
    with pytest.raises(ValueError, match=r"page index \d+ is past"):
        kernel_output(bad, q, k_cache, v_cache)


def test_a_negative_page_index_raises() -> None:
    _, _, _, k_cache, v_cache, q, meta = decode_batch()
    with pytest.raises(ValueError, match="page index -3 is negative"):
        kernel_output(with_page(meta, 2, -3), q, k_cache, v_cache)


def test_only_the_pages_the_rows_read_are_checked() -> None:
    """A page a row lists but never reads (beyond its keys, or before its window) may be
    anything: the engine's tables hold spare pages."""
    _, _, _, k_cache, v_cache, q, meta = decode_batch()
    cpu = meta.cpu
    kv = cpu.kv_indices.astype(np.int64)
    # Sequence 0 has 20 keys (pages 0-4 of its table); read only keys 8 .. 19: its first two
    # pages are not read.
    kv[cpu.kv_indptr[0]] = 10**6
    rows = paged_attention.PagedRows(kv, cpu.qo_indptr[:1], cpu.kv_indptr[:1], [8], [20], page_size=4)
    assert rows.checked.max_page < k_cache.shape[0]
    out = torch.zeros_like(q)
    paged_attention.run(q, k_cache, v_cache, rows, out, scale=0.25)
    assert torch.isfinite(out[0]).all()


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_int64_kv_indices_give_the_int32_result(dtype: torch.dtype) -> None:
    _, _, _, k_cache, v_cache, q, meta = decode_batch()
    expected = kernel_output(meta, q, k_cache, v_cache)
    out = torch.empty_like(q)
    paged_attention.run(q, k_cache, v_cache, rows_of(meta, meta.kv_indices.to(dtype)), out, scale=0.25)
    assert torch.equal(out, expected)


def test_index_arrays_that_are_not_integers_are_refused() -> None:
    _, _, _, _, _, _, meta = decode_batch()
    with pytest.raises(ValueError, match="kv_indices must be a 1-D integer array, got float32"):
        rows_of(meta, meta.cpu.kv_indices.astype(np.float32))


@pytest.mark.parametrize(("change", "message"), [
    (dict(hi=[20, 9, 0]), r"at least one key \(hi > lo\); row 2 has 0"),
    (dict(lo=[-1, 0, 0]), "lo .* must be >= 0; row 0 has -1"),
    (dict(hi=[20, 9, 99]), "pages run past the end of kv_indices"),
    (dict(rows=[0, -2, 2]), "query rows must be >= 0; row 1 has -2"),
    (dict(page_start=[0, -5, 0]), "page_start must be >= 0"),
    (dict(rows=[0, 1]), "differ in length"),
])
def test_rows_out_of_bounds_are_refused(change: dict, message: str) -> None:
    _, _, _, _, _, _, meta = decode_batch()
    cpu = meta.cpu
    arguments = dict(rows=cpu.qo_indptr[:-1], page_start=cpu.kv_indptr[:-1], lo=[0, 0, 0], hi=cpu.kv_lens)
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        paged_attention.PagedRows(cpu.kv_indices, page_size=4, **arguments)


def test_calls_that_do_not_fit_the_rows_are_refused() -> None:
    _, _, _, k_cache, v_cache, q, meta = decode_batch()
    rows = rows_of(meta)
    out = torch.empty_like(q)
    cases = [
        ((q[:2], k_cache, v_cache, rows, out[:2]), "query row 2 is attended, but q has 2 rows"),
        ((q[..., :8].contiguous(), k_cache, v_cache, rows, out[..., :8].contiguous()), "head_dim 8 differs"),
        ((q, k_cache.view(-1, 2, 2, 16), v_cache.view(-1, 2, 2, 16), rows, out), "planned for pages of 4"),
        ((q[:, :3].contiguous(), k_cache, v_cache, rows, out[:, :3].contiguous()), "3 query heads cannot share 2"),
        ((q, k_cache, v_cache[:-1], rows, out), "shapes"),
        ((q, k_cache, v_cache, rows, out[:, :, None]), "shapes"),
        ((q, k_cache, v_cache.double(), rows, out), "got v_cache torch.float64"),
        ((q, k_cache, v_cache, rows, out.transpose(0, 1)), r"got out torch.float32 \(not contiguous\)"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            paged_attention.run(*arguments, scale=0.25)


def count_thread_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Makes torch.get_num_threads return 1 at its first read and 3 after (as if another
    thread changed the setting in between), recording each read."""
    reads: list[int] = []

    def get_num_threads() -> int:
        reads.append(1 if not reads else 3)
        return reads[-1]

    monkeypatch.setattr(torch, "get_num_threads", get_num_threads)
    monkeypatch.setattr(scratch._local, "buffers", {})  # this thread's scratch starts empty
    return reads


def spy(monkeypatch: pytest.MonkeyPatch, library: object, function: str, threads_at: int) -> list[int]:
    """Records the thread count each call of `function` receives, then calls it."""
    received: list[int] = []
    real = getattr(library, function)

    def wrapper(*args: Any) -> Any:
        received.append(args[threads_at])
        return real(*args)

    monkeypatch.setattr(library, function, wrapper)
    return received


def test_attention_reads_the_thread_count_once_for_scratch_and_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two reads would size the scratch for one thread and run three on it."""
    _, _, _, k_cache, v_cache, q, meta = decode_batch()
    rows = rows_of(meta)
    expected = kernel_output(meta, q, k_cache, v_cache)
    received = spy(monkeypatch, paged_attention.library(), "radixserve_paged_attention", -2)  # then dtype
    reads = count_thread_reads(monkeypatch)
    out = torch.empty_like(q)
    paged_attention.run(q, k_cache, v_cache, rows, out, scale=0.25)
    assert reads == received == [1]
    per_thread, shared = paged_attention.scratch_layout(4, 16, rows.max_keys, len(rows))
    assert scratch._local.buffers[paged_attention.NAME].size >= received[0] * per_thread + shared
    paged_attention.run(q, k_cache, v_cache, rows, out, scale=0.25)  # the next call: 3 threads
    assert reads == received == [1, 3]
    assert scratch._local.buffers[paged_attention.NAME].size >= 3 * per_thread + shared
    assert torch.equal(out, expected)


def test_sampling_reads_the_thread_count_once_for_scratch_and_call(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    ones = np.ones(6)
    arguments = (logits, ones, np.zeros(6, np.int64), ones * 0.9, ones * 0.0, ones * 0.5)
    expected, _ = sampling.run(*arguments)
    received = spy(monkeypatch, sampling.library(), "radixserve_sample", -1)
    reads = count_thread_reads(monkeypatch)
    for call in (1, 2):
        tokens, _ = sampling.run(*arguments)
        assert reads == received == [1, 3][:call]
        assert scratch._local.buffers[sampling.NAME].size >= received[-1] * sampling.SCRATCH_PER_VOCAB * 300
        assert tokens.tolist() == expected.tolist()


@pytest.mark.parametrize(("change", "message"), [
    (dict(temperature=np.ones(3)), r"temperature must hold one entry per row \(4\), got shape \(3,\)"),
    (dict(top_k=np.zeros((4, 1))), "top_k must hold one entry per row"),
    (dict(u=np.zeros(5)), "u must hold one entry per row"),
    (dict(temperature=np.array([1.0, np.nan, 1.0, 1.0])), r"temperature must be >= 0 \(0: greedy\); row 1 has nan"),
    (dict(temperature=np.array([1.0, 1.0, -0.5, 1.0])), "temperature must be >= 0"),
    (dict(u=np.array([0.5, 0.5, 0.5, -0.1])), r"u must lie in \[0, 1\]; row 3"),
    (dict(logits=torch.zeros(4, 0)), "vocabulary of 1 .. 2"),
    (dict(logits=torch.zeros(5, 4).t()), "rows of unit stride"),
    (dict(logits=torch.zeros(4, 5, dtype=torch.float64)), "float32 logits"),
    (dict(logits=torch.zeros(4, 5, 1)), "2-D"),
])
def test_sampler_arguments_the_kernel_would_misread_are_refused(change: dict, message: str) -> None:
    arguments = dict(logits=torch.zeros(4, 5), temperature=np.ones(4), top_k=np.zeros(4, np.int64),
                     top_p=np.ones(4), min_p=np.zeros(4), u=np.full(4, 0.5))
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        sampling.run(**arguments)


@pytest.mark.parametrize("past", [0, 2**30])
def test_a_corrupt_page_table_fails_its_request_and_the_engine_carries_on(
        tiny_llama_dir: Path, past: int, caplog: pytest.LogCaptureFixture) -> None:
    """One decoding sequence's first page is replaced, in the step's metadata only, by a page
    index past the pool: the kernel's check raises, the engine ends that request with
    "error", and its batch-mates get what they get alone."""
    alone = run(Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128), INNOCENT)
    engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128)
    assert isinstance(engine.runner.backend, TorchBackend) and paged_attention.library() is not None
    build = engine.runner.metadata.build

    def corrupting_build(seq_ids: list[int], tables: list, kv_lens: list[int], num_new: list[int],
                         dropped: list[int] | None = None) -> AttentionMetadata:
        meta = build(seq_ids, tables, kv_lens, num_new, dropped)
        for i, seq_id in enumerate(seq_ids):
            if seq_id == bad_seq[0] and num_new[i] == 1 and kv_lens[i] > 4:  # page 0 is read, not written
                meta = with_page(meta, i, engine.pool.num_pages + past)
        return meta

    bad_seq: list[int] = []
    prepare = engine.runner.prepare

    def prepare_noting_the_bad_sequence(chunks: list) -> tuple:
        bad_seq[:] = [c.seq.seq_id for c in chunks if c.seq.request.request_id == "bad"] or [-1]
        return prepare(chunks)

    engine.runner.metadata.build = corrupting_build  # type: ignore[method-assign]
    engine.runner.prepare = prepare_noting_the_bad_sequence  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR):
        mixed = run(engine, {**INNOCENT, "bad": ([5, 6, 7, 8, 9, 10], GREEDY)})
    assert mixed.pop("bad")[0] == ["error"]
    assert mixed == alone
    failures = [r for r in caplog.records if r.exc_info and "forward pass failed" in r.getMessage()]
    assert failures and all(isinstance(r.exc_info[1], ValueError) and "is past the pool" in str(r.exc_info[1])
                            for r in failures)
    assert engine.tree.locked_pages == 0
    assert engine.pool.num_free + engine.tree.cached_pages == engine.pool.num_pages
