"""Walking the radix tree down a query: comparing edges, the best partial page, what a match
collects on its way and the pages an insert was given (radix.py's `match` and `insert` drive
the walk; this module only compares and accumulates)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

import numpy as np

from radixserve.cache.node import MatchResult, RadixNode
from radixserve.cache.pool import as_int64
from radixserve.cache.transfer import LoadHandle


def as_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a 1-D int64 array (no copy when they already are one)."""
    arr = as_int64(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence, got shape {arr.shape}")
    return arr


def common_length(edge: np.ndarray, query: np.ndarray) -> int:
    """Length of the common prefix of `edge` and a non-empty `query` no longer than it."""
    differs = edge[: len(query)] != query
    first = int(differs.argmax())
    return first if differs[first] else len(query)


def shared_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two non-empty token arrays of any lengths (a partial
    leaf's edge may be shorter than the query page it is compared with)."""
    n = min(len(a), len(b))
    return common_length(a[:n], b[:n])


def best_partial(node: RadixNode, query: np.ndarray) -> tuple[RadixNode | None, int]:
    """The device child of `node` whose first page shares the longest (< page_size) prefix
    with `query` (a full child or a partial leaf), and that prefix's length; (None, 0) when
    none does."""
    keys = node.sorted_keys
    if not keys or not len(query):
        return None, 0
    i = bisect_left(keys, query.tobytes())
    best, best_common = None, 0
    # In sorted order the common prefix with `query` only shrinks away from the insertion
    # point (keys of any lengths: lexicographic order keeps that property), so on each side
    # the first child on the device is that side's best; children on the host only (whose
    # pages would have to be loaded to be copied) are passed over.
    for j, step in ((i - 1, -1), (i, 1)):
        while 0 <= j < len(keys):
            child = node.children[keys[j]]
            common = shared_length(child.tokens, query)
            if common <= best_common:
                break
            if child.pages:
                best, best_common = child, common
                break
            j += step
    return best, best_common


def partial_prefix_of(node: RadixNode, key: bytes) -> RadixNode | None:
    """The partial leaf below `node` whose tokens are a prefix of `key` (the bytes of a page
    or of a shorter run of tokens), if any: with no partial leaf a prefix of a sibling's key
    there is at most one, and it sorts just before `key`."""
    keys = node.sorted_keys
    if not keys:
        return None
    i = bisect_left(keys, key)
    if i and key.startswith(keys[i - 1]) and keys[i - 1] != key:
        child = node.children[keys[i - 1]]
        return child if child.partial else None
    return None


def key_extending(node: RadixNode, key: bytes) -> RadixNode | None:
    """A child of `node` whose key starts with `key` (equal included), if any: such keys sort
    from `key`'s insertion point on."""
    keys = node.sorted_keys
    if not keys:
        return None
    i = bisect_left(keys, key)
    return node.children[keys[i]] if i < len(keys) and keys[i].startswith(key) else None


def along(node: RadixNode | None, tokens: np.ndarray, page_size: int) -> Iterator[tuple[RadixNode, int]]:
    """The nodes below `node` whose edges the page-aligned `tokens` run through, each with how
    many of its pages they cover; the last one may be covered in part."""
    pos = 0
    while node is not None and pos < len(tokens):
        child = node.children.get(tokens[pos:pos + page_size].tobytes())
        if child is None:
            return
        full = common_length(child.tokens, tokens[pos:pos + min(len(child.tokens), len(tokens) - pos)]) // page_size
        yield child, full
        if full < len(child.tokens) // page_size:
            return
        node, pos = child, pos + full * page_size


class MatchWalk:
    """What a match has collected so far: the device pages (and the nodes' arrays of them),
    the deepest device node, the host-only continuation and the unfinished loads."""

    def __init__(self, root: RadixNode) -> None:
        self.node = root                   # the deepest device node taken whole
        self.pages: list[int] = []
        self.chunks: list[np.ndarray] = []  # the same pages as the nodes' arrays
        self.host_pages: list[int] = []
        self.host_node: RadixNode | None = None  # the deepest host-only node taken whole
        self.loads: list[LoadHandle] = []

    def take(self, child: RadixNode, head: int | None = None) -> None:
        """Adds `child`'s pages on its tier: all of them (`head` None: the node is now the
        deepest one matched), or only the first `head` (a peek ending inside the edge)."""
        if child.pages:
            if head is None:
                self.pages += child.pages
                self.chunks.append(child.page_array)
                self.node = child
            else:
                self.pages += child.pages[:head]
                self.chunks.append(child.page_array[:head])
            load = child.unfinished_load()
            if load is not None:
                self.loads.append(load)
        elif head is None:
            self.host_pages += child.host
            self.host_node = child
        else:
            self.host_pages += child.host[:head]

    def result(self, page_size: int, partial_page: int | None, partial_tokens: int,
               partial_load: LoadHandle | None = None) -> MatchResult:
        """The match these pages make, with the partial page found after them (and the
        unfinished load into it, if any)."""
        host_node = self.host_node
        if self.host_pages and host_node is None:  # a peek that ended inside the first host edge
            host_node = self.node
        return MatchResult(len(self.pages) * page_size + partial_tokens, self.pages, self.node, partial_page,
                           partial_tokens, self.host_pages, host_node if self.host_pages else None,
                           len(self.host_pages) * page_size, self.loads, self.chunks, partial_load)


class GivenPages:
    """The pages handed to an insert, as a list or an int64 array: an array is converted to
    Python ints only where the tree adopts pages."""

    def __init__(self, pages: Sequence[int] | np.ndarray, num_full: int) -> None:
        self.array = as_int64(pages[:num_full]) if isinstance(pages, np.ndarray) else None
        self.list = list(pages[:num_full]) if self.array is None else None
        if len(pages[:num_full]) < num_full:
            raise ValueError(f"insert: {num_full} full pages of tokens but only {len(pages)} pages")

    def leaf(self, first: int, end: int) -> tuple[list[int], np.ndarray | None]:
        """The pages `first:end`, for a new leaf (as a list, and an array if given one)."""
        if self.array is None:
            return self.list[first:end], None
        array = self.array[first:end].copy()
        return array.tolist(), array

    def span(self, first: int, count: int) -> list[int]:
        """`count` pages from `first` on, as a list."""
        if self.array is None:
            return self.list[first:first + count]
        return self.array[first:first + count].tolist()

    def duplicates(self, first: int, node: RadixNode) -> list[int]:
        """The given pages from `first` on that differ from `node`'s device pages (the tree
        already holds those tokens elsewhere)."""
        if self.array is None:
            given = self.list[first:first + len(node.pages)]
            if given == node.pages:  # C-speed compare; the loop runs only on duplicates
                return []
            return [g for g, c in zip(given, node.pages) if g != c]
        given_array = self.array[first:first + len(node.pages)]
        differs = given_array != node.page_array
        return given_array[differs].tolist() if differs.any() else []


def retention_path(root: RadixNode | None, tokens: np.ndarray, page_size: int) -> Iterator[tuple[RadixNode, int]]:
    """The nodes whose pages hold `tokens` from `root` on, each with how many of its first
    pages do (for `RadixTree.end_retention`). Tokens past the last full page name the page
    holding them too (a partial leaf, or the full page that superseded it): a partial leaf
    left raised would keep every page above it from eviction."""
    end = len(tokens) // page_size * page_size
    last: RadixNode | None = None
    full = covered = 0
    for last, full in along(root, tokens[:end], page_size):
        yield last, full
        covered += full
    rest = tokens[end:]
    if not len(rest) or root is None or covered * page_size != end:
        return
    if last is None or full == last.num_pages(page_size):  # the rest starts a child's page
        holder = key_extending(root if last is None else last, rest.tobytes())
        if holder is not None and holder.pages:
            yield holder, 1
    elif (last.tokens[full * page_size:full * page_size + len(rest)] == rest).all():  # inside the edge
        yield last, full + 1
