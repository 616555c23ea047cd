"""Walks through a worked example of paged KV, printing block tables and the page pool
(the contracts of the pool, the tree and the block tables: ARCHITECTURE.md §1-§4).

Page size 4. A has 6 tokens → two pages; B has 3 tokens → one page; A grows to 9 tokens and
gets a third page; B finishes and its page is cached in the radix tree (unlocked), then
evicted back to the pool; A finishes and its full pages stay cached.

    python examples/block_table_trace.py
"""

from __future__ import annotations

import math

import torch

from radixserve.cache import PagePool, RadixTree, SequenceView, check_invariants

PAGE_SIZE, HEADS, DIM = 4, 1, 2


def show(step: str, pool: PagePool, tree: RadixTree, seqs: dict[str, tuple[list[int], int]]) -> None:
    """Prints every block table, the free list, refcounts and slot usage."""
    print(f"\n== {step}")
    for name, (table, num_tokens) in seqs.items():
        last = num_tokens - (len(table) - 1) * PAGE_SIZE if table else 0
        print(f"  {name}: {num_tokens} tokens  block table {table}  last page {last}/{PAGE_SIZE} slots")
    refcounts = {p: pool.refcount(p) for p in range(pool.num_pages) if pool.refcount(p)}
    print(f"  pool: free {sorted(pool.free_pages())}  refcounts {refcounts}")
    slots = sum(n for _, n in seqs.values())
    allocated = sum(len(t) for t, _ in seqs.values()) * PAGE_SIZE
    print(f"  slots: {slots} of {allocated} allocated to sequences hold tokens; "
          f"tree caches {tree.cached_pages} page(s), {tree.evictable_pages} evictable")
    check_invariants(pool, tree, [SequenceView(t, n) for t, n in seqs.values()])


def write(pool: PagePool, table: list[int], first: int, values: list[float]) -> None:
    """Stores one K value per token at the slot its block table gives it."""
    slots = pool.k_cache[0].view(-1, HEADS, DIM)
    for pos, value in enumerate(values, first):
        slots[table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE] = value


def read(pool: PagePool, table: list[int], num_tokens: int) -> list[float]:
    slots = pool.k_cache[0].view(-1, HEADS, DIM)
    return [slots[table[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE, 0, 0].item()
            for pos in range(num_tokens)]


def main() -> None:
    pool = PagePool(10, PAGE_SIZE, num_layers=1, num_kv_heads=HEADS, head_dim=DIM, dtype=torch.float32)
    tree = RadixTree(pool)
    # Churn the free list so pages come out scattered (7, 2, 9, 4), as in a long-running server.
    pages = pool.allocate(10)
    pool.decref([p for p in pages if p not in (7, 2, 9, 4)] + [4, 9, 2, 7])

    a_tokens, b_tokens = list(range(100, 106)), list(range(200, 203))
    a = pool.allocate(math.ceil(len(a_tokens) / PAGE_SIZE))
    write(pool, a, 0, [10.0 + i for i in range(6)])          # A0..A5 → 10..15
    b = pool.allocate(math.ceil(len(b_tokens) / PAGE_SIZE))
    write(pool, b, 0, [20.0 + i for i in range(3)])          # B0..B2 → 20..22
    show("A has 6 tokens, B has 3", pool, tree, {"A": (a, 6), "B": (b, 3)})

    a_tokens += [106, 107, 108]
    a += pool.allocate(math.ceil(len(a_tokens) / PAGE_SIZE) - len(a))
    write(pool, a, 6, [16.0, 17.0, 18.0])
    show("A grows to 9 tokens: its second page fills, a third is allocated", pool, tree,
         {"A": (a, 9), "B": (b, 3)})
    print(f"  reading A through its table: {read(pool, a, 9)}")
    print(f"  reading in physical page order {sorted(a)} instead: {read(pool, sorted(a), 9)}")

    b_tokens.append(203)
    write(pool, b, 3, [23.0])
    tree.insert(b_tokens, b)
    pool.decref(b)
    show("B decodes a 4th token and finishes: its full page stays in the tree, unlocked",
         pool, tree, {"A": (a, 9)})
    hit = tree.match(b_tokens + [999])
    print(f"  a request starting with B's tokens hits pages {hit.pages} ({hit.num_tokens} tokens): "
          f"{read(pool, hit.pages, hit.num_tokens)}")

    tree.evict(1)
    show("memory is short: the tree evicts B's page back to the pool", pool, tree, {"A": (a, 9)})

    tree.insert(a_tokens, a)
    pool.decref(a)
    show("A finishes: its 2 full pages stay cached, the partial third page is freed", pool, tree, {})


if __name__ == "__main__":
    main()
