"""How the radix tree names its pages in cache events (events.py): chained page hashes
(page_hash.py), computed along the path lazily and cached per node.

`TreeEvents` is mixed into `RadixTree`; it needs only what its annotations list.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator

from radixserve.cache.events import DEVICE, CacheEventHub
from radixserve.cache.node import RadixNode
from radixserve.cache.page_hash import namespace_id, namespace_seed, page_hashes, state_hash


class TreeEvents:
    """Reports changes of the tree's pages to its event hub, naming pages by their hash."""

    # What the tree provides.
    events: CacheEventHub | None
    page_size: int
    _namespace_ids: dict[Hashable, tuple[str, int]]
    _npages: Callable[[RadixNode], int]
    nodes: Callable[[], Iterator[tuple[RadixNode, list[int]]]]

    def _chain_end(self, node: RadixNode) -> tuple[int, int]:
        """(hash-chain state, pages from the root) at the end of `node`'s edge; computes and
        caches it for `node` and any ancestors that lack it."""
        path = []
        while not node.is_root and node.chain is None:
            path.append(node)
            node = node.parent
        state, depth = (0, 0) if node.is_root else node.chain
        if path:
            seed = self._namespace(path[0].namespace)[1]
            for step in reversed(path):
                _, state = page_hashes(step.tokens, self.page_size, seed, state, depth)
                depth += self._npages(step)
                step.chain = (state, depth)
        return state, depth

    def _hashes(self, node: RadixNode) -> tuple[int | None, list[int]]:
        """The hash of the page before `node`'s edge (None at the root) and of its pages."""
        ns_id, seed = self._namespace(node.namespace)
        parent = node.parent
        state, depth = self._chain_end(parent)
        hashes, end = page_hashes(node.tokens, self.page_size, seed, state, depth)
        node.chain = (end, depth + self._npages(node))
        return (None if parent.is_root else state_hash(state, seed)), hashes.tolist()

    def _report_stored(self, node: RadixNode, first: int, tier: str) -> None:
        """Reports `node`'s pages from index `first` on as stored in `tier`."""
        parent_hash, hashes = self._hashes(node)
        if first:
            parent_hash = hashes[first - 1]
        tokens = node.tokens[first * self.page_size:].tolist() if self.events.wants_tokens else None
        self.events.stored(self._namespace(node.namespace)[0], tier, parent_hash, hashes[first:], tokens)

    def _report_removed(self, node: RadixNode, first: int, tier: str) -> None:
        """Reports `node`'s pages from index `first` on as removed from `tier`."""
        _, hashes = self._hashes(node)
        self.events.removed(self._namespace(node.namespace)[0], tier, hashes[first:])

    def _namespace(self, namespace: Hashable) -> tuple[str, int]:
        """The namespace's opaque id and hash seed (cached)."""
        known = self._namespace_ids.get(namespace)
        if known is None:
            ns_id = namespace_id(namespace)
            known = self._namespace_ids[namespace] = (ns_id, namespace_seed(ns_id))
        return known

    def cached_page_hashes(self, tier: str | None = DEVICE) -> set[tuple[str, int]]:
        """(namespace id, page hash) of every cached page on `tier` ("device", the default;
        "host"; None: on either): what an indexer of that tier's events should hold."""
        out: set[tuple[str, int]] = set()
        for node, _ in self.nodes():
            if node.is_root:
                continue
            if tier is None or (node.pages if tier == DEVICE else node.host is not None):
                ns_id = self._namespace(node.namespace)[0]
                out.update((ns_id, h) for h in self._hashes(node)[1])
        return out
