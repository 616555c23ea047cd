"""A bounded view of the radix tree: what `GET /v1/cache/tree` returns and the dashboard draws.

A tree with 100k nodes cannot go over the wire or onto a page node by node, so the view keeps
the `max_nodes` nodes with the largest subtrees (by cached pages), never deeper than
`max_depth` below their namespace, plus the `top_k` most-hit nodes (the hottest shared
prefixes) with their ancestors. Every node left out is folded into one "aggregate" child of its
shown parent that carries the pages and node counts of what it stands for, so page totals stay
exact at every level and an icicle drawn from the view has the true proportions. Namespaces are
bounded the same way: those that hold a shown node are listed, the others (a client can make
thousands, one per cache salt) fold into one aggregate child of the top.

It is built from a `TreeCopy` (tree_copy.py), which the engine thread takes in small
slices between steps; the view itself is built from the copy anywhere (the server does it in
a worker thread), so neither a large tree nor many distinct views hold up the engine. One
pass over every copied node plus a little work per shown node: see docs/benchmark.md for
the costs on large trees.

With token text (`tokens=true`), decoding is the costly part (about half a microsecond a token,
a 4,000-token edge 2 ms), so pieces are sized by work, not only by nodes: a piece ends once it
has decoded or hashed TOKENS_PER_PIECE tokens, and no node's or top prefix's text is decoded
from more than TEXT_TOKENS tokens (its first and last halves, `text_truncated` set). Pieces
sized in nodes alone decoded 64 long edges, or 100 whole prefixes, at once: one view held
every stream's next step up by 100-250 ms.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator, Hashable
from typing import Any

import msgspec
import numpy as np

from radixserve.cache.page_hash import PageHashing
from radixserve.cache.radix import RadixTree
from radixserve.cache.retention import DEFAULT_PRIORITY
from radixserve.engine.tree_copy import (
    NODES_PER_PIECE,
    NodeCopy,
    TreeCopy,
    copy_tree,
    run_to_end,
)

DEFAULT_MAX_NODES = 2000
DEFAULT_MAX_DEPTH = 64
DEFAULT_TOP_K = 10
DEVICE_TIER = "device"
HOST_TIER = "host"
ITEMS_PER_PIECE = 512  # nodes a piece of a pass over every node handles
# Tokens decoded or hashed per piece of the build, at most (plus what the node that crosses it
# adds, itself bounded by TEXT_TOKENS for text): about 1 ms of decoding.
TOKENS_PER_PIECE = 2048
# A node's or top prefix's `text` is decoded from at most this many tokens: the first and last
# halves of a longer one, joined by TEXT_CUT. The dashboard shows text in one ellipsised line;
# `token_ids` stay whole.
TEXT_TOKENS = 256
TEXT_CUT = " … "


def _tier(node: NodeCopy) -> str:
    """Where a node's pages live: "device", "host", or "device+host" (a copy on each)."""
    if not node.device_pages:
        return HOST_TIER
    return DEVICE_TIER if not node.on_host else f"{DEVICE_TIER}+{HOST_TIER}"


