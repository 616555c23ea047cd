"""Sampling filters against hand-computed distributions; seeds reproduce."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from radixserve import Engine
from radixserve.engine import sampler as sampler_module
from radixserve.native import sampling as native_sampling
from radixserve.engine.params import SamplingParams
from radixserve.engine.sampler import (TOP_P_CANDIDATES, _param_tensors, filter_logits, filter_probs,
                                       sample, seeded_uniforms)


@pytest.fixture(autouse=True, params=["native", "torch"])
def sampler_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test here runs on both paths of `sample`: the C sampler and the torch code."""
    if request.param == "torch":
        monkeypatch.setattr(native_sampling, "usable", lambda logits: False)
    else:
        assert native_sampling.library() is not None, "the C sampler must build where the tests run"
    return request.param


PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
LOGITS = PROBS.log()


def test_temperature_one_without_filters_is_the_softmax() -> None:
    assert torch.allclose(filter_logits(LOGITS, SamplingParams()), PROBS, atol=1e-6)


def test_top_k_keeps_the_k_most_likely() -> None:
    probs = filter_logits(LOGITS, SamplingParams(top_k=2))
    assert torch.allclose(probs, torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7, atol=1e-6)


@pytest.mark.parametrize("top_p, kept", [(0.5, 1), (0.6, 2), (0.7, 2), (0.71, 3), (1.0, 5)])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: int) -> None:
    probs = filter_logits(LOGITS, SamplingParams(top_p=top_p))
    expected = torch.zeros(5)
    expected[:kept] = PROBS[:kept] / PROBS[:kept].sum()
    assert torch.allclose(probs, expected, atol=1e-6)


def test_min_p_drops_tokens_below_a_fraction_of_the_best() -> None:
    probs = filter_logits(LOGITS, SamplingParams(min_p=0.3))  # threshold 0.15
    assert torch.allclose(probs, torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85, atol=1e-6)


def test_temperature_sharpens() -> None:
    probs = filter_logits(LOGITS, SamplingParams(temperature=0.5))
    assert math.isclose(float(probs[0]), 0.25 / float((PROBS ** 2).sum()), rel_tol=1e-5)


def test_sampling_follows_the_distribution_and_seeds_reproduce() -> None:
    params = SamplingParams(temperature=1.0, top_k=3)
    draws = [sample(LOGITS[None], [params], [1234], [step])[0] for step in range(3000)]
    freq = [draws.count(i) / len(draws) for i in range(5)]
    assert freq[3] == freq[4] == 0
    assert abs(freq[0] - 0.5 / 0.85) < 0.03 and abs(freq[1] - 0.2 / 0.85) < 0.03
    assert [sample(LOGITS[None], [params], [1234], [step])[0] for step in range(3000)] == draws
    other = [sample(LOGITS[None], [params], [4321], [step])[0] for step in range(3000)]
    assert other != draws


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None], [0, 0]) == [1, 0]


def test_rows_with_different_parameters_match_their_hand_computed_distributions() -> None:
    rows = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(min_p=0.3),
            SamplingParams(temperature=0.5), SamplingParams(top_k=4, top_p=0.8, min_p=0.2)]
    logits = LOGITS.expand(len(rows), -1)
    probs = filter_probs(logits, *_param_tensors(rows, logits.device))
    probs = probs / probs.sum(-1, keepdim=True)
    squared = PROBS**2 / float((PROBS**2).sum())
    expected = torch.stack([
        torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7,
        torch.tensor([0.5, 0.2, 0, 0, 0]) / 0.7,
        torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85,
        squared,
        # top-k 4 keeps 0.5..0.1, min-p 0.2 (threshold 0.1) keeps them, top-p 0.8: 0.5+0.2 < 0.8
        torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85,
    ])
    assert torch.allclose(probs, expected, atol=1e-6)


def reference_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The definition, by a full sort: drop a token once the mass before it reaches top_p."""
    ordered, order = torch.sort(probs, descending=True)
    drop = (torch.cumsum(ordered, -1) - ordered) >= top_p
    drop[0] = False
    return probs.scatter(0, order, ordered.masked_fill(drop, 0.0))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_beyond_the_candidates_equals_a_full_sort(top_p: float) -> None:
    """A flat distribution over 5000 tokens keeps far more than TOP_P_CANDIDATES tokens."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 5000, generator=generator) * torch.tensor([[0.1], [1.0], [4.0]])
    params = [SamplingParams(top_p=top_p)] * 3
    probs = filter_probs(logits, *_param_tensors(params, logits.device))
    for row in range(3):
        expected = reference_top_p(torch.softmax(logits[row], -1), top_p)
        assert torch.equal(probs[row] > 0, expected > 0)
        assert torch.allclose(probs[row], expected)
    assert int((probs[0] > 0).sum()) > TOP_P_CANDIDATES or top_p < 0.1


def test_a_seeded_row_draws_the_same_whatever_its_batch_mates() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=generator)
    mine = SamplingParams(temperature=0.9, top_p=0.95)
    alone = [sample(logits[2:3], [mine], [77], [step])[0] for step in range(40)]
    mates = [SamplingParams(temperature=0.0), SamplingParams(top_k=5), mine,
             SamplingParams(min_p=0.5, temperature=2.0), SamplingParams(top_p=0.3), mine]
    in_batch = [sample(logits, mates, [None, 1, 77, 2, 3, 78], [step, 9, step, 0, 5, step])
                for step in range(40)]
    assert [tokens[2] for tokens in in_batch] == alone
    assert [tokens[5] for tokens in in_batch] != alone  # another seed, same logits: other draws


