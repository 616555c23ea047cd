"""A tree view with token text is sized by work, not only by nodes: no piece of it (one
engine step's stall, sliced_work.py) decodes or hashes more than a bounded number of tokens,
however long the edges and prefixes are, and each text is decoded from a bounded number of
tokens (its first and last halves), while `token_ids` stay whole.

Before, a piece was 64 shown nodes whatever their length, and the top prefixes' whole texts
were decoded in the last piece: on 4,000-token prompts one view held every stream's next step
up by 100-250 ms."""

from __future__ import annotations

from typing import Any

import numpy as np

from radixserve.cache.page_hash import PageHashing
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree
from radixserve.engine.tree_copy import copy_tree, run_to_end
from radixserve.engine.tree_snapshot import SnapshotOptions, TreeNodeView, build_view

P = 4
EDGE = 1000          # tokens per long edge (250 pages)
BRANCHES = 40        # long edges below the long shared stem
# The most tokens one piece may decode or hash: the budget per piece plus one node's share
# (a 1000-token edge hashed, and at most 256 tokens of text decoded for it).
PIECE_BOUND = 4096


class CountingHashing(PageHashing):
    """The public page hashing, counting the tokens it hashes."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = 0

    def page_hashes(self, tokens: np.ndarray, page_size: int, seed: int = 0, state: int = 0,
                    first_page: int = 0) -> tuple[np.ndarray, int]:
        self.tokens += len(tokens)
        return super().page_hashes(tokens, page_size, seed, state, first_page)


def long_tree() -> RadixTree:
    """A 3000-token stem shared by BRANCHES prompts of EDGE more tokens each, every one hit once
    (so all are top prefixes), plus BRANCHES unrelated EDGE-token prompts, hit too."""
    pool = PagePool(2 * BRANCHES * EDGE // P + 3000 // P + 16, P)
    tree = RadixTree(pool, clock=lambda: 100.0)
    rng = np.random.default_rng(0)
    stem = rng.integers(1000, 2000, 3000)
    prompts = [np.concatenate([stem, [i], rng.integers(0, 1000, EDGE - 1)]) for i in range(BRANCHES)]
    prompts += [np.concatenate([[5000 + i], rng.integers(0, 1000, EDGE - 1)]) for i in range(BRANCHES)]
    for tokens in prompts:
        pages = pool.allocate(len(tokens) // P)
        tree.insert(tokens, pages, None)
        pool.decref(pages)
        tree.match(tokens, None)
    return tree


def decode(ids: list[int]) -> str:
    return ",".join(map(str, ids))


def views(node: TreeNodeView) -> list[TreeNodeView]:
    out, stack = [], list(node.children)
    while stack:
        view = stack.pop()
        out.append(view)
        stack.extend(view.children)
    return out


def test_no_piece_of_a_view_with_text_decodes_or_hashes_more_than_its_share() -> None:
    tree = long_tree()
    copy = run_to_end(copy_tree(tree))
    decoded = [0]

    def counting_decode(ids: list[int]) -> str:
        decoded[0] += len(ids)
        return decode(ids)

    hashing = CountingHashing()
    options = SnapshotOptions(max_nodes=2000, max_depth=32, top_k=100, include_hashes=True, include_tokens=True)
    work = build_view(copy, options, namespace_id=lambda ns: f"ns-{ns}", decode=counting_decode, hashing=hashing)
    per_piece: list[int] = []
    while True:
        before = decoded[0] + hashing.tokens
        try:
            next(work)
        except StopIteration as stop:
            snapshot: Any = stop.value
            per_piece.append(decoded[0] + hashing.tokens - before)
            break
        per_piece.append(decoded[0] + hashing.tokens - before)
    assert max(per_piece) <= PIECE_BOUND, sorted(per_piece)[-5:]
    # The work was all done (the text of every node and prefix, every edge hashed), only spread out.
    assert hashing.tokens == 3000 + 2 * BRANCHES * EDGE
    assert len(snapshot.top_prefixes) == 2 * BRANCHES + 1  # the stem is hit too

    nodes = [v for v in views(snapshot.root) if v.kind == "node"]
    assert len(nodes) == 2 * BRANCHES + 1
    for node in nodes:
        assert len(node.token_ids) == node.tokens  # the ids stay whole
        assert node.text_truncated and node.text.count(",") == 256 - 2  # 128 + 128 tokens, one cut between
        head, tail = node.text.split(" … ")
        assert head == decode(node.token_ids[:128]) and tail == decode(node.token_ids[-128:])
    # A top prefix below the stem: the stem's first tokens and its own edge's last ones.
    deep = next(p for p in snapshot.top_prefixes if p.prefix_tokens == 3000 + EDGE)
    stem = next(n for n in nodes if n.tokens == 3000)
    node = next(n for n in nodes if n.id == deep.id)
    assert deep.text_truncated
    assert deep.text == decode(stem.token_ids[:128]) + " … " + decode(node.token_ids[-128:])


def test_short_texts_are_whole() -> None:
    pool = PagePool(64, P)
    tree = RadixTree(pool, clock=lambda: 100.0)
    for tokens in (list(range(1, 41)), list(range(1, 21)) + list(range(100, 120))):
        pages = pool.allocate(len(tokens) // P)
        tree.insert(tokens, pages, None)
        pool.decref(pages)
        tree.match(tokens, None)
    copy = run_to_end(copy_tree(tree))
    snapshot = run_to_end(build_view(copy, SnapshotOptions(include_tokens=True), namespace_id=str, decode=decode))
    assert not any(v.text_truncated for v in views(snapshot.root))
    texts = sorted(p.text for p in snapshot.top_prefixes)
    assert texts == sorted([decode(list(range(1, 21))), decode(list(range(1, 41))),
                            decode(list(range(1, 21)) + list(range(100, 120)))])
