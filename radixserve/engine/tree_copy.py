"""A copy of what cache views need from the radix tree, taken in slices between steps.

The views (`GET /v1/cache/tree`, an event stream's first snapshot) are built off the engine
thread from a `TreeCopy`: per node its parent, namespace, tokens, tiers, retention in force,
locks, hits and recency — a few references and numbers, no object of the tree. The tree
never changes a token array in place (a split or a cut makes new arrays), so the copy holds
the tree's own arrays.

`copy_tree` is a generator for `AsyncEngine.run_sliced`: it copies `NODES_PER_PIECE` nodes
per piece and yields, so the engine runs steps in between and the tree may change while it
is copied. The copy is then *fuzzy*, each node as it was when copied, but always a tree:
a node is copied after its parent, a node whose parent is not in the copy yet (it was split
off above it meanwhile) brings its new ancestors with it, and a node that left the tree is
left out. Page hashes computed from it are exact for every page that did not change while it
was copied; an event stream corrects the rest with the events of that time (event_stream.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Hashable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import numpy as np

from radixserve.cache.events import DEVICE, HOST
from radixserve.cache.page_hash import PageHashing
from radixserve.cache.radix import RadixNode, RadixTree

NODES_PER_PIECE = 64  # nodes copied per piece: well under the engine's per-step view budget
HASHED_NODES_PER_PIECE = 16  # nodes hashed per piece (a hash call costs more than a copy)
_R = TypeVar("_R")


@dataclass(slots=True)
class NodeCopy:
    """One node as a view needs it; `parent` is an index into `TreeCopy.nodes` (-1: a root)."""

    parent: int
    namespace: Hashable
    tokens: np.ndarray          # the tree's own array: never changed in place
    device_pages: int           # pages on the device (0: on the host only)
    on_host: bool               # a copy of its pages is on the host
    priority: int | None        # retention in force for the tail page (None: the default)
    priority_max: int | None    # highest retention in force over its pages (None: the default)
    lock_ref: int
    hits: int
    tick: int
    inserted_at: float
    partial: bool = False       # a partial leaf: one device page holding fewer tokens than a page

    @property
    def is_root(self) -> bool:
        return self.parent < 0


@dataclass
class TreeCopy:
    """Every node of a tree, parents before children; `copied_at` is the tree's clock when the
    copy began, `engine_ms` the engine-thread time the copy took, all pieces together."""

    page_size: int
    has_host_tier: bool
    copied_at: float
    nodes: list[NodeCopy] = field(default_factory=list)
    locked_pages: int = 0
    engine_ms: float = 0.0


def copy_tree(tree: RadixTree, now: float | None = None,
              nodes_per_piece: int = NODES_PER_PIECE) -> Generator[None, None, TreeCopy]:
    """Copies `tree` a piece at a time (see the module docstring); returns the copy."""
    started = time.perf_counter()
    now = time.monotonic() if now is None else now
    copy = TreeCopy(tree.page_size, tree.host is not None, now)
    index: dict[RadixNode, int] = {}
    walk = tree.nodes()  # a lazy depth-first walk over the live tree: it follows its changes
    while True:
        for _ in range(nodes_per_piece):
            found = next(walk, None)
            if found is None:
                copy.locked_pages = tree.locked_pages
                # Added, not assigned: the earlier pieces are in it already (an `=` here
                # reported the last piece alone, 0.1 ms for a copy of 150 pieces).
                copy.engine_ms += (time.perf_counter() - started) * 1e3
                return copy
            _add(copy, index, found[0], now)
        copy.engine_ms += (time.perf_counter() - started) * 1e3
        yield
        started = time.perf_counter()


def _add(copy: TreeCopy, index: dict[RadixNode, int], node: RadixNode, now: float) -> None:
    """Copies `node` and any ancestors the copy lacks (nodes split off above it since its
    parent was copied); nothing if it has left the tree."""
    missing = []
    while node not in index:
        missing.append(node)
        if node.is_root:
            break
        node = node.parent
        if node is None:  # dropped from the tree since the walk found it
            return
    for node in reversed(missing):
        parent = -1 if node.is_root else index[node.parent]
        index[node] = len(copy.nodes)
        copy.nodes.append(_copy_node(node, parent, now))


def _copy_node(node: RadixNode, parent: int, now: float) -> NodeCopy:
    priority = priority_max = None
    if node.retention is not None and len(node.tokens):
        in_force = node.retention.effective(now)
        priority, priority_max = int(in_force[-1]), int(in_force.max())
    return NodeCopy(parent, node.namespace, node.tokens, len(node.pages), node.host is not None,
                    priority, priority_max, node.lock_ref, node.hits, node.tick, node.inserted_at, node.partial)


def run_to_end(work: Generator[None, None, _R]) -> _R:
    """Runs every piece of `work` at once (a caller that owns the tree's thread)."""
    while True:
        try:
            next(work)
        except StopIteration as stop:
            return stop.value


def page_hashes(copy: TreeCopy, namespace_id: Callable[[Hashable], str] | None = None, *,
                hashing: PageHashing | None = None) -> Generator[None, None, dict[str, dict[str, set[int]]]]:
    """The page hash (page_hash.py, as cache events name pages) of every cached page of the
    copy, per tier ("device", "host") and namespace id; sliced work like the copy (it yields
    every HASHED_NODES_PER_PIECE nodes). Pages are named through `hashing` (default: the
    public spec), namespaces by `namespace_id` (default: `hashing`'s)."""
    hashing = hashing or PageHashing()
    namespace_id = namespace_id or hashing.namespace_id
    out: dict[str, dict[str, set[int]]] = {DEVICE: {}, HOST: {}}
    seeds: dict[Hashable, tuple[str, int]] = {}
    chain: list[tuple[int, int]] = [(0, 0)] * len(copy.nodes)  # (state, pages) at each edge's end
    for i, node in enumerate(copy.nodes):
        if node.is_root:
            continue
        known = seeds.get(node.namespace)
        if known is None:
            ns_id = namespace_id(node.namespace)
            known = seeds[node.namespace] = (ns_id, hashing.namespace_seed(ns_id))
        if node.partial:  # a partial leaf: events name full pages only, and nothing hangs below it
            continue
        state, depth = chain[node.parent]
        # Host-only edges too: a fuzzy copy may hold a device node below one copied earlier.
        hashes, end = hashing.page_hashes(node.tokens, copy.page_size, known[1], state, depth)
        chain[i] = (end, depth + len(node.tokens) // copy.page_size)
        if node.device_pages:
            out[DEVICE].setdefault(known[0], set()).update(hashes.tolist())
        if node.on_host:
            out[HOST].setdefault(known[0], set()).update(hashes.tolist())
        if i % HASHED_NODES_PER_PIECE == 0:
            yield
    return out


def restrict(copy: TreeCopy, keep: Callable[[Hashable], bool]) -> Generator[None, None, TreeCopy]:
    """The copy with only the namespaces `keep` passes (a tenant's view of the cache), as
    sliced work; nothing of the others is left in it, not even in its totals."""
    out = TreeCopy(copy.page_size, copy.has_host_tier, copy.copied_at, engine_ms=copy.engine_ms)
    index: dict[int, int] = {}  # position in `copy` -> position in `out`
    kept: dict[Hashable, bool] = {}
    for i, node in enumerate(copy.nodes):
        if node.namespace not in kept:
            kept[node.namespace] = keep(node.namespace)
        if kept[node.namespace] and (node.is_root or node.parent in index):
            index[i] = len(out.nodes)
            out.nodes.append(replace(node, parent=index[node.parent]) if not node.is_root else node)
            if node.lock_ref and not node.is_root:  # the pages its locks hold, as the tree counts them
                out.locked_pages += node.device_pages
        if i % NODES_PER_PIECE == 0:
            yield
    return out
