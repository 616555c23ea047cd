"""PagePool: allocation, reference counts, K/V tensors and sizing."""

import numpy as np
import pytest
import torch

from radixserve.cache.pool import OutOfPages, PagePool


def test_fresh_pool_hands_out_distinct_pages_in_order():
    pool = PagePool(8, 4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    assert pool.num_used == 5 and pool.num_free == 3
    assert pool.free_pages() == frozenset({5, 6, 7})
    assert [pool.refcount(p) for p in range(8)] == [1, 1, 1, 1, 1, 0, 0, 0]


def test_allocate_is_all_or_nothing():
    pool = PagePool(4, 1)
    pool.allocate(3)
    with pytest.raises(OutOfPages, match="asked for 2 pages, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_refcounts_free_a_page_only_when_the_last_holder_lets_go():
    pool = PagePool(4, 2)
    a, b = pool.allocate(2)
    pool.incref([a])
    assert pool.decref([a, b]) == [b]
    assert pool.refcount(a) == 1 and pool.refcount(b) == 0
    assert pool.decref([a]) == [a]
    assert pool.num_free == 4
    # A freed page is reused: the stack hands back the most recently freed first.
    assert pool.allocate(1) == [a]


def test_double_free_and_incref_of_free_page_raise():
    pool = PagePool(4, 4)
    (p,) = pool.allocate(1)
    pool.decref([p])
    with pytest.raises(ValueError, match=f"page {p} would drop below"):
        pool.decref([p])
    with pytest.raises(ValueError, match=f"page {p} is free"):
        pool.incref([p])
    with pytest.raises(ValueError, match="not in 0..3"):
        pool.decref([4])
    with pytest.raises(ValueError, match="not in 0..3"):
        pool.incref([-1])


def test_repeated_page_in_one_call_counts_each_time():
    pool = PagePool(4, 1)
    (p,) = pool.allocate(1)
    pool.incref([p, p])
    assert pool.refcount(p) == 3
    assert pool.decref(np.array([p, p, p])) == [p]
    assert pool.num_free == 4
    (q,) = pool.allocate(1)
    with pytest.raises(ValueError, match="below refcount 0"):
        pool.decref([q, q])
    assert pool.refcount(q) == 1  # a failed decref changes nothing


def test_bulk_refcounts_match_a_python_reference():
    rng = np.random.default_rng(0)
    pool = PagePool(64, 1)
    held: dict[int, int] = {}
    for _ in range(200):
        op = rng.integers(3)
        if op == 0 and pool.num_free:
            for p in pool.allocate(int(rng.integers(1, pool.num_free + 1))):
                held[p] = 1
        elif op == 1 and held:
            pages = rng.choice(sorted(held), size=int(rng.integers(1, 6)))
            pool.incref(pages)
            for p in pages.tolist():
                held[p] += 1
        elif held:
            pages = rng.choice(sorted(held), size=min(len(held), 5), replace=False).tolist()
            freed = pool.decref(pages)
            expect = [p for p in pages if held[p] == 1]
            for p in pages:
                held[p] -= 1
                if not held[p]:
                    del held[p]
            assert sorted(freed) == sorted(expect)
        assert pool.refcounts().tolist() == [held.get(p, 0) for p in range(64)]
        assert pool.free_pages() == frozenset(set(range(64)) - set(held))


def test_without_layers_there_are_no_tensors():
    pool = PagePool(16, 8)
    assert pool.k_cache == [] and pool.v_cache == []
    pool.copy_page(0, 1)  # nothing to copy, still valid


def test_kv_tensors_are_nhd_per_layer():
    pool = PagePool(5, 4, num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    assert len(pool.k_cache) == len(pool.v_cache) == 3
    for t in (*pool.k_cache, *pool.v_cache):
        assert t.shape == (5, 4, 2, 8) and t.dtype == torch.float16


@pytest.mark.parametrize("num_slots", [None, 0, 1, 3])
def test_copy_page_copies_leading_slots_in_every_layer(num_slots):
    pool = PagePool(4, 4, num_layers=2, num_kv_heads=1, head_dim=2)
    for layer in range(2):
        pool.k_cache[layer].copy_(torch.arange(32.0).reshape(4, 4, 1, 2) + 100 * layer)
        pool.v_cache[layer].copy_(-pool.k_cache[layer])
    before = [t.clone() for t in (*pool.k_cache, *pool.v_cache)]
    pool.copy_page(1, 3, num_slots)
    n = 4 if num_slots is None else num_slots
    for old, new in zip(before, (*pool.k_cache, *pool.v_cache)):
        assert torch.equal(new[3, :n], old[1, :n])
        assert torch.equal(new[3, n:], old[3, n:])
        assert torch.equal(new[:3], old[:3])
    with pytest.raises(ValueError):
        pool.copy_page(1, 3, 5)
    with pytest.raises(ValueError):
        pool.copy_page(2, 2)


@pytest.mark.parametrize("num_slots", [None, 0, 1, 7, 8])
def test_copy_page_through_the_backing_touches_only_leading_slots_of_dst(num_slots):
    """Random-filled caches: copy_page copies exactly slots [0, n) of page src into page dst in
    every layer's K and V, and nothing else; each per-layer cache is a contiguous view of one
    backing tensor, so writes made through `k_cache[i]` / `v_cache[i]` are what it copies."""
    layers, pages, page_size, heads, dim = 5, 6, 8, 3, 4
    pool = PagePool(pages, page_size, num_layers=layers, num_kv_heads=heads, head_dim=dim)
    generator = torch.Generator().manual_seed(7)
    for t in (*pool.k_cache, *pool.v_cache):
        assert t.shape == (pages, page_size, heads, dim) and t.is_contiguous()
        t.copy_(torch.randn(t.shape, generator=generator))  # written through the per-layer views
    for caches in (pool.k_cache, pool.v_cache):
        base = caches[0].untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in caches)  # one shared storage
        assert len({t.data_ptr() for t in caches}) == layers  # each layer its own region
    before = [t.clone() for t in (*pool.k_cache, *pool.v_cache)]
    src, dst = 4, 1
    pool.copy_page(src, dst, num_slots)
    n = page_size if num_slots is None else num_slots
    for old, new in zip(before, (*pool.k_cache, *pool.v_cache), strict=True):
        assert torch.equal(new[dst, :n], old[src, :n])
        assert torch.equal(new[dst, n:], old[dst, n:])
        others = [p for p in range(pages) if p != dst]
        assert torch.equal(new[others], old[others])
    # A later write through a per-layer view is what the next copy reads.
    pool.k_cache[layers - 1][src, 0].fill_(123.0)
    pool.v_cache[layers - 1][src, 0].fill_(-123.0)
    pool.copy_page(src, 2, 1)
    assert (pool.k_cache[layers - 1][2, 0] == 123.0).all()
    assert (pool.v_cache[layers - 1][2, 0] == -123.0).all()


def test_sizing_from_a_memory_budget():
    per_page = PagePool.bytes_per_page(16, 4, 2, 64, torch.bfloat16)
    assert per_page == 2 * 4 * 16 * 2 * 64 * 2
    pool = PagePool.from_memory_budget(10 * per_page + per_page // 2, 16, num_layers=4,
                                       num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device="cpu")
    assert pool.num_pages == 10
    total = sum(t.numel() * t.element_size() for t in (*pool.k_cache, *pool.v_cache))
    assert total == 10 * per_page
    with pytest.raises(ValueError, match="hold no page"):
        PagePool.from_memory_budget(per_page - 1, 16, num_layers=4, num_kv_heads=2, head_dim=64,
                                    dtype=torch.bfloat16, device="cpu")


@pytest.mark.parametrize("page_size", [0, 3, 12])
def test_page_size_must_be_a_power_of_two(page_size):
    with pytest.raises(ValueError, match="power of two"):
        PagePool(4, page_size)


def test_array_calls_equal_list_calls():
    """allocate_array / decref_count / distinct are the list API without Python-int lists."""
    lists, arrays = PagePool(32, 1), PagePool(32, 1)
    a = lists.allocate(10)
    b = arrays.allocate_array(10)
    assert b.dtype == np.int64 and b.tolist() == a
    b[0] = 99  # a fresh copy: writing it leaves the pool alone
    assert arrays.refcount(0) == 1 and arrays.num_free == 22
    b[0] = 0
    lists.incref(a[:4])
    arrays.incref(b[:4], distinct=True)
    assert lists.refcounts().tolist() == arrays.refcounts().tolist()
    assert arrays.decref_count(b[2:6], distinct=True) == len(lists.decref(a[2:6])) == 2
    assert lists.refcounts().tolist() == arrays.refcounts().tolist()
    assert lists.free_pages() == arrays.free_pages()
    with pytest.raises(ValueError, match="page -1 is not in"):
        arrays.decref_count(np.array([3, -1]), distinct=True)
    with pytest.raises(ValueError, match="page 32 is not in"):
        arrays.incref(np.array([32]), distinct=True)
    assert arrays.allocate_array(0).tolist() == []


def test_the_duplicate_check_counts_repeats_and_distinct_skips_it():
    pool = PagePool(8, 1)
    (p,) = pool.allocate(1)
    pool.incref([p, p])  # checked: two more holders
    assert pool.refcount(p) == 3
    pool.incref(np.array([p, p]), distinct=True)  # the caller promised distinct pages: one more
    assert pool.refcount(p) == 4
