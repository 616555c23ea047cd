"""An outside indexer of cache events, and the tree's page hashes computed independently.

The indexer knows only the event stream (as an external router would): it applies `snapshot`,
`stored`, `removed`, `cleared` and `reset` messages to a set of (namespace id, page hash) and
checks the stream's own consistency as it goes (contiguous sequence numbers, a stored path's
parent page already known, a removed page present).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from radixserve.cache.page_hash import namespace_id, namespace_seed, page_hashes
from radixserve.cache.radix import RadixTree


class PageIndexer:
    """The set of cached pages, rebuilt from events alone: `pages` the device's, `tiers`
    each tier's (one set per tier, as docs/server.md tells an indexer to keep)."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[tuple[str, int]]] = {"device": set(), "host": set()}
        self.seq: int | None = None  # the last event applied; None before a snapshot or event
        self.counts = {"snapshot": 0, "stored": 0, "removed": 0, "cleared": 0, "reset": 0}
        self.token_ids_seen = 0

    def apply(self, message: Any) -> None:
        """One message: an event struct (in-process) or its decoded JSON (over HTTP)."""
        if not isinstance(message, dict):
            message = msgspec.to_builtins(message)
        kind = message["type"]
        self.counts[kind] += 1
        if kind == "reset":
            for pages in self.tiers.values():
                pages.clear()  # a snapshot follows
            self.seq = None
            return
        if kind == "snapshot":
            for tier, pages in self.tiers.items():
                pages.clear()
                pages.update((block["namespace"], h) for block in message["blocks"] if block["tier"] == tier
                             for h in block["hashes"])
            self.seq = message["seq"]
            return
        if self.seq is not None:
            assert message["seq"] == self.seq + 1, f"event {message['seq']} after {self.seq}"
        self.seq = message["seq"]
        if kind == "cleared":
            for tier, pages in self.tiers.items():
                if message["tier"] in (None, tier):
                    pages.clear()
            return
        namespace = message["namespace"]
        pages = self.tiers[message["tier"]]
        if kind == "stored":
            parent = message["parent_hash"]
            assert parent is None or (namespace, parent) in self.tiers["device"] | pages, \
                f"stored under unknown page: {message}"
            new = {(namespace, h) for h in message["hashes"]}
            assert not new & pages, f"stored twice: {message}"
            pages |= new
            if message.get("token_ids") is not None:
                assert len(message["token_ids"]) == len(message["hashes"]) * message["page_size"]
                self.token_ids_seen += 1
        else:
            gone = {(namespace, h) for h in message["hashes"]}
            assert gone <= pages, f"removed pages that were not cached: {message}"
            pages -= gone

    @property
    def pages(self) -> set[tuple[str, int]]:
        """The device's pages."""
        return self.tiers["device"]


def tree_page_hashes(tree: RadixTree) -> set[tuple[str, int]]:
    """Every cached page's (namespace id, hash), from each node's whole token path and the spec
    alone (page_hash.py), not from the tree's own hashing."""
    out: set[tuple[str, int]] = set()
    for node, pages in tree.nodes():
        if node.is_root or not pages:
            continue
        path, up = [], node
        while not up.is_root:
            path.append(up.tokens)
            up = up.parent
        tokens = np.concatenate(path[::-1])
        ns_id = namespace_id(node.namespace)
        hashes, _ = page_hashes(tokens, tree.page_size, namespace_seed(ns_id))
        out.update((ns_id, int(h)) for h in hashes[-len(pages):])
    return out
