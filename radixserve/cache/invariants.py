"""Structural checks of the pool, the radix tree and the live block tables.

Structural correctness only (who holds which page, whether the tree is well formed); whether a
page holds the right K/V is checked elsewhere by recomputation. Each failure raises
`InvariantError` whose message starts with the rule's name in brackets and names the page
or node at fault.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from radixserve.cache.pool import OUT_OF_WINDOW_PAGE, PagePool
from radixserve.cache.radix import RadixNode, RadixTree


class InvariantError(AssertionError):
    """A broken cache invariant; the message names the rule and the page."""


@dataclass
class SequenceView:
    """What the checker needs of a live sequence."""

    block_table: Sequence[int]
    num_tokens: int   # tokens whose K/V are in the pages
    window: int | None = None  # sliding window: leading pages before it may be OUT_OF_WINDOW_PAGE


def _fail(rule: str, message: str) -> None:
    raise InvariantError(f"[{rule}] {message}")


def check_invariants(pool: PagePool, tree: RadixTree | None, sequences: Iterable[SequenceView],
                     released_pages: Iterable[int] = ()) -> None:
    """Raises InvariantError unless all of these hold:

    - tree shape: every child links back to its parent under the key of its first page; an
      edge is a whole number (>= 1) of pages; per-page retention arrays match the page count;
      a node's namespace is its parent's; sorted child keys match the children;
    - partial leaves (node.py): exactly the nodes with fewer than page_size tokens; each holds
      one device page and 1..page_size-1 tokens, has no children, no host copy and no lock,
      and its tokens are a prefix of no sibling's key;
    - locks: `lock_ref(node) = locks taken on node + sum of lock_ref(children)`, so
      `lock_ref(node) >= sum(lock_ref(child)) >= 0`;
    - counters: cached / locked / evictable pages and the node count equal a recount, and
      every unlocked leaf is queued for eviction;
    - no page is cached twice (namespaces never share pages);
    - block tables: `len(block_table) == ceil(num_tokens / page_size)`, no page listed twice;
    - sliding window: OUT_OF_WINDOW_PAGE entries only in a sequence with a window, only leading, and
      exactly the pages wholly before the window of its next token (position num_tokens sees
      the `window` positions ending there), so it holds at most ceil(window / page_size) + 1;
    - copy-on-write: a sequence's next write slot, when it lies in a page it already has (the
      last page is partly filled), is in a page it alone holds (refcount 1, not cached), so no
      write of one sequence is visible to another;
    - refcounts: every page's refcount equals its holders (the tree once per cached page,
      plus each block table listing it), so every referenced page is allocated;
    - free list: exactly the pages with refcount 0, no page listed twice;
    - `released_pages` are free;
    - with a host tier (`tree.host`), see `_check_host_tier`.
    """
    size = pool.page_size
    sequences = list(sequences)
    held: list[np.ndarray] = []
    if tree is not None:
        held.append(_check_tree(tree, size))
    for i, seq in enumerate(sequences):
        table = np.asarray(list(seq.block_table), dtype=np.int64)
        expected = math.ceil(seq.num_tokens / size)
        if len(table) != expected:
            _fail("block-table-coverage", f"sequence {i}: {len(table)} pages for {seq.num_tokens} "
                  f"tokens, expected {expected} (page size {size})")
        out_of_window = int(np.argmax(table != OUT_OF_WINDOW_PAGE)) if (table != OUT_OF_WINDOW_PAGE).any() else len(table)
        if out_of_window:
            _check_window(i, table, out_of_window, seq, size)
            table = table[out_of_window:]
        if len(np.unique(table)) != len(table):
            _fail("block-table-duplicate", f"sequence {i}: block table {table.tolist()} lists a page twice")
        held.append(table)

    pages = np.concatenate(held) if held else np.empty(0, dtype=np.int64)
    if len(pages) and (pages.min() < 0 or pages.max() >= pool.num_pages):
        bad = int(pages[(pages < 0) | (pages >= pool.num_pages)][0])
        _fail("page-range", f"page {bad} is not in 0..{pool.num_pages - 1}")
    holders = np.bincount(pages, minlength=pool.num_pages)
    refcounts = pool.refcounts()
    wrong = np.flatnonzero(holders != refcounts)
    if len(wrong):
        page = int(wrong[0])
        rule = "referenced-page-free" if refcounts[page] == 0 else "refcount-holders"
        _fail(rule, f"page {page}: refcount {refcounts[page]} but {holders[page]} holder(s)")

    free = pool.free_pages()
    if len(free) != pool.num_free:
        _fail("free-list-duplicate", f"free list has {pool.num_free} entries but {len(free)} distinct pages")
    zero = set(np.flatnonzero(refcounts == 0).tolist())
    if free != zero:
        page = min(free ^ zero)
        _fail("free-list-used", f"page {page}: in free list {page in free}, refcount {refcounts[page]}")
    if len(free) + pool.num_used != pool.num_pages:
        _fail("free-plus-used", f"{len(free)} free + {pool.num_used} used != {pool.num_pages} pages")
    cached = set(held[0].tolist()) if tree is not None else set()
    for i, seq in enumerate(sequences):
        if seq.num_tokens % size:
            page = int(list(seq.block_table)[seq.num_tokens // size])
            if refcounts[page] != 1 or page in cached:
                _fail("copy-on-write", f"sequence {i}: writes next into page {page}, which has "
                      f"refcount {refcounts[page]}{' and is cached' if page in cached else ''}")
    for page in released_pages:
        if refcounts[page] != 0:
            _fail("released-not-free", f"page {page}: released but refcount {refcounts[page]}")
    if tree is not None and tree.host is not None:
        _check_host_tier(tree)


def _check_window(i: int, table: np.ndarray, out_of_window: int, seq: SequenceView, size: int) -> None:
    """A sequence with `out_of_window` leading OUT_OF_WINDOW_PAGE entries (see check_invariants)."""
    if seq.window is None:
        _fail("window-out_of_window", f"sequence {i}: {out_of_window} out_of_window pages but no sliding window")
    if (table[out_of_window:] == OUT_OF_WINDOW_PAGE).any():
        _fail("window-out_of_window", f"sequence {i}: a out_of_window page after a held one: {table.tolist()}")
    expected = max(0, seq.num_tokens - seq.window + 1) // size
    if out_of_window != expected:
        _fail("window-out_of_window", f"sequence {i}: {out_of_window} pages out_of_window, but {expected} lie wholly "
              f"before the window of {seq.window} ending at position {seq.num_tokens}")


def _check_tree(tree: RadixTree, size: int) -> np.ndarray:
    """Checks the tree's shape and counters; returns its pages."""
    cached: list[int] = []
    num_cached = num_locked = num_nodes = 0
    queued = {id(node) for node in tree.queued_nodes()}
    for node, pages in tree.nodes():
        where = f"node with pages {pages[:8]}{'...' if len(pages) > 8 else ''}"
        _check_links(node, size, where)
        child_locks = sum(child.lock_ref for child in node.children.values())
        if node.lock_ref < child_locks or node.lock_ref < 0:
            _fail("lock-ref", f"{where}: lock_ref {node.lock_ref} < children's {child_locks}")
        if node.is_root:
            if pages or node.parent is not None:
                _fail("root", f"namespace {node.namespace!r}: root has pages or a parent")
            continue
        num_nodes += 1
        num_cached += len(pages)
        num_locked += len(pages) if node.lock_ref else 0
        cached += pages
        if pages and not node.device_children and not node.lock_ref and id(node) not in queued:
            _fail("eviction-queue", f"{where}: unlocked leaf is not queued for eviction")
    all_pages = np.asarray(cached, dtype=np.int64)
    unique, counts = np.unique(all_pages, return_counts=True)
    if (counts > 1).any():
        _fail("page-cached-twice", f"page {int(unique[counts > 1][0])} is cached in two places")
    recount = {"cached_pages": num_cached, "locked_pages": num_locked,
               "evictable_pages": num_cached - num_locked}
    for name, value in recount.items():
        if getattr(tree, name) != value:
            _fail("counter", f"tree.{name} = {getattr(tree, name)}, recount {value}")
    if tree.stats()["nodes"] != num_nodes:
        _fail("counter", f"tree node count {tree.stats()['nodes']}, recount {num_nodes}")
    return all_pages


