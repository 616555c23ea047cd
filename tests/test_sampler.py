"""Sampling filters against hand-computed distributions; seeds reproduce."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.engine.params import SamplingParams
from radixserve.engine.sampler import filter_logits, sample

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
    gen = torch.Generator().manual_seed(0)
    draws = [sample(LOGITS[None], [params], [gen])[0] for _ in range(3000)]
    freq = [draws.count(i) / len(draws) for i in range(5)]
    assert freq[3] == freq[4] == 0
    assert abs(freq[0] - 0.5 / 0.85) < 0.03 and abs(freq[1] - 0.2 / 0.85) < 0.03
    again = torch.Generator().manual_seed(0)
    assert [sample(LOGITS[None], [params], [again])[0] for _ in range(3000)] == draws


def test_greedy_rows_take_the_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    assert sample(logits, [SamplingParams(temperature=0.0)] * 2, [None, None]) == [1, 0]
