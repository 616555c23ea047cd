"""Benchmark workload generators: shapes, determinism and sharing structure."""

from __future__ import annotations

import numpy as np
import pytest

from radixserve.benchmark.optimum import WorkloadBounds
from radixserve.benchmark.workloads import (
    FIRST_ORDINARY_TOKEN,
    agent_loop,
    few_shot,
    generated_shared_prefix,
    make_workload,
    multi_turn,
    with_poisson_arrivals,
)


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def test_gsp_defaults_shape_and_infinite_bound() -> None:
    w = generated_shared_prefix()
    assert len(w.requests) == 64 * 16
    assert all(r.prompt_ids.dtype == np.int32 and r.prompt_len == 2176 for r in w.requests)
    assert all(r.output_len == 256 and r.shared_len == 2048 for r in w.requests)
    assert [r.index for r in w.requests] == list(range(1024))
    assert sorted(np.bincount([r.group_id for r in w.requests]).tolist()) == [16] * 64
    # SGLang's best possible hit rate: the first prompt of each group computes the system prompt.
    expected = 15 * 2048 / (16 * 2176)
    assert WorkloadBounds(w).infinite().hit_rate == pytest.approx(expected, abs=1e-12)
    assert round(expected, 3) == 0.882


def test_gsp_sharing_is_exactly_the_system_prompt() -> None:
    w = generated_shared_prefix(num_groups=3, prompts_per_group=4, system_len=64, question_len=16)
    for a in w.requests:
        for b in w.requests:
            if a is b:
                continue
            assert _lcp(a.prompt_ids, b.prompt_ids) == (64 if a.group_id == b.group_id else 0)


def test_gsp_shuffle_interleaves_groups_and_order_is_deterministic() -> None:
    w = generated_shared_prefix(num_groups=8, prompts_per_group=8, system_len=32, question_len=8)
    groups = [r.group_id for r in w.requests]
    assert groups != sorted(groups)
    unshuffled = generated_shared_prefix(num_groups=8, prompts_per_group=8, system_len=32, question_len=8,
                                         shuffle=False)
    assert [r.group_id for r in unshuffled.requests] == sorted(groups)


def test_generators_are_deterministic_in_the_seed() -> None:
    for name in ("gsp", "multiturn", "agent", "fewshot"):
        a, b = make_workload(name, seed=3), make_workload(name, seed=3)
        c = make_workload(name, seed=4)
        assert len(a.requests) == len(b.requests)
        assert all(np.array_equal(x.prompt_ids, y.prompt_ids) for x, y in zip(a.requests, b.requests))
        assert any(not np.array_equal(x.prompt_ids, y.prompt_ids) for x, y in zip(a.requests, c.requests))


def test_token_ids_stay_in_the_ordinary_vocabulary_range() -> None:
    w = multi_turn(num_clients=4, num_turns=3, vocab_size=300)
    ids = np.concatenate([r.prompt_ids for r in w.requests])
    assert ids.min() >= FIRST_ORDINARY_TOKEN and ids.max() < 300


def test_multi_turn_round_robin_and_turn_structure() -> None:
    w = multi_turn(num_clients=3, num_turns=4, num_system_prompts=2, system_len=40, message_len=10,
                   output_len=5)
    assert [r.client_id for r in w.requests] == [0, 1, 2] * 4
    for r in w.requests:
        turn = r.index // 3
        assert r.prompt_len == 40 + 10 + turn * (5 + 10)
        assert r.group_id == r.client_id % 2 and r.output_ids is not None and len(r.output_ids) == 5
        if turn == 0:
            assert r.parent is None
        else:
            parent = w.requests[r.parent]
            assert parent.client_id == r.client_id and parent.index == r.index - 3
            grown = np.concatenate([parent.prompt_ids, parent.output_ids])
            assert np.array_equal(r.prompt_ids[: len(grown)], grown)
    first = w.requests[:3]
    # Clients 0 and 2 share system prompt 0 only; client 1 has system prompt 1.
    assert _lcp(first[0].prompt_ids, first[2].prompt_ids) == 40
    assert _lcp(first[0].prompt_ids, first[1].prompt_ids) == 0


def test_multi_turn_infinite_bound_counts_prompts_and_replies() -> None:
    w = multi_turn(num_clients=2, num_turns=2, num_system_prompts=1, system_len=20, message_len=4,
                   output_len=3)
    # Turn 1: client 0 computes all, client 1 hits the system prompt (20).
    # Turn 2: each hits its whole previous prompt + reply (24 + 3).
    prompts = 24 + 24 + 31 + 31
    assert WorkloadBounds(w).infinite().hit_rate == pytest.approx((20 + 27 + 27) / prompts)


def test_agent_loop_appends_reply_and_tool_result() -> None:
    w = agent_loop(num_agents=2, num_steps=3, system_len=30, task_len=5, tool_len=7, output_len=2)
    assert len(w.requests) == 6
    assert [r.prompt_len for r in w.requests] == [35, 35, 44, 44, 53, 53]
    assert _lcp(w.requests[0].prompt_ids, w.requests[1].prompt_ids) == 30


def test_few_shot_shares_examples_per_task() -> None:
    w = few_shot(num_tasks=2, num_examples=3, example_len=10, questions_per_task=4, question_len=5)
    assert len(w.requests) == 8 and all(r.prompt_len == 35 for r in w.requests)
    for a in w.requests:
        for b in w.requests:
            if a is not b:
                assert _lcp(a.prompt_ids, b.prompt_ids) == (30 if a.group_id == b.group_id else 0)


def test_poisson_arrivals_are_increasing_with_the_right_rate() -> None:
    w = with_poisson_arrivals(generated_shared_prefix(num_groups=50, prompts_per_group=20, system_len=4,
                                                      question_len=4), rate=10.0, seed=1)
    times = np.array([r.arrival_time for r in w.requests])
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    assert np.diff(times).mean() == pytest.approx(0.1, rel=0.1)


def test_unknown_workload_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown"):
        make_workload("nope")