def _check_links(node: RadixNode, size: int, where: str) -> None:
    for key, child in node.children.items():
        if child.parent is not node or child.key != key:
            _fail("dangling-node", f"{where}: child under key {key[:16]!r} does not link back")
        if child.namespace != node.namespace:
            _fail("namespace", f"{where}: child in namespace {child.namespace!r}, parent {node.namespace!r}")
    if node.sorted_keys is not None and node.sorted_keys != sorted(node.children):
        _fail("sorted-keys", f"{where}: sorted child keys differ from the children")
    if node.is_root:
        return
    if node.partial or len(node.tokens) < size:
        _check_partial_leaf(node, size, where)
        return
    num_pages = len(node.tokens) // size  # device pages: all of them, or none (on the host only)
    if num_pages == 0 or len(node.tokens) % size or len(node.pages) not in (0, num_pages):
        _fail("edge-length", f"{where}: {len(node.tokens)} tokens for {len(node.pages)} pages of {size}")
    if node.key != node.tokens[:size].tobytes():
        _fail("child-key", f"{where}: key is not its first page's tokens")
    kept = node.retention
    if kept is not None and not (len(kept.priority) == len(kept.expiry) == len(kept.floor) == len(kept.boosted)
                                   == num_pages):
        _fail("retention-arrays", f"{where}: retention arrays do not match {num_pages} pages")


