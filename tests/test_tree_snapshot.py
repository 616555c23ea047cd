"""The bounded tree view: exact node facts, aggregation within limits, hottest prefixes kept."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from radixserve.cache.page_hash import namespace_id, namespace_seed, page_hashes
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree, Retention
from radixserve.engine.tree_snapshot import SnapshotOptions, TreeNodeView, snapshot_tree

P = 4


def make_tree(num_pages: int = 256) -> tuple[PagePool, RadixTree]:
    pool = PagePool(num_pages, P)
    return pool, RadixTree(pool, clock=lambda: 100.0)


def cache(pool: PagePool, tree: RadixTree, tokens: list[int], namespace: Any = None,
          retention: Retention | None = None) -> None:
    pages = pool.allocate(len(tokens) // P)
    tree.insert(tokens, pages, namespace, retention)
    pool.decref(pages)


def snap(tree: RadixTree, **options: Any) -> Any:
    return snapshot_tree(tree, SnapshotOptions(**options), namespace_id=lambda ns: f"ns-{ns}",
                         decode=lambda ids: ",".join(map(str, ids)), now=110.0)


def flat(view: TreeNodeView) -> list[TreeNodeView]:
    out, stack = [], [view]
    while stack:
        v = stack.pop()
        out.append(v)
        stack.extend(reversed(v.children))
    return out


def test_exact_facts_of_a_small_tree() -> None:
    pool, tree = make_tree()
    shared = list(range(1, 5))
    cache(pool, tree, shared + list(range(5, 13)), "a")            # 3 pages
    cache(pool, tree, shared + list(range(20, 24)), "a", Retention(80))  # splits after page 1
    cache(pool, tree, list(range(50, 58)), "b")                   # another namespace, 2 pages
    match = tree.match(shared + [20, 21, 22, 23, 99], "a")
    tree.lock(match.node)

    s = snap(tree)
    assert (s.nodes_total, s.pages_total, s.locked_pages, s.nodes_shown, s.truncated) == (4, 6, 2, 4, False)
    top = s.root
    assert top.kind == "cache" and top.subtree_pages == 6 and top.subtree_nodes == 4 and top.lock_count == 1
    ns_a, ns_b = top.children
    assert (ns_a.kind, ns_a.namespace, ns_a.subtree_pages, ns_a.subtree_nodes) == ("namespace", "ns-a", 4, 3)
    assert (ns_b.namespace, ns_b.subtree_pages, ns_b.subtree_nodes) == ("ns-b", 2, 1)
    (shared_node,) = ns_a.children
    assert (shared_node.pages, shared_node.tokens, shared_node.prefix_tokens) == (1, 4, 4)
    assert (shared_node.subtree_pages, shared_node.subtree_nodes, shared_node.hits) == (4, 3, 1)
    assert shared_node.lock_count == 1 and shared_node.priority == 80 and shared_node.age_s == 10.0
    long_tail, locked_tail = shared_node.children  # larger subtree first
    assert (long_tail.pages, long_tail.prefix_tokens, long_tail.lock_count, long_tail.priority) == (2, 12, 0, 35)
    assert (locked_tail.pages, locked_tail.prefix_tokens, locked_tail.lock_count, locked_tail.hits) == (1, 8, 1, 1)
    assert (locked_tail.priority, locked_tail.priority_max) == (80, 80)
    assert [v.id for v in flat(top)] == list(range(7))  # ids in pre-order
    assert locked_tail.tick == s.recency_tick  # the most recent use
    # The hottest prefix: the locked tail and the shared node both have one hit; deeper first.
    assert [(p.id, p.hits, p.prefix_tokens) for p in s.top_prefixes] == [(locked_tail.id, 1, 8), (shared_node.id, 1, 4)]
    encoded = msgspec.json.decode(msgspec.json.encode(s))
    assert "token_ids" not in str(encoded) and "text" not in str(encoded)  # nothing exposed by default


def test_tokens_only_when_asked() -> None:
    pool, tree = make_tree()
    cache(pool, tree, list(range(1, 9)))
    tree.match(list(range(1, 9)) + [0])
    s = snap(tree, include_tokens=True)
    (node,) = s.root.children[0].children
    assert node.token_ids == list(range(1, 9)) and node.text == "1,2,3,4,5,6,7,8"
    assert s.top_prefixes[0].text == "1,2,3,4,5,6,7,8"


def fan(pool: PagePool, tree: RadixTree, stem: list[int], sizes: range) -> None:
    """`stem` (one page) with one child per size, child i holding i pages."""
    for i in sizes:
        cache(pool, tree, stem + [1000 + i] * (4 * i))


def test_largest_subtrees_are_kept_and_the_rest_aggregated_exactly() -> None:
    pool, tree = make_tree()
    fan(pool, tree, [1, 2, 3, 4], range(1, 11))  # 1 + 55 pages, 11 nodes
    s = snap(tree, max_nodes=4)
    (ns,) = s.root.children
    (stem,) = ns.children
    kinds = [(c.kind, c.subtree_pages, c.subtree_nodes) for c in stem.children]
    assert kinds == [("node", 10, 1), ("node", 9, 1), ("node", 8, 1), ("aggregate", 28, 7)]
    assert s.nodes_shown == 4 and s.truncated and s.nodes_total == 11
    assert stem.children[-1].tokens == 28 * P and stem.children[-1].prefix_tokens == 4
    # Page totals stay exact at every level.
    for view in flat(s.root):
        if view.children:
            assert sum(c.subtree_pages for c in view.children) + view.pages == view.subtree_pages


def test_depth_limit_folds_deeper_nodes() -> None:
    pool, tree = make_tree()
    fan(pool, tree, [1, 2, 3, 4], range(1, 4))
    s = snap(tree, max_depth=1)
    (stem,) = s.root.children[0].children
    assert [(c.kind, c.subtree_pages, c.subtree_nodes) for c in stem.children] == [("aggregate", 6, 3)]


def test_the_hottest_prefix_is_drawn_even_when_small() -> None:
    pool, tree = make_tree()
    fan(pool, tree, [1, 2, 3, 4], range(1, 11))
    small = [1, 2, 3, 4] + [1001] * 4  # the 1-page child
    for _ in range(3):
        tree.match(small + [7])
    s = snap(tree, max_nodes=2, top_k=1)
    (stem,) = s.root.children[0].children
    shown = [(c.kind, c.subtree_pages) for c in stem.children]
    assert shown == [("node", 10), ("node", 1), ("aggregate", 44)]
    assert s.top_prefixes[0].id == stem.children[1].id and s.top_prefixes[0].hits == 3


def test_a_deep_chain_does_not_recurse() -> None:
    pool, tree = make_tree(num_pages=2048)
    tokens = np.arange(1, 1500 * P + 1)
    cache(pool, tree, tokens.tolist())
    for n in range(1499, 0, -1):  # each lookup splits the top edge: 1500 nodes in a chain
        tree.match(tokens[: n * P].tolist() + [0])
    s = snap(tree, max_depth=100, max_nodes=5000)
    assert s.nodes_total == 1500 and s.nodes_shown == 100
    deepest = flat(s.root)[-1]
    assert deepest.kind == "aggregate" and deepest.subtree_nodes == 1400 and deepest.prefix_tokens == 100 * P


def test_an_empty_tree() -> None:
    _, tree = make_tree()
    s = snap(tree)
    assert (s.nodes_total, s.pages_total, s.root.children, s.top_prefixes) == (0, 0, [], [])


def test_hashes_name_each_node_like_cache_events() -> None:
    pool, tree = make_tree()
    cache(pool, tree, list(range(1, 13)), ("m", None))
    cache(pool, tree, list(range(1, 5)) + [7, 7, 7, 7], ("m", None))
    cache(pool, tree, list(range(1, 9)), ("m", "salt"))
    s = snapshot_tree(tree, SnapshotOptions(include_hashes=True), namespace_id=namespace_id)
    nodes = [v for v in flat(s.root) if v.kind == "node"]
    assert len(nodes) == 4 and all(v.hash is not None for v in nodes)
    # Each node's hash is its last page's, computed from the whole prefix's token ids alone.
    expected = {
        (1, 4): (("m", None), list(range(1, 5))),
        (2, 12): (("m", None), list(range(1, 13))),
        (1, 8): (("m", None), list(range(1, 5)) + [7, 7, 7, 7]),
        (2, 8): (("m", "salt"), list(range(1, 9))),
    }
    for v in nodes:
        (namespace, tokens) = expected[(v.pages, v.prefix_tokens)]
        hashes, _ = page_hashes(np.array(tokens), P, namespace_seed(namespace_id(namespace)))
        assert v.hash == str(int(hashes[-1])) and v.namespace == namespace_id(namespace)
    assert {(v.namespace, int(v.hash)) for v in nodes} <= tree.cached_page_hashes()
    assert snap(tree).root.children[0].children[0].hash is None  # only when asked


def test_a_partial_leaf_is_drawn_as_one_page_holding_its_tokens_with_no_hash() -> None:
    pool, tree = make_tree()
    pages = pool.allocate(3)
    tree.insert(list(range(10)), pages, partial=True)  # 2 full pages, then a page holding 2 tokens
    pool.decref(pages)
    view = snap(tree, include_tokens=True, include_hashes=True)
    (full,) = [v for v in flat(view.root) if v.kind == "node" and not v.partial]
    (partial,) = [v for v in flat(view.root) if v.partial]
    assert (full.pages, full.tokens, full.prefix_tokens, full.subtree_pages) == (2, 8, 8, 3)
    assert (partial.pages, partial.tokens, partial.prefix_tokens, partial.token_ids) == (1, 2, 10, [8, 9])
    assert partial.hash is None and full.hash is not None  # events name full pages only
    assert view.pages_total == 3


def test_max_nodes_bounds_the_namespaces_too() -> None:
    """Each namespace that a shown node lies in is listed; the others (a tenant can make
    thousands with distinct cache salts) fold into one aggregate child of the top, totals exact."""
    pool, tree = make_tree(num_pages=512)
    for i in range(24):  # 24 namespaces, namespace i holding i + 1 pages in one node
        cache(pool, tree, [i + 1] * (4 * (i + 1)), f"salt-{i}")
    for _ in range(2):
        tree.match([1, 1, 1, 1, 0], "salt-0")  # a hot prefix in the smallest
    s = snap(tree, max_nodes=5, top_k=1)
    *listed, rest = s.root.children
    assert [v.kind for v in listed] == ["namespace"] * 6 and rest.kind == "aggregate"
    assert [v.namespace for v in listed] == [f"ns-salt-{i}" for i in (23, 22, 21, 20, 19, 0)]
    assert (rest.namespaces, rest.subtree_nodes, rest.namespace, rest.prefix_tokens) == (18, 18, None, 0)
    assert rest.subtree_pages == rest.pages == sum(range(2, 20)) and rest.tokens == rest.pages * P
    assert s.nodes_shown == 6 and s.truncated and s.top_prefixes[0].namespace == "ns-salt-0"
    assert sum(v.subtree_pages for v in s.root.children) == s.root.subtree_pages == s.pages_total == 300
    assert sum(v.subtree_nodes for v in s.root.children) == s.root.subtree_nodes == s.nodes_total == 24
    everything = snap(tree)  # everything fits: every namespace listed, nothing aggregated
    assert [v.kind for v in everything.root.children] == ["namespace"] * 24 and not everything.truncated
