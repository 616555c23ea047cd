"""The C sampler against the torch sampler: same filtered distributions, same tokens, same
errors, and safe from several threads at once."""

from __future__ import annotations

import ctypes
import re
import threading

import numpy as np
import pytest
import torch

from radixserve.native import sampling as native_sampling
from radixserve.engine.params import SamplingParams
from radixserve.engine.sampler import _param_tensors, filter_probs, sample
from radixserve.grammar import TokenMask

GRID = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m)
        for t in (1e-5, 0.3, 1.0, 2.0) for p in (1e-300, 0.2, 0.9, 0.999, 1.0)
        for k in (0, 1, 7, 63, 10**9) for m in (0.0, 1e-9, 0.3, 1.0)]


def native_filter(logits: torch.Tensor, params: list[SamplingParams]) -> np.ndarray:
    values = np.array([(p.temperature, p.top_k, p.top_p, p.min_p) for p in params], dtype=np.float64)
    _, probs = native_sampling.run(logits, values[:, 0], values[:, 1].astype(np.int64), values[:, 2],
                                   values[:, 3], np.zeros(len(params)), want_probs=True)
    assert probs is not None
    return probs


@pytest.mark.parametrize("scale", [0.1, 3.0, 30.0])
def test_filtered_distributions_equal_the_torch_filters(scale: float) -> None:
    """Every combination of temperature, top-p, top-k and min-p on flat, trained-like and
    sharp logits (200 tokens, some of them tied): the same kept tokens, the same
    probabilities to float32 rounding."""
    generator = torch.Generator().manual_seed(int(scale * 10))
    row = torch.randn(200, generator=generator) * scale
    row[50:53] = row[10]  # ties
    logits = row.expand(len(GRID), -1).contiguous()
    expected = filter_probs(logits, *_param_tensors(GRID, logits.device)).numpy()
    got = native_filter(logits, GRID)
    mismatched = [(GRID[r], np.flatnonzero((got[r] > 0) != (expected[r] > 0)).tolist())
                  for r in range(len(GRID)) if not np.array_equal(got[r] > 0, expected[r] > 0)]
    assert not mismatched, mismatched[:3]
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-30)


def test_tokens_equal_the_torch_sampler_over_many_draws() -> None:
    """2,560 seeded draws at a 32,000-token vocabulary: the two paths give the same tokens
    (they could differ only where rounding puts a token on an edge)."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 32000, generator=generator) * 4
    params = [SamplingParams(temperature=0.0) if i % 4 == 0 else
              SamplingParams(temperature=0.7 + i / 64, top_p=0.8 + (i % 3) / 20, min_p=0.01 * (i % 2))
              for i in range(64)]
    seeds = [None if p.greedy else 1000 + i for i, p in enumerate(params)]
    native, torch_path, steps = [], [], range(40)
    for step in steps:
        native.append(sample(logits, params, seeds, [step] * 64))
    original = native_sampling.usable
    native_sampling.usable = lambda logits: False  # type: ignore[assignment]
    try:
        for step in steps:
            torch_path.append(sample(logits, params, seeds, [step] * 64))
    finally:
        native_sampling.usable = original  # type: ignore[assignment]
    assert native == torch_path


def test_non_finite_rows_are_named_by_their_batch_index() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, float("nan"), 1.0], [float("inf"), 0.0, 0.0],
                           [float("-inf")] * 3])
    params = [SamplingParams(temperature=1.0)] * 4
    with pytest.raises(ValueError, match=r"cannot sample rows \[1, 2, 3\]: their logits are not finite"):
        sample(logits, params, [1, 2, 3, 4], [0] * 4)
    tokens, _ = native_sampling.run(logits, np.ones(4), np.zeros(4, np.int64), np.ones(4), np.zeros(4),
                                    np.full(4, 0.5))
    assert tokens[1:].tolist() == [-1, -1, -1] and 0 <= tokens[0] <= 2


def test_greedy_rows_take_torchs_argmax_ties_and_nan_included() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 5.0, float("nan"), 1.0], [-1.0, -1.0, -2.0, -3.0]])
    tokens, _ = native_sampling.run(logits, np.zeros(3), np.zeros(3, np.int64), np.ones(3), np.zeros(3), np.zeros(3))
    assert tokens.tolist() == torch.argmax(logits, dim=-1).tolist() == [1, 0, 0]


def test_threads_sampling_at_once_get_their_own_results() -> None:
    """ctypes releases the GIL: engines in two threads sample at once, each with its own
    scratch; and the kernel's own threads give what one thread gives."""
    generator = torch.Generator().manual_seed(9)
    batches = [torch.randn(32, 5000, generator=generator) * 3 for _ in range(4)]
    params = [SamplingParams(temperature=0.9, top_p=0.95)] * 32
    seeds = list(range(32))
    expected = [sample(b, params, seeds, [0] * 32) for b in batches]
    results: dict[int, list[list[int]]] = {}

    def work(index: int) -> None:
        results[index] = [sample(batches[index], params, seeds, [0] * 32) for _ in range(30)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(4):
        assert all(tokens == expected[index] for tokens in results[index])
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert [sample(b, params, seeds, [0] * 32) for b in batches] == expected
    finally:
        torch.set_num_threads(previous)


def test_one_kernel_thread_gives_what_several_give() -> None:
    """Each row is one thread's work: with one OpenMP thread the kernel samples the same
    tokens, with the same log-probabilities, as with four (the engine's default count is the
    machine's, so both ends are pinned here)."""
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(48, 3000, generator=generator) * 2
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=k, min_p=0.01) for k in (0, 40, 3)] * 16
    seeds = list(range(48))
    previous = torch.get_num_threads()
    outputs = {}
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            outputs[threads] = sample(logits, params, seeds, list(range(48)))
    finally:
        torch.set_num_threads(previous)
    assert outputs[1] == outputs[4]


