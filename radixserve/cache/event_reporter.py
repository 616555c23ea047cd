"""How the radix tree names its pages in cache events (events.py): chained page hashes
(page_hash.py), computed along the path lazily and cached per node (`RadixNode.chain`).

`TreeEventReporter` is held by the tree and by its host tier (placement.py); both call it
where pages are stored on or removed from a tier. It reads nodes only (their tokens, parent
links and hash-chain state); pages and namespaces are named through the engine's
`PageHashing` (public or keyed with the server's secret).

Events name full pages only: a partial leaf (node.py) is never reported, nor counted among
the page hashes an indexer should hold, so routers and indexers index whole pages as before.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from radixserve.cache.events import DEVICE, HOST, CacheEventHub
from radixserve.cache.node import RadixNode
from radixserve.cache.page_hash import PageHashing


class TreeEventReporter:
    """Reports changes of the tree's pages to an event hub, naming pages by their hash."""

    def __init__(self, events: CacheEventHub | None, page_size: int, hashing: PageHashing | None = None) -> None:
        self.events = events
        self.page_size = page_size
        self.hashing = hashing or PageHashing()

    @property
    def active(self) -> bool:
        """Whether anyone listens (with no subscriber no hash is computed)."""
        return self.events is not None and self.events.active

    def stored(self, node: RadixNode, first: int, tier: str) -> None:
        """Reports `node`'s pages from index `first` on as stored in `tier` (none for a
        partial leaf)."""
        if node.partial:
            return
        parent_hash, hashes = self._hashes(node)
        if first:
            parent_hash = hashes[first - 1]
        tokens = node.tokens[first * self.page_size:].tolist() if self.events.wants_tokens else None
        self.events.stored(self._namespace(node.namespace)[0], tier, parent_hash, hashes[first:], tokens)

    def removed(self, node: RadixNode, first: int, tier: str) -> None:
        """Reports `node`'s pages from index `first` on as removed from `tier` (none for a
        partial leaf)."""
        if node.partial:
            return
        _, hashes = self._hashes(node)
        self.events.removed(self._namespace(node.namespace)[0], tier, hashes[first:])

    def dropped(self, nodes: Iterable[RadixNode]) -> None:
        """Reports every page of `nodes` as removed from its tiers (before they are unlinked
        below their parents: a page's hash walks up to the root)."""
        for node in nodes:
            if node.pages:
                self.removed(node, 0, DEVICE)
            if node.host is not None:
                self.removed(node, 0, HOST)

    def flushed(self, stayed: Iterable[RadixNode]) -> None:
        """Reports a flush: "cleared", then the pages of the nodes that `stayed` as stored."""
        self.events.cleared()
        for node in stayed:
            if not node.is_root:
                if node.pages:
                    self.stored(node, 0, DEVICE)
                if node.host is not None:
                    self.stored(node, 0, HOST)

    def page_hashes(self, nodes: Iterable[RadixNode], tier: str | None = DEVICE) -> set[tuple[str, int]]:
        """(namespace id, page hash) of every page of `nodes` on `tier` ("device"; "host";
        None: on either)."""
        out: set[tuple[str, int]] = set()
        for node in nodes:
            if node.is_root or node.partial:
                continue
            if tier is None or (node.pages if tier == DEVICE else node.host is not None):
                ns_id = self._namespace(node.namespace)[0]
                out.update((ns_id, h) for h in self._hashes(node)[1])
        return out

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
                _, state = self.hashing.page_hashes(step.tokens, self.page_size, seed, state, depth)
                depth += step.num_pages(self.page_size)
                step.chain = (state, depth)
        return state, depth

    def _hashes(self, node: RadixNode) -> tuple[int | None, list[int]]:
        """The hash of the page before `node`'s edge (None at the root) and of its pages."""
        seed = self._namespace(node.namespace)[1]
        parent = node.parent
        state, depth = self._chain_end(parent)
        hashes, end = self.hashing.page_hashes(node.tokens, self.page_size, seed, state, depth)
        node.chain = (end, depth + node.num_pages(self.page_size))
        return (None if parent.is_root else self.hashing.state_hash(state, seed)), hashes.tolist()

    def _namespace(self, namespace: Hashable) -> tuple[str, int]:
        """The namespace's opaque id and hash seed (cached)."""
        return self.hashing.named(namespace)
