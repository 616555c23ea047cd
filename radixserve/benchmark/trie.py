"""A compressed trie over a whole workload, for offline analysis (bounds, policy studies).

Nodes are split wherever any request branches, ends, or stops being eligible for hits, so
every request's path is a list of whole nodes and all symbols of one node are used by
exactly the same requests. A cache policy whose decisions depend only on that usage can then
work per node instead of per token, which is what makes token-level bounds over a 61M-token
trace fast.

Symbols are token ids (the usual case) or any other prefix-chained ids, e.g. the 512-token
block hashes of a Mooncake trace, each with its own weight in tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass
class TrieSequence:
    """One request as the trie sees it: the symbols it leaves cacheable after it ran
    (`inserted`), how many leading ones may count as hits (`eligible`), and optionally
    each symbol's weight in tokens (default 1)."""

    inserted: np.ndarray
    eligible: int
    weights: np.ndarray | None = None


class WorkloadTrie:
    """Compressed trie of all sequences; see the module docstring.

    After construction: `size[n]` symbols and `start[n]` depth of node n; `paths[i]` the
    nodes of request i's inserted sequence in order; `eligible_nodes[i]` how many of them
    lie within its hit-eligible prefix; `uses[n]` the requests whose eligible prefix covers
    n, ascending; `weight_cum[n]` the cumulative token weight of n's symbols (None when all
    weights are 1).
    """

    def __init__(self, sequences: Sequence[TrieSequence]) -> None:
        self._edges: list[np.ndarray] = [np.zeros(0, np.int64)]
        self._weights: list[np.ndarray | None] = [None]
        self._children: list[dict[int, int]] = [{}]
        weighted = {s.weights is not None for s in sequences}
        if len(weighted) > 1:
            raise ValueError("weights: give them for every sequence or for none")
        for s in sequences:
            if not 0 <= s.eligible <= len(s.inserted):
                raise ValueError(f"eligible: {s.eligible} outside 0..{len(s.inserted)}")
            self._insert(s)
        for s in sequences:
            self._cut(s.inserted, s.eligible)
        self.paths: list[list[int]] = []
        self.eligible_nodes: list[int] = []
        for s in sequences:
            path = self._walk(s.inserted)
            self.paths.append(path)
            self.eligible_nodes.append(self._count_within(path, s.eligible))
        n = len(self._edges)
        self.size = np.array([len(e) for e in self._edges], dtype=np.int64)
        self.start = np.zeros(n, dtype=np.int64)
        for path in self.paths:
            depth = 0
            for node in path:
                self.start[node] = depth
                depth += self.size[node]
        uses: list[list[int]] = [[] for _ in range(n)]
        for i, path in enumerate(self.paths):
            for node in path[: self.eligible_nodes[i]]:
                uses[node].append(i)
        self.uses = uses
        self.weight_cum: list[np.ndarray | None] = [
            None if w is None else np.concatenate([[0], np.cumsum(w)]) for w in self._weights]

    @property
    def num_nodes(self) -> int:
        """Number of nodes, the root (node 0, empty) included."""
        return len(self._edges)

    def weight(self, node: int, count: int) -> float:
        """Tokens represented by the first `count` symbols of `node`."""
        cum = self.weight_cum[node]
        return float(count) if cum is None else float(cum[count])

    def _new_node(self, symbols: np.ndarray, weights: np.ndarray | None) -> int:
        self._edges.append(symbols)
        self._weights.append(weights)
        self._children.append({})
        return len(self._edges) - 1

    def _split(self, node: int, at: int) -> int:
        """Splits `node` after `at` symbols; `node` keeps the head, the new child the tail."""
        edge, weights = self._edges[node], self._weights[node]
        tail = self._new_node(edge[at:], None if weights is None else weights[at:])
        self._children[tail] = self._children[node]
        self._children[node] = {int(edge[at]): tail}
        self._edges[node] = edge[:at]
        self._weights[node] = None if weights is None else weights[:at]
        return tail

    def _insert(self, s: TrieSequence) -> None:
        seq = np.asarray(s.inserted, dtype=np.int64)
        node, pos = 0, 0
        while pos < len(seq):
            child = self._children[node].get(int(seq[pos]))
            if child is None:
                weights = None if s.weights is None else np.asarray(s.weights[pos:], dtype=np.float64)
                self._children[node][int(seq[pos])] = self._new_node(seq[pos:].copy(), weights)
                return
            edge = self._edges[child]
            n = min(len(edge), len(seq) - pos)
            common = _common_prefix(edge[:n], seq[pos:pos + n])
            if common < len(edge):
                self._split(child, common)
            pos += common
            node = child
            if common < n:
                tail_weights = None if s.weights is None else np.asarray(s.weights[pos:], dtype=np.float64)
                self._children[node][int(seq[pos])] = self._new_node(seq[pos:].copy(), tail_weights)
                return

    def _cut(self, seq: np.ndarray, at: int) -> None:
        """Makes `at` a node boundary on `seq`'s path."""
        node, pos = 0, 0
        while pos < at:
            child = self._children[node][int(seq[pos])]
            length = len(self._edges[child])
            if pos + length > at:
                self._split(child, at - pos)
                return
            pos += length
            node = child

    def _walk(self, seq: np.ndarray) -> list[int]:
        path, node, pos = [], 0, 0
        while pos < len(seq):
            node = self._children[node][int(seq[pos])]
            path.append(node)
            pos += len(self._edges[node])
        return path

    def _count_within(self, path: list[int], limit: int) -> int:
        depth = 0
        for count, node in enumerate(path):
            depth += len(self._edges[node])
            if depth > limit:
                return count
        return len(path)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if len(diff) else len(a)