def test_uniforms_drive_the_draw_as_the_torch_path() -> None:
    """u = 0 draws the first kept token in id order, u just below 1 the last; tokens dropped
    by a filter are never drawn, whether the draw runs over the top-p list or the whole row."""
    logits = torch.tensor([[-9.0, 2.0, -9.0, 1.0, 0.5, -9.0]])
    for top_p, min_p in ((0.95, 0.0), (1.0, 0.1)):
        tokens = [native_sampling.run(logits, np.ones(1), np.zeros(1, np.int64), np.full(1, top_p),
                                      np.full(1, min_p), np.array([u]))[0][0] for u in (0.0, 1.0 - 2**-53)]
        assert tokens == [1, 4], (top_p, min_p)


@pytest.mark.parametrize(("top_p", "kept"), [(0.5, 1), (0.6, 2), (0.7, 2), (0.71, 3), (1.0, 5)])
def test_top_p_edges_as_hand_computed(top_p: float, kept: int) -> None:
    """The mass before a token reaching top_p exactly (0.5, 0.7) drops it."""
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    got = native_filter(probs.log()[None].contiguous(), [SamplingParams(top_p=top_p)])[0]
    assert (got > 0).tolist() == [True] * kept + [False] * (5 - kept)
    np.testing.assert_allclose(got[:kept], probs[:kept].numpy(), rtol=1e-6)


def test_the_vectorised_exponential_is_within_two_ulp_of_exp() -> None:
    """Both kernels' softmax rests on it: 10^6 points over [-110, 0], denormals and the
    underflow to 0 included."""
    library = native_sampling.library()
    assert library is not None
    x = np.concatenate([-np.random.default_rng(0).random(1_000_000, dtype=np.float32) * 110,
                        np.array([0.0, -1e-30, -87.3, -103.9, -104.0, -105.0, -np.inf], np.float32)])
    out = np.empty_like(x)
    library.radixserve_exp_nonpositive.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    library.radixserve_exp_nonpositive(x.ctypes.data, out.ctypes.data, len(x))
    exact = np.exp(x.astype(np.float64))
    normal = exact >= np.finfo(np.float32).tiny
    ulp = np.spacing(exact[normal].astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(out[normal] - exact[normal]) / ulp) <= 2.0
    smallest = np.finfo(np.float32).smallest_subnormal
    assert np.max(np.abs(out[~normal] - exact[~normal])) <= smallest
    assert out[-7:].tolist()[:2] == [1.0, 1.0] and out[-3:].tolist() == [0.0, 0.0, 0.0]


def test_the_vectorised_exponential_keeps_nan() -> None:
    """e^NaN is NaN, as expf's: the attention kernel's softmax relies on it to give NaN where
    SDPA does (the clamp below -104 must not catch NaN)."""
    library = native_sampling.library()
    assert library is not None
    x = np.array([np.nan, -np.nan, 0.0, -np.inf], np.float32)
    out = np.empty_like(x)
    library.radixserve_exp_nonpositive.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    library.radixserve_exp_nonpositive(x.ctypes.data, out.ctypes.data, len(x))
    assert np.isnan(out[:2]).all() and out[2:].tolist() == [1.0, 0.0]


