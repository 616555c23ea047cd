"""A cluster's cache views: each replica builds its own (server/cache_views.py, on its engine
thread's view budget), and the ingress merges them.

The merged tree has a "replica" node per replica below the top, holding that replica's
namespaces; every node is labelled with its replica and renumbered so ids stay unique. A
tenant's stats are the sum of its stats on every replica. A replica that fails to answer
(it died meanwhile) is left out of the view.
"""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING, Any

import msgspec

from radixserve.cache.page_hash import PageHashing
from radixserve.engine.tree_snapshot import SnapshotOptions, TreeNodeView, TreeSnapshot
from radixserve.server.tenancy import Caller

if TYPE_CHECKING:
    from radixserve.cluster.engine import ClusterEngine

logger = logging.getLogger(__name__)


class ClusterCacheViews:
    """CacheViews' interface (tree, tenant_stats, hashing, tree_copies) over the replicas."""

    def __init__(self, engine: ClusterEngine) -> None:
        self.engine = engine
        self.tree_copies = 0  # the replicas count their own

    @property
    def hashing(self) -> PageHashing:
        """The ingress's naming of pages and namespaces (the replicas' secret)."""
        return self.engine.hashing

    async def tree(self, options: SnapshotOptions, caller: Caller) -> TreeSnapshot:
        """Every replica's view for `caller`, merged (see the module docstring)."""
        answers = await self.engine.on_every_replica("cache_view", "tree", options, caller)
        return merge_trees({r: a for r, a in answers.items() if isinstance(a, TreeSnapshot)}, options)

    async def tenant_stats(self, caller: Caller) -> dict[str, Any]:
        """`caller`'s stats summed over the replicas."""
        answers = await self.engine.on_every_replica("cache_view", "tenant_stats", None, caller)
        parts = [a for a in answers.values() if isinstance(a, dict)]
        return {"page_size": self.engine.engine.page_size, "replicas": len(parts),
                "tiers": {"device": {key: sum(p["tiers"]["device"][key] for p in parts)
                                     for key in ("pages_cached", "pages_locked")},
                          "host": ({"pages_cached": sum(p["tiers"]["host"]["pages_cached"] for p in parts)}
                                   if any(p["tiers"]["host"] for p in parts) else None)},
                "nodes": sum(p["nodes"] for p in parts), "hits": sum(p["hits"] for p in parts)}


def merge_trees(views: dict[str, TreeSnapshot], options: SnapshotOptions) -> TreeSnapshot:
    """One view of the replicas' views: a "replica" node each below the top, every node
    labelled with its replica and given a new id (pre-order); the top prefixes are the
    `top_k` most hit of all."""
    ids = iter(range(1 << 62))
    top = TreeNodeView(id=next(ids), kind="cache", pages=0, tokens=0, prefix_tokens=0, subtree_pages=0,
                       subtree_nodes=0, lock_count=0, hits=0, tier="device")
    prefixes = []
    for replica, view in sorted(views.items()):
        renumbered: dict[int, int] = {}
        root = view.root
        node = msgspec.structs.replace(root, id=next(ids), kind="replica", replica=replica,
                                       children=[_relabel(child, replica, ids, renumbered) for child in root.children])
        top.children.append(node)
        top.subtree_pages += root.subtree_pages
        top.subtree_nodes += root.subtree_nodes
        top.lock_count += root.lock_count
        prefixes += [msgspec.structs.replace(p, id=renumbered[p.id], replica=replica)
                     for p in view.top_prefixes if p.id in renumbered]
    parts = list(views.values())
    return TreeSnapshot(
        object="cache.tree", page_size=parts[0].page_size if parts else 0,
        tiers=sorted({tier for view in parts for tier in view.tiers}, key=("device", "host").index),
        nodes_total=sum(v.nodes_total for v in parts), pages_total=sum(v.pages_total for v in parts),
        locked_pages=sum(v.locked_pages for v in parts), nodes_shown=sum(v.nodes_shown for v in parts),
        truncated=any(v.truncated for v in parts), max_nodes=options.max_nodes, max_depth=options.max_depth,
        recency_tick=max((v.recency_tick for v in parts), default=0), root=top,
        top_prefixes=heapq.nlargest(options.top_k, prefixes, key=lambda p: (p.hits, p.prefix_tokens)),
        took_ms=round(sum(v.took_ms for v in parts), 3))


def _relabel(node: TreeNodeView, replica: str, ids: Any, renumbered: dict[int, int]) -> TreeNodeView:
    """`node` and its subtree labelled `replica`, with new ids in pre-order (iteratively:
    trees can be deeper than Python's stack); `renumbered` maps old ids to new."""
    holder = msgspec.structs.replace(node, children=[])  # collects the copy of `node`
    stack: list[tuple[TreeNodeView, TreeNodeView]] = [(node, holder)]
    while stack:
        original, parent = stack.pop()
        copy = msgspec.structs.replace(original, id=next(ids), replica=replica, children=[])
        renumbered[original.id] = copy.id
        parent.children.append(copy)
        stack.extend((child, copy) for child in reversed(original.children))
    return holder.children[0]