class TreeNodeView(msgspec.Struct, omit_defaults=True):
    """One drawn node. `kind`: "cache" (the top, one per snapshot), "namespace" (a tenant's
    root, `namespace` its opaque id), "node" (one edge of the tree) or "aggregate" (the
    children of its parent that were left out, `subtree_nodes` of them; below the top, the
    `namespaces` namespaces left out, with `subtree_nodes` nodes in them); a cluster's view
    has a "replica" node per replica below the top, and every node names its `replica`."""

    id: int
    kind: str
    pages: int                      # pages on this edge (aggregate: in everything it stands for)
    tokens: int                     # pages * page_size (a partial leaf: the tokens its page holds)
    prefix_tokens: int              # tokens from the namespace root to the end of this edge
    subtree_pages: int              # this edge and everything below it
    subtree_nodes: int              # nodes in the subtree, this one included (not for "cache")
    lock_count: int                 # locks held on this node or below (in use by requests)
    hits: int                       # lookups that used these pages (aggregate: summed)
    tier: str                       # "device", "host" or "device+host"
    priority: int | None = None     # retention priority in force for the tail page (evicted first)
    priority_max: int | None = None  # highest retention priority of its pages
    age_s: float | None = None      # seconds since its pages were cached
    tick: int | None = None         # recency counter of the last use (larger = more recent); ranked
                                    # among the nodes shown in a tenant's view (build_view)
    namespace: str | None = None
    # The cache-event hash of its last page, in decimal: a string, because JavaScript numbers
    # cannot hold 64-bit integers exactly (events carry the same digits as a JSON integer).
    hash: str | None = None
    token_ids: list[int] | None = None  # the edge's tokens, only with --expose-cache-tokens
    text: str | None = None             # the edge decoded, only with --expose-cache-tokens
    text_truncated: bool = False        # `text` is its first and last TEXT_TOKENS // 2 tokens only
    partial: bool = False           # a partial leaf: one page, fewer than page_size tokens, no hash
    replica: str | None = None      # the replica whose cache holds it (a cluster's view only)
    namespaces: int | None = None   # an aggregate of namespaces: how many it stands for
    children: list[TreeNodeView] = []


class TopPrefix(msgspec.Struct, omit_defaults=True):
    """A most-hit node: the shared prefix ending at it."""

    id: int                  # its id in the snapshot's tree
    hits: int
    prefix_tokens: int
    pages: int
    namespace: str
    hash: str | None = None  # as in TreeNodeView
    text: str | None = None  # the whole prefix decoded, only with --expose-cache-tokens
    text_truncated: bool = False  # as in TreeNodeView
    replica: str | None = None  # as in TreeNodeView


class TreeSnapshot(msgspec.Struct):
    """The response of `GET /v1/cache/tree`."""

    object: str
    page_size: int
    tiers: list[str]
    nodes_total: int          # tree nodes (namespace roots excluded)
    pages_total: int          # cached pages
    locked_pages: int
    nodes_shown: int          # "node"-kind entries in `root` (the rest are inside aggregates)
    truncated: bool           # some node was folded into an aggregate
    max_nodes: int
    max_depth: int
    recency_tick: int         # the largest tick in the tree: "now" for `tick` (ranked: the highest rank)
    root: TreeNodeView
    top_prefixes: list[TopPrefix]
    took_ms: float            # time spent on the engine thread copying the tree for it


class SnapshotOptions(msgspec.Struct, frozen=True):
    """What to include: limits, and whether token ids and text may leave the server."""

    max_nodes: int = DEFAULT_MAX_NODES
    max_depth: int = DEFAULT_MAX_DEPTH
    top_k: int = DEFAULT_TOP_K
    include_hashes: bool = False
    include_tokens: bool = False


def snapshot_tree(tree: RadixTree, options: SnapshotOptions, *,
                  namespace_id: Callable[[Hashable], str],
                  decode: Callable[[list[int]], str] | None = None,
                  now: float | None = None) -> TreeSnapshot:
    """The bounded view of `tree` described in the module docstring, copied all at once
    (on the thread that owns the tree); see `view_of_copy`. `now` is the tree's clock
    (time.monotonic by default)."""
    return run_to_end(build_view(run_to_end(copy_tree(tree, now)), options, namespace_id=namespace_id,
                                 decode=decode))


