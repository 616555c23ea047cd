"""Hit-rate bounds: the infinite cache and the offline optimum at a capacity.

The offline optimum is Belady's rule for a prefix cache: after each request, keep what will
be used again soonest; evict first what is next used furthest in the future, the deeper
symbol first on ties. A symbol's next use is never earlier than its children's, so the kept
set stays prefix-closed and every hit is an unbroken prefix. Requests are served one at a
time in order; the cache may keep any symbols it holds or that the request just computed
(caching is optional, so nothing is forced in). For unit-size symbols this is optimal, hence
an upper bound for any online policy at that capacity.

Token model (`WorkloadBounds`): symbols are tokens, a request may hit at most len(prompt) - 1
of them (the last is always computed), and it leaves its prompt and any known reply tokens
cacheable. Capacity in tokens; a paged cache holds fewer (whole pages only), so this bounds
every page size.

Block model (`trace_block_bounds`): the Mooncake trace's own 512-token block ids, each
holding one slot of capacity and weighing its real length; whole prompts may hit. This is
how the trace's README measured its reference figures.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from radixserve.benchmark.trie import TrieSequence, WorkloadTrie
from radixserve.benchmark.workloads import Workload


@dataclass
class BoundResult:
    """Hit tokens of a bound, overall and per request."""

    hit_tokens: float
    prompt_tokens: int
    capacity: int | None  # in symbols (tokens, or blocks for the block model); None: infinite
    per_request: np.ndarray

    @property
    def hit_rate(self) -> float:
        """Hit tokens / prompt tokens."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def belady(trie: WorkloadTrie, capacity: int | None, prompt_tokens: int) -> BoundResult:
    """Serves the trie's requests in order under Belady's rule at `capacity` symbols."""
    limit = math.inf if capacity is None else capacity
    never = len(trie.paths)  # "next used after the last request": evicted first
    cached = np.zeros(trie.num_nodes, dtype=np.int64)
    next_use = np.full(trie.num_nodes, never, dtype=np.int64)
    cursor = np.zeros(trie.num_nodes, dtype=np.int64)
    heap: list[tuple[int, int, int]] = []
    total = 0
    per_request = np.zeros(len(trie.paths), dtype=np.float64)
    for i, path in enumerate(trie.paths):
        hit = 0.0
        for node in path[: trie.eligible_nodes[i]]:
            amount = int(cached[node])
            hit += trie.weight(node, amount)
            if amount < trie.size[node]:
                break
        per_request[i] = hit
        for node in path:
            uses = trie.uses[node]
            c = int(cursor[node])
            while c < len(uses) and uses[c] <= i:
                c += 1
            cursor[node] = c
            nu = uses[c] if c < len(uses) else never
            total += int(trie.size[node] - cached[node])
            cached[node] = trie.size[node]
            next_use[node] = nu
            heapq.heappush(heap, (-nu, -int(trie.start[node]), node))
        while total > limit:
            neg_nu, neg_start, node = heap[0]
            if cached[node] == 0 or next_use[node] != -neg_nu:
                heapq.heappop(heap)  # stale entry: node evicted or used again since
                continue
            drop = int(min(cached[node], total - limit))
            cached[node] -= drop
            total -= drop
            if cached[node] == 0:
                heapq.heappop(heap)
    return BoundResult(float(per_request.sum()), prompt_tokens, capacity, per_request)


class WorkloadBounds:
    """Token-model bounds of one workload; builds the trie once for many capacities."""

    def __init__(self, workload: Workload) -> None:
        sequences = []
        for r in workload.requests:
            inserted = r.prompt_ids if r.output_ids is None else np.concatenate([r.prompt_ids, r.output_ids])
            sequences.append(TrieSequence(inserted, max(r.prompt_len - 1, 0)))
        self.trie = WorkloadTrie(sequences)
        self.prompt_tokens = workload.prompt_tokens

    def optimum(self, capacity_tokens: int) -> BoundResult:
        """Offline optimum hit rate at `capacity_tokens`."""
        return belady(self.trie, capacity_tokens, self.prompt_tokens)

    def infinite(self) -> BoundResult:
        """Hit rate of an unbounded cache."""
        return belady(self.trie, None, self.prompt_tokens)


def dfs_order(workload: Workload) -> Workload | None:
    """The workload's requests in lexicographic prompt order, which is a depth-first order
    of their trie (SGLang's optimal order for a batch), or None when the order is not free:
    requests arrive at different times or depend on each other."""
    requests = workload.requests
    if any(r.parent is not None or r.arrival_time != requests[0].arrival_time for r in requests):
        return None
    ordered = sorted(requests, key=lambda r: r.prompt_ids.tolist())
    return Workload(workload.name, ordered, workload.params)


def offline_optimum(workload: Workload, capacity_tokens: int | None) -> BoundResult:
    """Offline optimum of `workload` at `capacity_tokens` (None: infinite cache)."""
    bounds = WorkloadBounds(workload)
    return bounds.infinite() if capacity_tokens is None else bounds.optimum(capacity_tokens)


def trace_block_trie(path: str | Path, block_size: int = 512) -> tuple[WorkloadTrie, int]:
    """The block-model trie of a Mooncake trace file and its total prompt tokens.

    Reads the JSONL directly (hash_ids, input_length): the block model needs the ids, not
    tokens. The last block of a prompt weighs its real length.
    """
    sequences, prompt_tokens = [], 0
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            ids = np.asarray(record["hash_ids"], dtype=np.int64)
            length = int(record["input_length"])
            weights = np.full(len(ids), block_size, dtype=np.float64)
            if len(ids) and length % block_size:
                weights[-1] = length % block_size
            sequences.append(TrieSequence(ids, len(ids), weights))
            prompt_tokens += length
    return WorkloadTrie(sequences), prompt_tokens


def trace_block_bounds(path: str | Path, capacities_tokens: list[int], block_size: int = 512
                       ) -> dict[int, float]:
    """Block-model offline optimum hit rate per capacity (in tokens, whole blocks kept)."""
    trie, prompt_tokens = trace_block_trie(path, block_size)
    return {c: belady(trie, c // block_size, prompt_tokens).hit_rate for c in capacities_tokens}
