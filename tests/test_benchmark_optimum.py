"""Offline bounds: Belady's rule for a prefix cache against hand-checked cases, an exhaustive
search on random tiny workloads, and the Mooncake trace README's published figures."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from radixserve.benchmark.optimum import WorkloadBounds, belady, dfs_order, trace_block_trie
from radixserve.benchmark.trie import TrieSequence, WorkloadTrie
from radixserve.benchmark.workloads import BenchRequest, Workload, generated_shared_prefix

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "bench" / "data" / "mooncake_synthetic_trace.jsonl"


def _workload(*prompts: list[int]) -> Workload:
    return Workload("t", [BenchRequest(i, np.array(p, dtype=np.int32), 1) for i, p in enumerate(prompts)])


def test_hand_checked_two_documents_one_slot() -> None:
    # A=[1,2,3,4] B=[5,6,7,8]; order A B A A B. Capacity 4 tokens holds one document.
    w = _workload([1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8])
    bounds = WorkloadBounds(w)
    # Keep A's 3 hit-eligible tokens (len-1) throughout, and B's first token in the 4th slot
    # (A's last token is never hit): requests 2 and 3 hit 3 tokens, request 4 hits 1.
    assert bounds.optimum(4).hit_tokens == 7
    assert bounds.optimum(3).hit_tokens == 6
    # Two tokens: the first two of A, twice.
    assert bounds.optimum(2).hit_tokens == 4
    assert bounds.optimum(0).hit_tokens == 0
    assert bounds.infinite().hit_tokens == 9
    assert bounds.infinite().per_request.tolist() == [0, 0, 3, 3, 3]


def test_hit_needs_an_unbroken_prefix_and_deeper_goes_first() -> None:
    # Shared root [1,2], then two branches. With capacity 3 the root and one branch token fit.
    w = _workload([1, 2, 3, 9], [1, 2, 4, 9], [1, 2, 3, 9], [1, 2, 4, 9])
    bounds = WorkloadBounds(w)
    # Request 1 hits the root (2). The third slot goes to the branch used next (3, needed by
    # request 2, over 4, needed by request 3); branch 4 is gone by then, so request 3 hits the
    # root only. Keeping 4 instead gives the same total: 2 + 2 + 3.
    assert bounds.optimum(3).per_request.tolist() == [0, 2, 3, 2]


def _brute_force_optimum(prompts: list[list[int]], capacity: int) -> int:
    """Exact optimum by dynamic programming over every prefix-closed cache content."""
    def prefixes(seq: list[int]) -> list[tuple[int, ...]]:
        return [tuple(seq[:k]) for k in range(1, len(seq) + 1)]

    states: dict[frozenset, int] = {frozenset(): 0}
    for prompt in prompts:
        eligible = prefixes(prompt)[: len(prompt) - 1]
        nxt: dict[frozenset, int] = {}
        for cache, total in states.items():
            hit = 0
            for p in eligible:
                if p not in cache:
                    break
                hit += 1
            pool = sorted(cache | set(prefixes(prompt)), key=len)
            for size in range(0, min(capacity, len(pool)) + 1):
                for keep in itertools.combinations(pool, size):
                    kept = set(keep)
                    if all(len(p) == 1 or p[:-1] in kept for p in kept):
                        key = frozenset(kept)
                        nxt[key] = max(nxt.get(key, -1), total + hit)
        states = nxt
    return max(states.values())


def test_belady_matches_exhaustive_search_on_random_tiny_workloads() -> None:
    rng = random.Random(7)
    for _ in range(60):
        prompts = [[rng.choice([1, 2]) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(2, 5))]
        capacity = rng.randint(0, 4)
        got = WorkloadBounds(_workload(*prompts)).optimum(capacity).hit_tokens
        assert got == _brute_force_optimum(prompts, capacity), (prompts, capacity)


def test_trie_splits_at_branches_and_hit_limits() -> None:
    trie = WorkloadTrie([TrieSequence(np.array([1, 2, 3, 4]), 3), TrieSequence(np.array([1, 2, 5]), 2)])
    sizes = [[int(trie.size[n]) for n in path] for path in trie.paths]
    assert sizes == [[2, 1, 1], [2, 1]]
    assert trie.eligible_nodes == [2, 1]
    assert [trie.uses[n] for n in trie.paths[0]] == [[0, 1], [0], []]


def test_gsp_optimum_is_monotone_and_reaches_the_infinite_bound() -> None:
    w = generated_shared_prefix(num_groups=8, prompts_per_group=4, system_len=64, question_len=16)
    bounds = WorkloadBounds(w)
    rates = [bounds.optimum(c).hit_rate for c in (0, 64, 128, 256, 1024, 10_000)]
    assert rates == sorted(rates) and rates[0] == 0
    assert rates[-1] == pytest.approx(bounds.infinite().hit_rate)
    assert bounds.infinite().hit_rate == pytest.approx(3 * 64 / (4 * 80))
    # In DFS order one system prompt in cache at a time is enough for the infinite bound.
    dfs = dfs_order(w)
    assert dfs is not None
    assert WorkloadBounds(dfs).optimum(80).hit_rate == pytest.approx(bounds.infinite().hit_rate)


@pytest.mark.skipif(not TRACE.is_file(), reason="bench/data trace not present")
def test_mooncake_readme_optimum_figures() -> None:
    trie, prompt_tokens = trace_block_trie(TRACE)
    readme = {500_000: 0.279, 1_000_000: 0.383, 2_000_000: 0.499, 4_000_000: 0.603, 8_000_000: 0.651}
    for capacity, expected in readme.items():
        assert belady(trie, capacity // 512, prompt_tokens).hit_rate == pytest.approx(expected, abs=0.0005)
    assert belady(trie, None, prompt_tokens).hit_rate == pytest.approx(0.651, abs=0.0005)