@pytest.mark.parametrize("top_p", [0.5, 0.999, 0.99999994])
def test_flat_rows_that_keep_most_tokens_match_the_torch_filter(top_p: float) -> None:
    """A hot temperature over 32,000 tokens with top_p near 1 keeps thousands of candidates:
    the radix-sorted path (and its fall-back when rounding leaves the mass short of top_p)
    keeps exactly what the torch filter keeps. Such a row once cost 63 ms; no request's
    parameters may make every step slow for the others."""
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 32000, generator=generator) * torch.tensor([[0.1], [1.0], [4.0], [0.01]])
    params = [SamplingParams(temperature=2.0, top_p=top_p)] * 4
    expected = filter_probs(logits, *_param_tensors(params, logits.device)).numpy()
    got = native_filter(logits, params)
    softmax = torch.softmax(logits / 2.0, dim=-1).numpy()
    for row in range(4):
        # 16,000 near-equal probabilities: a 1-ulp difference between the two softmaxes may
        # move the cut by one token, and only a token at the cut, never more than one.
        differ = np.flatnonzero((got[row] > 0) != (expected[row] > 0))
        assert differ.size <= 1, differ
        cut = min(got[row][got[row] > 0].min(), expected[row][expected[row] > 0].min())
        assert np.allclose(softmax[row][differ], cut, rtol=1e-6)
        same = ~np.isin(np.arange(32000), differ)
        np.testing.assert_allclose(got[row][same], expected[row][same], rtol=2e-5, atol=1e-30)
    assert int((got[0] > 0).sum()) > 1000  # the many-candidates path ran


def unpacked_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The logits masked by `bitmask` (mask row i for logits row rows[i]) with numpy's bit
    unpacking: token t is bit t of the row's little-endian words (no code of the package)."""
    allowed = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :logits.shape[1]]
    out = logits.clone()
    for i, row in enumerate(rows):
        out[row, torch.from_numpy(allowed[i] == 0)] = float("-inf")
    return out


def torch_greedy(premasked: torch.Tensor) -> tuple[list[int], list[int]]:
    """torch.argmax of each row, and the rows whose chosen logit is NaN or -inf (no token)."""
    tokens = torch.argmax(premasked, dim=-1)
    chosen = premasked.gather(1, tokens[:, None]).squeeze(1)
    bad = torch.isnan(chosen) | (chosen == float("-inf"))
    return tokens.tolist(), bad.nonzero().squeeze(1).tolist()


