"""The adaptive rule's ghost caches follow what the tree caches (cache/adaptive.py,
`AdaptiveReuse.inserted` through `RadixTree.insert_observer`): pages a prompt never showed —
a reply — take room in every ghost cache as they do in the tree, with the boost the insert
gave them, and count no hit."""

from __future__ import annotations

import numpy as np

from radixserve.cache.adaptive import AdaptiveReuse
from radixserve.cache.invariants import check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree, Retention
from tests.test_adaptive import PAGE, cache_tokens


def adaptive_tree(num_pages: int, window_pages: int | None = None) -> tuple[RadixTree, AdaptiveReuse]:
    """A tree under the adaptive policy and its arrival hook (the engine's window unless
    `window_pages`: the ghosts' record decays once per window)."""
    tree = RadixTree(PagePool(num_pages, PAGE), eviction_policy="adaptive")
    return tree, AdaptiveReuse(tree, window_pages or 16 * num_pages)


def test_an_inserted_reply_enters_every_ghost_cache_without_a_hit() -> None:
    tree, reuse = adaptive_tree(32)
    prompt = np.arange(1, 2 * PAGE + 1)
    reply = np.arange(100, 100 + 2 * PAGE)
    reuse.observe(prompt)
    cache_tokens(tree, np.concatenate([prompt, reply]), [])
    reply_hashes = reuse.history.hashes(np.concatenate([prompt, reply]))[2:]
    for ghost in reuse.duel.ghosts:
        assert all(h in ghost._keys for h in reply_hashes)  # the tree holds them: so does the model
        assert ghost.hits == 0  # no prompt looked them up
    check_invariants(tree.pool, tree, [])


def test_an_insert_boosts_in_the_ghosts_exactly_the_pages_it_boosts_in_the_tree() -> None:
    tree, reuse = adaptive_tree(32)
    tokens = np.arange(1, 4 * PAGE + 1)
    cache_tokens(tree, tokens, [(0, 2 * PAGE, Retention(boost=True))])
    hashes = reuse.history.hashes(tokens)
    for ghost in reuse.duel.ghosts:
        assert [h in ghost._boosted for h in hashes] == [True, True, False, False]


def test_the_lru_ghost_follows_the_tree_when_replies_take_room() -> None:
    # Conversations whose turns resend the history: each turn's reply is cached by the tree
    # as the turn ends and seen in a prompt only at the next turn. At LRU the tree is what
    # LRU's ghost cache models (every page sampled at this size), so the two hit alike, prompt
    # by prompt, only if the ghost also takes the replies (without them it holds more of the
    # histories than the tree has room for, and hits more).
    rng = np.random.default_rng(0)
    tree, reuse = adaptive_tree(24, window_pages=10**9)  # no decay: hits stay whole counts
    histories = [np.zeros(0, dtype=np.int64) for _ in range(6)]
    tree_hits = ghost_hits = 0.0
    for _ in range(60):
        c = int(rng.integers(len(histories)))
        prompt = np.concatenate([histories[c], rng.integers(1, 10**6, size=PAGE)])
        before = reuse.duel.ghosts[0].hits
        reuse.observe(prompt)
        turn = np.concatenate([prompt, rng.integers(1, 10**6, size=2 * PAGE)])
        tree_hits += cache_tokens(tree, turn, []) // PAGE
        ghost_hits += reuse.duel.ghosts[0].hits - before
        histories[c] = turn if len(turn) <= 12 * PAGE else np.zeros(0, dtype=np.int64)  # a new conversation
    assert reuse.duel.lead == 0.0
    assert ghost_hits == tree_hits
    check_invariants(tree.pool, tree, [])