def build_view(copy: TreeCopy, options: SnapshotOptions, *, namespace_id: Callable[[Hashable], str],
               decode: Callable[[list[int]], str] | None = None,
               hashing: PageHashing | None = None, rank_ticks: bool = False) -> Generator[None, None, TreeSnapshot]:
    """The bounded view of a tree copy, as sliced work (sliced_work.py): it yields every few
    hundred nodes, so the engine thread can build it between steps. (Built in another thread
    instead, its Python work would hold the interpreter lock against the engine's.)

    `namespace_id` turns a namespace into its opaque id (the one its page hashes are seeded
    with, page_hash.py); page hashes are named through `hashing` (default: the public
    spec). `decode` turns token ids into text; it is used only with
    `options.include_tokens`. Ages are counted to the time the copy began.

    `rank_ticks` (a tenant's view): each node's `tick` is its dense rank among the nodes shown
    (1 = least recently used) and `recency_tick` the highest. The tick is the tree's one
    counter, moved by every lookup and insert of every tenant: differences of a tenant's own
    ticks told it how many the others made (and, by chunked prefill, roughly how long their
    prompts were). The ranks keep the order the dashboard colours by, and nothing else.
    """
    facts = _Facts(copy)
    yield from facts.compute()
    yield from _choose_shown(facts, options)
    builder = _Builder(copy.page_size, options, facts, namespace_id, decode, copy.copied_at,
                       hashing or PageHashing())
    top = yield from builder.build()
    # Pieces too: each top prefix's text is decoded from its tokens (up to TEXT_TOKENS).
    top_prefixes = yield from builder.top_prefixes(_hottest(facts, options.top_k))
    yield
    recency = builder.rank_ticks() if rank_ticks else max((node.tick for node in facts.nodes), default=0)
    return TreeSnapshot(
        object="cache.tree", page_size=copy.page_size,
        tiers=[DEVICE_TIER, HOST_TIER] if copy.has_host_tier else [DEVICE_TIER],
        nodes_total=len(facts.nodes) - len(facts.roots), pages_total=sum(facts.pages),
        locked_pages=copy.locked_pages, nodes_shown=builder.nodes_shown, truncated=builder.truncated,
        max_nodes=options.max_nodes, max_depth=options.max_depth,
        recency_tick=recency, root=top,
        top_prefixes=top_prefixes, took_ms=round(copy.engine_ms, 3))


class _Facts:
    """Per-node facts from one pass, in lists indexed by the node's pre-order position (lists
    of ints, not an object per node: this pass touches every node of a 100k-node tree)."""

    def __init__(self, copy: TreeCopy) -> None:
        self.copy = copy
        self.nodes: list[NodeCopy] = copy.nodes  # parents first

    def compute(self) -> Generator[None, None, None]:
        """The passes over every node, a piece of ITEMS_PER_PIECE nodes at a time."""
        nodes, page_size = self.nodes, self.copy.page_size
        n = len(nodes)
        self.parent = [-1] * n
        self.pages = [0] * n  # on either tier
        self.depth = [0] * n
        self.prefix_pages = [0] * n
        self.kids: dict[int, list[int]] = {}  # only nodes with children: most have none
        self.hit: list[int] = []  # nodes with a hit (top prefixes are chosen among them)
        yield
        for i, node in enumerate(nodes):  # parents come before their children
            p = self.parent[i] = node.parent
            pages = self.pages[i] = 1 if node.partial else len(node.tokens) // page_size
            if p >= 0:
                self.kids.setdefault(p, []).append(i)
                self.depth[i] = self.depth[p] + 1
                self.prefix_pages[i] = self.prefix_pages[p] + pages
                if node.hits > 0:
                    self.hit.append(i)
            if i % ITEMS_PER_PIECE == 0:
                yield
        self.subtree_pages = list(self.pages)
        self.subtree_nodes = [1] * n
        for i in range(n - 1, -1, -1):  # descendants come before their ancestors
            p = self.parent[i]
            if p >= 0:
                self.subtree_pages[p] += self.subtree_pages[i]
                self.subtree_nodes[p] += self.subtree_nodes[i]
            if i % ITEMS_PER_PIECE == 0:
                yield
        self.roots = [i for i, p in enumerate(self.parent) if p < 0]
        self.shown = [False] * n

    def children(self, i: int) -> list[int]:
        """Indices of the children of node `i`, largest subtree first."""
        return sorted(self.kids.get(i, ()), key=self.subtree_pages.__getitem__, reverse=True)