def _check_partial_leaf(node: RadixNode, size: int, where: str) -> None:
    """A node with fewer than `size` tokens: a well-formed partial leaf (see check_invariants)."""
    if not node.partial:
        _fail("partial-leaf", f"{where}: {len(node.tokens)} tokens (< page size {size}) but not a partial leaf")
    if not 0 < len(node.tokens) < size or len(node.pages) != 1:
        _fail("partial-leaf", f"{where}: a partial leaf with {len(node.tokens)} tokens in {len(node.pages)} "
              f"device pages (page size {size})")
    if node.children or node.host is not None or node.lock_ref:
        _fail("partial-leaf", f"{where}: a partial leaf with {len(node.children)} children, host pages "
              f"{node.host}, lock_ref {node.lock_ref}")
    if node.key != node.tokens.tobytes():
        _fail("child-key", f"{where}: a partial leaf's key is not its tokens")
    kept = node.retention
    if kept is not None and not (len(kept.priority) == len(kept.expiry) == len(kept.floor) == len(kept.boosted)
                                   == 1):
        _fail("retention-arrays", f"{where}: retention arrays of a partial leaf do not have one page")
    keys = node.parent.sorted_keys  # checked against the children already: keys extending it follow it
    after = bisect_right(keys, node.key)
    if after < len(keys) and keys[after].startswith(node.key):
        _fail("partial-leaf-prefix", f"{where}: its tokens begin a sibling's key too")


def _check_host_tier(tree: RadixTree) -> None:
    """The host tier: every page lives on some tier, uniformly per node; device pages are
    prefix-closed (a node on the device has its parent on the device); each node's count of
    children on the device is right; the host pool's refcounts equal the tree's host pages
    (one holder each), its free list is exactly the pages with refcount 0; the tree's host
    counters equal a recount; every unlocked host-only leaf is queued for host eviction; every
    node on both tiers is tracked, so that its host copy can be freed for room."""
    host_pool = tree.host.pool
    size = tree.page_size
    held: list[int] = []
    host_only = 0
    queued = {id(node) for node in tree.host_queued_nodes()}
    tracked = {id(node) for node in tree.host_copy_nodes()}
    for node, pages in tree.nodes():
        if node.is_root:
            continue
        where = f"node with pages {pages[:8]}, host {(node.host or [])[:8]}"
        num_pages = len(node.tokens) // size
        if node.host is not None and len(node.host) != num_pages:
            _fail("host-edge-length", f"{where}: {len(node.host)} host pages for {num_pages} pages")
        if not pages and node.host is None:
            _fail("tier-missing", f"{where}: cached on no tier")
        if pages and not node.parent.is_root and not node.parent.pages:
            _fail("device-prefix-closed", f"{where}: on the device below a node on the host only")
        on_device = sum(1 for child in node.children.values() if child.pages)
        if node.device_children != on_device:
            _fail("device-children", f"{where}: counts {node.device_children} children on the device, "
                  f"recount {on_device}")
        if node.host is not None:
            held += node.host
            if not pages:
                host_only += num_pages
            elif id(node) not in tracked:
                _fail("host-copy-tracked", f"{where}: on both tiers but not tracked for freeing its host copy")
        if not pages and node.loading is not None:
            _fail("loading-host-only", f"{where}: a load in flight into a node with no device pages")
        if not pages and not node.children and not node.lock_ref and id(node) not in queued:
            _fail("host-eviction-queue", f"{where}: unlocked host-only leaf is not queued for host eviction")
    pages = np.asarray(held, dtype=np.int64)
    if len(pages) and (pages.min() < 0 or pages.max() >= host_pool.num_pages):
        _fail("host-page-range", f"host page {int(pages[(pages < 0) | (pages >= host_pool.num_pages)][0])} "
              f"is not in 0..{host_pool.num_pages - 1}")
    holders = np.bincount(pages, minlength=host_pool.num_pages)
    refcounts = host_pool.refcounts()
    wrong = np.flatnonzero(holders != refcounts)
    if len(wrong):
        page = int(wrong[0])
        rule = "host-page-cached-twice" if holders[page] > 1 else "host-refcount-holders"
        _fail(rule, f"host page {page}: refcount {refcounts[page]} but {holders[page]} holder(s)")
    free = host_pool.free_pages()
    zero = set(np.flatnonzero(refcounts == 0).tolist())
    if len(free) != host_pool.num_free or free != zero:
        _fail("host-free-list", f"host free list ({host_pool.num_free} entries) is not the pages with refcount 0")
    for name, value in (("host_cached_pages", len(held)), ("host_only_pages", host_only)):
        if getattr(tree, name) != value:
            _fail("counter", f"tree.{name} = {getattr(tree, name)}, recount {value}")