@pytest.mark.parametrize("threads", [1, 3])
def test_constrained_greedy_steps_take_torchs_argmax_of_the_masked_rows(threads: int) -> None:
    """An all-greedy step with a grammar mask (the C greedy function: mask, maximum and its
    first index in one pass) gives the tokens, errors and masked logits of the mask applied
    first and torch's argmax after: 600 random steps over vocabularies on both sides of 32 and
    64, integer logits full of ties (some -inf, a few NaN), masks random, with one allowed
    token, or with all, on some rows or all of them, rows contiguous or strided."""
    generator = torch.Generator().manual_seed(threads)
    vocabs = [1, 2, 31, 32, 33, 63, 64, 65, 97, 1000, 2051]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for case in range(600):
            vocab, num_rows = vocabs[case % len(vocabs)], 1 + case % 7
            values = torch.randint(-3, 3, (num_rows, vocab), generator=generator).float()
            values[values == -3] = float("-inf")
            if case % 10 == 0:
                values.view(-1)[int(torch.randint(0, values.numel(), (1,), generator=generator))] = float("nan")
            rows = list(range(num_rows)) if case % 3 == 0 else sorted(set(
                torch.randint(0, num_rows, (num_rows,), generator=generator).tolist()))
            bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), (vocab + 31) // 32), dtype=torch.int32,
                                    generator=generator)
            if case % 4 == 1:  # one allowed token per masked row
                bitmask.zero_()
                for i in range(len(rows)):
                    token = int(torch.randint(0, vocab, (1,), generator=generator))
                    bitmask[i, token // 32] = 1 << (token % 32) if token % 32 != 31 else -2**31
            elif case % 4 == 2:  # every token allowed
                bitmask.fill_(-1)
            wide = torch.randn(num_rows, vocab + 5, generator=generator)
            logits = wide[:, :vocab] if case % 2 else values.clone()  # rows of stride vocab + 5
            logits.copy_(values)
            premasked = unpacked_mask(values, bitmask, rows)
            expected, bad = torch_greedy(premasked)
            params = [SamplingParams(temperature=0.0)] * num_rows
            if bad:
                with pytest.raises(ValueError, match=re.escape(f"cannot sample rows {bad}: their logits are not finite")):
                    sample(logits, params, [None] * num_rows, [0] * num_rows, TokenMask(bitmask, rows))
            else:
                assert sample(logits, params, [None] * num_rows, [0] * num_rows, TokenMask(bitmask, rows)) == expected
            assert torch.equal(logits.isnan(), premasked.isnan()), case
            assert torch.equal(logits.nan_to_num(0.0), premasked.nan_to_num(0.0)), case
            if case % 2:
                assert not wide[:, vocab:].isinf().any()  # nothing written past a strided row
    finally:
        torch.set_num_threads(previous)


def test_constrained_greedy_rows_at_the_models_width_take_the_first_maximum() -> None:
    """A 49,152-token row (SmolLM2's) whose top logit recurs in allowed and forbidden places,
    the first copy forbidden: the first allowed copy is taken, as torch's argmax takes it."""
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(2))
    logits[:, [7, 40000, 40001, 49151]] = 50.0
    bitmask = torch.full((2, 49152 // 32), -1, dtype=torch.int32)
    bitmask[:, 0] = ~(1 << 7)  # token 7 forbidden in the masked rows
    bitmask[1, 40000 // 32] = 0  # and, in row 2, the whole word of 40000 and 40001
    params = [SamplingParams(temperature=0.0)] * 3
    assert sample(logits, params, [None] * 3, [0] * 3, TokenMask(bitmask, [0, 2])) == [40000, 7, 49151]


def test_constrained_greedy_masks_are_checked_before_c() -> None:
    """A mask that does not fit the step's logits is refused before any row is touched."""
    logits = torch.randn(2, 100)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0)] * 2
    with pytest.raises(ValueError, match="masked rows"):
        sample(logits, params, [None] * 2, [0] * 2, TokenMask(torch.zeros(1, 4, dtype=torch.int32), [2]))
    with pytest.raises(ValueError, match="int32"):
        sample(logits, params, [None] * 2, [0] * 2, TokenMask(torch.zeros(1, 3, dtype=torch.int32), [0]))
    assert torch.equal(logits, before)
    with pytest.raises(ValueError, match="at least one token"):
        native_sampling.greedy_tokens(torch.zeros(2, 0), None)


def test_greedy_steps_take_the_c_function_and_equal_torchs_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every all-greedy step on float32 CPU logits takes the C greedy function (one call, the
    mask applied in the same pass when there is one); logits it cannot read (not float32)
    keep torch's argmax. The tokens are torch.argmax's either way."""
    calls = []
    greedy_tokens = native_sampling.greedy_tokens
    monkeypatch.setattr(native_sampling, "greedy_tokens", lambda *args: calls.append(args) or greedy_tokens(*args))
    logits = torch.randn(4, 70, generator=torch.Generator().manual_seed(1))
    logits[2, 7] = logits[2, 40] = logits[2].max() + 1.0  # a tie: the first index, as torch's
    params = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits.clone(), params, [None] * 4, [0] * 4) == torch.argmax(logits, dim=-1).tolist()
    assert len(calls) == 1 and calls[0][1] is None
    assert torch.argmax(logits[2]).item() == 7
    bitmask = torch.zeros(1, 3, dtype=torch.int32)
    bitmask[0, 2] = 1 << 5  # token 69 alone
    tokens = sample(logits.clone(), params, [None] * 4, [0] * 4, TokenMask(bitmask, [1]))
    assert len(calls) == 2 and calls[1][1] is not None and tokens[1] == 69
    assert tokens[:1] + tokens[2:] == torch.argmax(logits[[0, 2, 3]], dim=-1).tolist()
    as_double = logits.double()
    assert sample(as_double, params, [None] * 4, [0] * 4) == torch.argmax(logits, dim=-1).tolist()
    assert len(calls) == 3  # called, found the logits unreadable, left them to torch
    nan_row = logits.clone()
    nan_row[3, 5] = float("nan")
    with pytest.raises(ValueError, match=r"rows \[3\]"):
        sample(nan_row, params, [None] * 4, [0] * 4)