@pytest.mark.parametrize("params", [
    SamplingParams(top_p=1e-300),
    SamplingParams(top_p=float.fromhex("0x1p-1074")),
    SamplingParams(min_p=1.0),
    SamplingParams(top_k=1),
    SamplingParams(temperature=1e-5, top_p=1e-30),
    SamplingParams(temperature=1.5e-5, top_k=10**12, min_p=1e-30),
])
def test_extreme_parameters_keep_the_top_token(params: SamplingParams) -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -3e38, 1.999], [5.0, -1.0, -1e4, 4.0, 3.0]])
    for step in range(20):
        assert sample(logits, [params, params], [11, 12], [step, step]) == [1, 0]


def test_float32_underflow_of_every_other_token_still_samples_the_top_one() -> None:
    logits = torch.tensor([[0.0, -200.0, 150.0, -3e38]])  # softmax: exactly [0, 0, 1, 0]
    for params in (SamplingParams(), SamplingParams(temperature=2.0, top_p=0.5),
                   SamplingParams(temperature=0.5, min_p=0.9, top_k=3)):
        assert {sample(logits, [params], [3], [step])[0] for step in range(50)} == {2}


def test_every_accepted_value_samples_without_error() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 64, generator=generator) * 30
    grid = [SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m)
            for t in (0.0, 1e-5, 0.3, 2.0) for p in (1e-300, 0.2, 1.0)
            for k in (0, 1, 63, 64, 10**9) for m in (0.0, 1e-9, 0.5, 1.0)]
    tokens = sample(logits.expand(len(grid), -1), grid, list(range(len(grid))), [0] * len(grid))
    best = int(logits.argmax())
    for params, token in zip(grid, tokens):
        probs = filter_logits(logits[0], params)
        assert torch.isfinite(probs).all() and probs.sum() == pytest.approx(1.0)
        assert probs[token] > 0 or params.greedy
        if params.greedy or params.top_k == 1 or params.min_p == 1.0 or params.top_p < 1e-200:
            assert token == best


def test_seeded_uniforms_are_uniform_and_depend_on_seed_and_step() -> None:
    u = seeded_uniforms([5] * 100_000, list(range(100_000)))
    assert u.min() >= 0.0 and u.max() < 1.0
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.all(np.abs(counts - 10_000) < 500)  # about 5 standard deviations
    assert np.array_equal(u, seeded_uniforms([5] * 100_000, list(range(100_000))))
    assert len(set(seeded_uniforms([1, 2, 3, 1], [0, 0, 0, 1]).tolist())) == 4
    assert seeded_uniforms([2**63 - 1], [2**40]).shape == (1,)


def test_a_seeded_request_reproduces_alone_among_others_and_after_preemption(tiny_llama_dir: Path) -> None:
    """Continuous batching mixes the request with different batch-mates at every step; a
    6-page pool preempts and recomputes it. Its tokens must not change."""
    prompt = list(range(30, 50))
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    alone = Engine(str(tiny_llama_dir), page_size=4, num_pages=64, debug_checks=True).generate([prompt], seeded)
    crowd = Engine(str(tiny_llama_dir), page_size=4, num_pages=64, debug_checks=True)
    others = [SamplingParams(max_tokens=n, temperature=t, ignore_eos=True) for n, t in ((3, 0.0), (7, 1.3), (12, 0.7))]
    outputs = crowd.generate([list(range(60, 75)), prompt, list(range(5, 40)), list(range(90, 95))],
                             [others[0], seeded, others[1], others[2]])
    assert outputs[1].token_ids == alone[0].token_ids
    tight = Engine(str(tiny_llama_dir), page_size=4, num_pages=12, debug_checks=True)
    long_output = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    squeezed = tight.generate([list(range(100, 108)), prompt], [long_output, seeded])
    assert tight.stats()["preemptions"] > 0
    assert squeezed[1].token_ids == alone[0].token_ids


def test_non_finite_logits_raise_instead_of_sampling_garbage() -> None:
    """The engine then samples row by row and ends only the request whose logits broke."""
    logits = torch.tensor([[0.0, 1.0, float("nan")], [0.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=1.0)] * 2
    with pytest.raises(ValueError, match=r"cannot sample rows \[0\]"):
        sample(logits, params, [1, 2], [0, 0])
    assert sample(logits[1:], params[1:], [2], [0])[0] in (0, 1, 2)
    with pytest.raises(ValueError, match="not finite"):
        sample(torch.tensor([[float("inf"), 0.0]]), params[:1], [1], [0])


class _CountingTensor(torch.Tensor):
    """Counts the reads that would copy a device tensor to the host (each a sync on CUDA)."""

    host_reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.cpu,
                    torch.Tensor.numpy):
            cls.host_reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nan-row"])
def test_greedy_torch_path_reads_the_device_once(monkeypatch: pytest.MonkeyPatch, bad: bool) -> None:
    """The greedy rows' NaN check rides on the tokens' one copy to the host (as the C
    sampler's -1 does), so a GPU step syncs once, not twice; a NaN row still raises."""
    monkeypatch.setattr(sampler_module.native_sampling, "usable", lambda logits: False)
    logits = torch.tensor([[0.0, 1.0, 0.5], [2.0, 1.0, float("nan") if bad else 0.0]])
    counting = logits.as_subclass(_CountingTensor)
    _CountingTensor.host_reads = 0
    params = [SamplingParams(temperature=0.0)] * 2
    if bad:
        with pytest.raises(ValueError, match=r"cannot sample rows \[1\]"):
            sample(counting, params, [None, None], [0, 0])
    else:
        assert sample(counting, params, [None, None], [0, 0]) == [1, 0]
    assert _CountingTensor.host_reads == 1
