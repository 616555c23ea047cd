"""The namespaces' roots of the radix tree and how many nodes hang below them.

Every cache namespace (model, cache_salt) has a root node with no pages; its subtree holds
that namespace's prefixes. `Forest` owns the roots and the node count: it makes a root on
first use, drops an empty one, walks every node, and finds what a flush may drop (unlocked
subtrees). The tree (radix.py) changes the shape below the roots and tells the forest how
many nodes it added or removed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator

import numpy as np

from radixserve.cache.node import RadixNode


class Forest:
    """Namespace roots (created on demand) and the number of non-root nodes under them."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.num_nodes = 0
        self._roots: dict[Hashable, RadixNode] = {}

    def root(self, namespace: Hashable) -> RadixNode | None:
        """The namespace's root, or None when nothing of it is cached."""
        return self._roots.get(namespace)

    def root_for_insert(self, namespace: Hashable) -> RadixNode:
        """The namespace's root, made if missing."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = self.new_root(namespace)
        return root

    def new_root(self, namespace: Hashable) -> RadixNode:
        """A detached root (what a match of an unknown namespace locks)."""
        return RadixNode(namespace, None, np.empty(0, dtype=np.int64), [], self.page_size > 1)

    def forget_if_empty(self, root: RadixNode) -> None:
        """Drops `root` when nothing hangs below it and nobody holds it."""
        if not root.children and not root.lock_ref and self._roots.get(root.namespace) is root:
            del self._roots[root.namespace]

    def nodes(self) -> Iterator[RadixNode]:
        """Every node, roots included, parents before their children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def unlocked_subtrees(self) -> list[RadixNode]:
        """The tops of the subtrees that no lock reaches (what a flush drops): the unlocked
        children of roots and of locked nodes (an unlocked node has no locked descendant)."""
        tops: list[RadixNode] = []
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                (stack if child.lock_ref else tops).append(child)
        return tops

    def prune(self) -> None:
        """Drops every root left empty (after a flush)."""
        for root in list(self._roots.values()):
            self.forget_if_empty(root)