def _choose_shown(facts: _Facts, options: SnapshotOptions) -> Generator[None, None, None]:
    """Marks the nodes to show: largest subtrees first within the limits, then the hottest.

    A best-first search over (node, next sibling) cursors: each node's children are sorted
    once, and only the next-largest unshown sibling of each shown child waits in the heap, so
    the heap work is proportional to the nodes shown, not to all their children.
    """
    budget = options.max_nodes
    heap: list[tuple[int, int, int, list[int]]] = []  # (-subtree pages, position, sibling list)

    def offer(siblings: list[int], position: int) -> None:
        if position < len(siblings):
            heapq.heappush(heap, (-facts.subtree_pages[siblings[position]], siblings[position],
                                  position, siblings))

    for root in facts.roots:
        if root not in facts.kids:  # an empty namespace (held by a request): nothing to leave out
            facts.shown[root] = True
        offer(facts.children(root), 0)
    while heap and budget > 0:
        _, i, position, siblings = heapq.heappop(heap)
        facts.shown[i] = True
        facts.shown[facts.parent[i]] = True  # its namespace root, when it is one (else shown already)
        budget -= 1
        offer(siblings, position + 1)
        if facts.depth[i] < options.max_depth:
            offer(facts.children(i), 0)
        if budget % NODES_PER_PIECE == 0:
            yield
    # The hottest prefixes are drawn whatever their size (their namespace too): the dashboard
    # lists and marks them.
    for i in _hottest(facts, options.top_k):
        if facts.depth[i] <= options.max_depth:
            while i >= 0 and not facts.shown[i]:
                facts.shown[i] = True
                i = facts.parent[i]


def _hottest(facts: _Facts, k: int) -> list[int]:
    """The `k` most-hit nodes with at least one hit, deeper first among equals."""
    nodes = facts.nodes
    return heapq.nlargest(k, facts.hit, key=lambda i: (nodes[i].hits, facts.prefix_pages[i]))


