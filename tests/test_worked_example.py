"""A worked example of block tables over a page pool with page size 4 (the same as
examples/block_table_trace.py; the contracts: ARCHITECTURE.md §1 and §4).

A has 6 tokens → pages [7, 2] (4 + 2 slots used); B has 3 tokens → [9]; 9 of 12 allocated
slots hold tokens. A grows to 9 tokens: page 2 fills and page 4 is added → [7, 2, 4]. B
finishes: its page returns to the pool, or stays in the tree as unlocked cache. Reading A's
tokens follows the block table, not the physical order.
"""

import math

import pytest
import torch

from radixserve.cache.invariants import SequenceView, check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import RadixTree

P, HEADS, DIM = 4, 2, 3


def kv_value(seq_id: int, position: int) -> torch.Tensor:
    """A distinct [HEADS, DIM] K value for each token of each sequence."""
    return torch.full((HEADS, DIM), 100.0 * seq_id + position) + torch.arange(HEADS * DIM).view(HEADS, DIM) / 100


def write(pool: PagePool, table: list[int], seq_id: int, start: int, end: int) -> None:
    """Writes tokens [start, end) of a sequence into the slots its block table gives them."""
    k_slots, v_slots = (cache[0].view(-1, HEADS, DIM) for cache in (pool.k_cache, pool.v_cache))
    for pos in range(start, end):
        slot = table[pos // P] * P + pos % P
        k_slots[slot], v_slots[slot] = kv_value(seq_id, pos), -kv_value(seq_id, pos)


def read(pool: PagePool, table: list[int], num_tokens: int) -> torch.Tensor:
    """K of tokens 0..num_tokens-1, gathered through the block table."""
    index = torch.tensor([table[pos // P] * P + pos % P for pos in range(num_tokens)])
    return pool.k_cache[0].view(-1, HEADS, DIM)[index]


def expected(seq_id: int, num_tokens: int) -> torch.Tensor:
    return torch.stack([kv_value(seq_id, pos) for pos in range(num_tokens)])


@pytest.fixture
def pool() -> PagePool:
    """A 10-page pool whose free list hands out 7, 2, 9, 4 next, as in the example."""
    pool = PagePool(10, P, num_layers=1, num_kv_heads=HEADS, head_dim=DIM)
    pages = pool.allocate(10)
    pool.decref([p for p in pages if p not in (7, 2, 9, 4)] + [4, 9, 2, 7])
    return pool


@pytest.mark.parametrize("keep_b_as_cache", [False, True])
def test_block_tables_follow_the_worked_example(pool, keep_b_as_cache):
    tree = RadixTree(pool)
    a_tokens, b_tokens = list(range(1000, 1006)), list(range(2000, 2003))

    a = pool.allocate(math.ceil(len(a_tokens) / P))
    write(pool, a, 0, 0, 6)
    b = pool.allocate(math.ceil(len(b_tokens) / P))
    write(pool, b, 1, 0, 3)
    assert (a, b) == ([7, 2], [9])
    slots_allocated = (len(a) + len(b)) * P
    assert (len(a_tokens) + len(b_tokens), slots_allocated) == (9, 12)
    check_invariants(pool, tree, [SequenceView(a, 6), SequenceView(b, 3)])

    # A grows to 9 tokens: tokens 6 and 7 fill page 2, token 8 needs a third page.
    a_tokens += [1006, 1007, 1008]
    a += pool.allocate(math.ceil(len(a_tokens) / P) - len(a))
    write(pool, a, 0, 6, 9)
    assert a == [7, 2, 4]
    check_invariants(pool, tree, [SequenceView(a, 9), SequenceView(b, 3)])

    # Reading follows the table; the physical page order would scramble A.
    assert torch.equal(read(pool, a, 9), expected(0, 9))
    assert not torch.equal(read(pool, sorted(a), 9), expected(0, 9))
    assert torch.equal(read(pool, b, 3), expected(1, 3))

    if keep_b_as_cache:
        # B decodes one more token, so its page is full and can be cached when it finishes.
        b_tokens.append(2003)
        write(pool, b, 1, 3, 4)
        assert tree.insert(b_tokens, b) == []
        pool.decref(b)
        assert pool.refcount(9) == 1 and tree.evictable_pages == 1
        check_invariants(pool, tree, [SequenceView(a, 9)])
        # A later request with B's prefix reads B's K/V straight from the cached page.
        hit = tree.match(b_tokens + [7777])
        assert (hit.pages, hit.num_tokens) == ([9], 4)
        assert torch.equal(read(pool, hit.pages, 4), expected(1, 4))
        # One that shares only B's first 3 tokens copies them out of the cached page.
        near = tree.match(b_tokens[:3] + [7777])
        assert (near.pages, near.partial_page, near.partial_tokens) == ([], 9, 3)
        (private,) = pool.allocate(1)
        pool.copy_page(near.partial_page, private, near.partial_tokens)
        assert torch.equal(read(pool, [private], 3), expected(1, 3))
        pool.decref([private])
        assert tree.evict(1) == 1
    else:
        pool.decref(b)
    check_invariants(pool, tree, [SequenceView(a, 9)], released_pages=[9])
    assert 9 in pool.free_pages() and pool.num_free == 7

    # A finishes: its two full pages stay cached, the partial page 4 goes back to the pool.
    assert tree.insert(a_tokens, a) == []
    pool.decref(a)
    check_invariants(pool, tree, [], released_pages=[4])
    assert tree.match(a_tokens).pages == [7, 2]
    assert torch.equal(read(pool, [7, 2], 8), expected(0, 8))