class _Builder:
    """Turns the marked nodes into TreeNodeViews, folding unmarked children into aggregates."""

    def __init__(self, page_size: int, options: SnapshotOptions, facts: _Facts,
                 namespace_id: Callable[[Hashable], str],
                 decode: Callable[[list[int]], str] | None, now: float, hashing: PageHashing) -> None:
        self.page_size = page_size
        self.hashing = hashing
        self.options = options
        self.facts = facts
        self.namespace_id = namespace_id
        self.decode = decode if options.include_tokens else None
        self.now = now
        self.next_id = 0
        self.nodes_shown = 0
        self.piece_nodes = 0  # nodes made into views since the last pause
        self.piece_tokens = 0  # tokens decoded or hashed since the last pause
        self.truncated = False
        self.views: dict[int, TreeNodeView] = {}
        self._namespace_ids: dict[Hashable, str] = {}
        self._seeds: dict[str, int] = {}

    def build(self) -> Generator[None, None, TreeNodeView]:
        f = self.facts
        roots = sorted(f.roots, key=f.subtree_pages.__getitem__, reverse=True)
        top = TreeNodeView(id=self._id(), kind="cache", pages=0, tokens=0, prefix_tokens=0,
                           subtree_pages=sum(f.subtree_pages[r] for r in roots),
                           subtree_nodes=sum(f.subtree_nodes[r] - 1 for r in roots),
                           lock_count=sum(f.nodes[r].lock_ref for r in roots), hits=0, tier=DEVICE_TIER)
        hidden = []  # namespaces holding no shown node: one aggregate, however many there are
        for root in roots:
            if not f.shown[root]:
                hidden.append(root)
                continue
            view = TreeNodeView(id=self._id(), kind="namespace", pages=0, tokens=0, prefix_tokens=0,
                                subtree_pages=f.subtree_pages[root], subtree_nodes=f.subtree_nodes[root] - 1,
                                lock_count=f.nodes[root].lock_ref, hits=0, tier=DEVICE_TIER,
                                namespace=self._namespace(f.nodes[root].namespace))
            top.children.append(view)
            yield from self._fill(root, view)
        if hidden:
            self.truncated = True
            pages = sum(f.subtree_pages[r] for r in hidden)
            top.children.append(TreeNodeView(
                id=self._id(), kind="aggregate", pages=pages, tokens=pages * self.page_size, prefix_tokens=0,
                subtree_pages=pages, subtree_nodes=sum(f.subtree_nodes[r] - 1 for r in hidden),
                lock_count=sum(f.nodes[r].lock_ref for r in hidden), hits=0, tier=DEVICE_TIER,
                namespaces=len(hidden)))
        return top

    def _fill(self, root: int, root_view: TreeNodeView) -> Generator[None, None, None]:
        """Fills the views below a namespace root, depth first and iteratively (a tree can be
        deeper than Python's stack), so ids follow pre-order. The state handed down is the
        page-hash chain's (state, pages so far) at the end of the parent's edge."""
        stack: list[tuple[int, TreeNodeView, Any]] = [(root, root_view, (0, 0))]
        while stack:
            i, view, state = stack.pop()
            kids = self.facts.children(i)
            hidden = [k for k in kids if not self.facts.shown[k]]
            pending = []
            for kid in kids:
                if self.facts.shown[kid]:
                    kid_view, kid_state = self._node(kid, state)
                    view.children.append(kid_view)
                    pending.append((kid, kid_view, kid_state))
                    if self._piece_done():
                        yield
            if hidden:
                self.truncated = True
                view.children.append(self._aggregate(hidden, i))
                self.piece_nodes += len(hidden)
                if self._piece_done():
                    yield
            stack.extend(reversed(pending))

    def _piece_done(self) -> bool:
        """Whether this piece has done its share (NODES_PER_PIECE nodes, or TOKENS_PER_PIECE
        tokens decoded or hashed); if so the counts start again for the next one."""
        if self.piece_nodes < NODES_PER_PIECE and self.piece_tokens < TOKENS_PER_PIECE:
            return False
        self.piece_nodes = self.piece_tokens = 0
        return True

    def _text(self, head: np.ndarray, tail: np.ndarray | None) -> tuple[str, bool]:
        """The text of `head` (all of the tokens when `tail` is None), else of `head`, TEXT_CUT
        and `tail` (the first and last tokens of a longer run); counted as work."""
        assert self.decode is not None
        ids = head.tolist()
        if tail is None:
            self.piece_tokens += len(ids)
            return self.decode(ids), False
        tail_ids = tail.tolist()
        self.piece_tokens += len(ids) + len(tail_ids)
        return self.decode(ids) + TEXT_CUT + self.decode(tail_ids), True

    def _node(self, i: int, parent_state: tuple[int, int]) -> tuple[TreeNodeView, Any]:
        f = self.facts
        node = f.nodes[i]
        size = self.page_size
        last_hash, state = self._last_hash(node, parent_state)
        token_ids = node.tokens.tolist() if self.options.include_tokens else None
        text, cut = None, False
        if self.decode is not None:
            half = TEXT_TOKENS // 2
            tokens = node.tokens
            text, cut = (self._text(tokens, None) if len(tokens) <= TEXT_TOKENS
                         else self._text(tokens[:half], tokens[-half:]))
        view = TreeNodeView(
            id=self._id(), kind="node", pages=f.pages[i], tokens=len(node.tokens),
            prefix_tokens=(f.prefix_pages[i] - f.pages[i]) * size + len(node.tokens), subtree_pages=f.subtree_pages[i],
            subtree_nodes=f.subtree_nodes[i], lock_count=node.lock_ref, hits=node.hits, tier=_tier(node),
            priority=DEFAULT_PRIORITY if node.priority is None else node.priority,
            priority_max=DEFAULT_PRIORITY if node.priority_max is None else node.priority_max,
            age_s=round(max(0.0, self.now - node.inserted_at), 3), tick=node.tick,
            namespace=self._namespace(node.namespace), hash=last_hash,
            token_ids=token_ids, partial=node.partial, text=text, text_truncated=cut)
        self.views[i] = view
        self.nodes_shown += 1
        self.piece_nodes += 1
        return view, state

    def _last_hash(self, node: NodeCopy, parent_state: tuple[int, int]) -> tuple[str | None, tuple[int, int]]:
        """The page hash of the edge's last page (what cache events call it) and the chain
        state for the children; computed here, not read from the tree's own cache of it."""
        if not self.options.include_hashes or not node.device_pages or node.partial:  # events name full pages only
            return None, parent_state
        state, depth = parent_state
        ns_id = self._namespace(node.namespace)
        seed = self._seeds.get(ns_id)
        if seed is None:
            seed = self._seeds[ns_id] = self.hashing.namespace_seed(ns_id)
        hashes, end = self.hashing.page_hashes(node.tokens, self.page_size, seed, state, depth)
        self.piece_tokens += len(node.tokens)
        return str(int(hashes[-1])), (end, depth + node.device_pages)

    def _aggregate(self, hidden: list[int], parent: int) -> TreeNodeView:
        f = self.facts
        pages = sum(f.subtree_pages[h] for h in hidden)
        return TreeNodeView(
            id=self._id(), kind="aggregate", pages=pages, tokens=pages * self.page_size,
            prefix_tokens=f.prefix_pages[parent] * self.page_size, subtree_pages=pages,
            subtree_nodes=sum(f.subtree_nodes[h] for h in hidden),
            lock_count=sum(f.nodes[h].lock_ref for h in hidden),
            hits=sum(f.nodes[h].hits for h in hidden), tier=DEVICE_TIER,
            namespace=self._namespace(f.nodes[parent].namespace))

    def rank_ticks(self) -> int:
        """Replaces each shown node's tick by its dense rank among them (1 = least recent);
        returns the highest rank (0: no node shown)."""
        ranks = {tick: rank for rank, tick in enumerate(sorted({view.tick for view in self.views.values()}), 1)}
        for view in self.views.values():
            view.tick = ranks[view.tick]
        return len(ranks)

    def top_prefixes(self, hottest: list[int]) -> Generator[None, None, list[TopPrefix]]:
        """The top prefixes of the nodes `hottest` (those shown), as pieces: it pauses between
        prefixes once a piece has decoded its share."""
        out = []
        for i in hottest:
            view = self.views.get(i)
            if view is None:  # deeper than max_depth
                continue
            text, cut = self._prefix_text(i)
            out.append(TopPrefix(id=view.id, hits=view.hits, prefix_tokens=view.prefix_tokens,
                                 pages=view.pages, namespace=view.namespace or "", hash=view.hash,
                                 text=text, text_truncated=cut))
            if self._piece_done():
                yield
        return out

    def _prefix_text(self, i: int) -> tuple[str | None, bool]:
        """The text of the prefix from the namespace root to the end of node `i`'s edge,
        decoded from TEXT_TOKENS of its tokens at most (the first and last halves of a longer
        one): only those are gathered, never the whole prefix."""
        if self.decode is None:
            return None, False
        edges = []  # the prefix's edges, last first
        while i >= 0 and not self.facts.nodes[i].is_root:
            edges.append(self.facts.nodes[i].tokens)
            i = self.facts.parent[i]
        edges.reverse()
        total = sum(len(edge) for edge in edges)
        if total <= TEXT_TOKENS:
            return self._text(np.concatenate(edges) if edges else np.zeros(0, np.int64), None)
        half = TEXT_TOKENS // 2
        return self._text(_first(edges, half), _first([edge[::-1] for edge in reversed(edges)], half)[::-1])

    def _namespace(self, namespace: Hashable) -> str:
        found = self._namespace_ids.get(namespace)
        if found is None:
            found = self._namespace_ids[namespace] = self.namespace_id(namespace)
        return found

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1


def _first(edges: list[np.ndarray], count: int) -> np.ndarray:
    """The first `count` tokens of the edges, in order (they hold at least that many)."""
    parts, left = [], count
    for edge in edges:
        if left <= 0:
            break
        parts.append(edge[:left])
        left -= len(parts[-1])
    return np.concatenate(parts)
