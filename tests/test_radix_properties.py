"""Stateful property test: the radix tree against a brute-force reference cache.

The reference keeps every cached page under the full token prefix it ends (namespace
included), with its recency tick and retention, and evicts by scanning every unlocked
leaf page. A finished request may cache its last, partly filled page too (a partial leaf:
its key is a prefix whose length is not a whole number of pages); partial pages are never
named in events. After every step the tree must hold exactly the reference's pages and pass
`check_invariants`; every eviction must take the reference's pages in the reference's order
(read from the tree's cache events); and an indexer fed only by those events must hold
exactly the tree's page hashes.
"""

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import numpy as np

from radixserve.cache.events import AllCleared, BlockRemoved, BlockStored, CacheEvent, CacheEventHub
from radixserve.cache.invariants import SequenceView, check_invariants
from radixserve.cache.page_hash import namespace_id, namespace_seed, page_hashes
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import DEFAULT_PRIORITY, RadixTree, Retention

Key = tuple  # (namespace, token, token, ...)
TURN_KINDS = st.sampled_from(["fresh", "again", "continued"])  # what draw_tokens draws
TURN_TAIL = st.lists(st.integers(0, 2), min_size=1, max_size=3)  # what a next turn adds


@functools.cache
def fresh_prompts(size: int, n: int) -> st.SearchStrategy[list[int]]:
    """A prefix of one of a few overlapping prompts, plus a short random tail: shared
    prefixes that diverge at any token, inside or at the edge of a page (pages of `size`,
    prompts of at most `n` tokens). Built once: hypothesis derives a strategy's properties
    anew each time one is built (building them at every draw made these machines take 67 s
    instead of 49 s)."""
    trunk = list(range(10, 10 + n))
    prompts = [trunk, trunk[: size + 1] + list(range(40, 40 + n)),
               trunk[: 2 * size + 2] + list(range(70, 70 + n)), list(range(100, 100 + n))]
    return st.builds(lambda p, k, tail: (p[:k] + tail)[:n], st.sampled_from(prompts),
                     st.integers(1, n), st.lists(st.integers(0, 2), max_size=3))


@functools.lru_cache(maxsize=1 << 16)
def page_event_name(key: Key, page_size: int) -> tuple[str, int]:
    """(namespace id, chained hash of the last full page) of the page cached under `key`,
    computed from scratch (not the tree's incremental chain). Memoised: the reference names
    the same pages after every step."""
    ns_id = namespace_id(key[0])
    tokens = np.asarray(key[1:], dtype=np.int64)
    return ns_id, int(page_hashes(tokens, page_size, namespace_seed(ns_id))[0][-1])


@dataclass
class RefPage:
    page: int
    tick: int
    priority: int = DEFAULT_PRIORITY
    expiry: float = math.inf
    floor: int = DEFAULT_PRIORITY  # what an expired priority falls back to


def page_keys(tree: RadixTree) -> Iterator[tuple[object, Key, int]]:
    """(node, the full prefix its i-th page ends, i) for every page of every node (a partial
    leaf's one page ends its whole path)."""
    for node, _ in tree.nodes():
        if node.is_root:
            continue
        path, up = [], node
        while not up.is_root:
            path[:0] = up.tokens.tolist()
            up = up.parent
        start = len(path) - len(node.tokens)
        if node.partial:
            yield node, (node.namespace, *path), 0
        for i in range(len(node.tokens) // tree.page_size):
            yield node, (node.namespace, *path[: start + (i + 1) * tree.page_size]), i


class ReferenceCache:
    """Brute force model: a dict from cached prefixes to pages, evicted by full scans."""

    def __init__(self, page_size: int, policy: str) -> None:
        self.size = page_size
        self.policy = policy
        self.pages: dict[Key, RefPage] = {}
        self.tick = 0

    def _keys(self, namespace, tokens, num_pages: int) -> list[Key]:
        return [(namespace, *tokens[: (i + 1) * self.size]) for i in range(num_pages)]

    def is_partial(self, key: Key) -> bool:
        return (len(key) - 1) % self.size != 0

    def parent_of(self, key: Key) -> Key:
        """The prefix of whole pages a page's key continues."""
        return key[: 1 + (len(key) - 2) // self.size * self.size]

    def touch_partial(self, page: int | None) -> None:
        """A counted match used a partial leaf's page: it is as recent as the match."""
        for key, info in self.pages.items():
            if info.page == page and self.is_partial(key):
                info.tick = self.tick

    def insert_keys(self, namespace, tokens, partial: bool) -> list[Key]:
        """The keys of the pages an insert caches: its full pages, then its partial one."""
        keys = self._keys(namespace, tokens, len(tokens) // self.size)
        if partial and len(tokens) % self.size:
            keys.append((namespace, *tokens))
        return keys

    def held_elsewhere(self, key: Key, page: int, duplicates: list[int]) -> bool:
        """Whether the tokens of the partial `key` are held from a page's start already (then
        that page is left as it is, and `page` is a duplicate unless it is that page)."""
        holder = self.holder_of_partial(key)
        if holder is not None and holder.page != page:
            duplicates.append(page)
        return holder is not None

    def holder_of_partial(self, key: Key):
        """The cached page (full, or a longer partial one) under the same parent whose tokens
        start with the partial `key`'s, if any."""
        return next((info for k, info in self.pages.items() if len(k) >= len(key) and k[: len(key)] == key
                     and self.parent_of(k) == self.parent_of(key)), None)

    def _drop_partial_prefix_of(self, key: Key) -> None:
        """Drops the partial page under `key`'s parent whose tokens `key`'s page starts with."""
        parent = self.parent_of(key)
        for other in [k for k in self.pages if self.is_partial(k) and len(parent) < len(k) < len(key)]:
            if self.parent_of(other) == parent and key[: len(other)] == other:
                del self.pages[other]

    def match(self, namespace, tokens, touch: bool) -> tuple[list[int], set[int], int]:
        """Full pages; the pages that could serve as the partial page; partial tokens."""
        if touch:
            self.tick += 1
        matched: list[Key] = []
        for key in self._keys(namespace, tokens, len(tokens) // self.size):
            if key not in self.pages:
                break
            matched.append(key)
        for key in matched if touch else ():
            self.pages[key].tick = self.tick
        start = len(matched) * self.size
        rest = tuple(tokens[start:start + self.size])
        best, candidates = 0, set()
        for key, info in self.pages.items():
            if self.parent_of(key) == (namespace, *tokens[:start]) and len(key) - 1 > start:
                tail = key[start + 1:]
                common = next((i for i, (a, b) in enumerate(zip(tail, rest)) if a != b), min(len(tail), len(rest)))
                if common > best:
                    best, candidates = common, {info.page}
                elif common == best and common:
                    candidates.add(info.page)
        return [self.pages[k].page for k in matched], candidates, best

    def _raise(self, info: RefPage, r: Retention, now: float) -> None:
        current = (info.priority, info.expiry) if info.expiry > now else (info.floor, math.inf)
        if not r.duration_s:
            info.floor = max(info.floor, r.priority)
        new = (r.priority, now + r.duration_s if r.duration_s else math.inf)
        info.priority, info.expiry = max(current, new)

    def insert(self, namespace, tokens, pages, retention, ranges, now, partial: bool = False) -> list[int]:
        self.tick += 1
        duplicates = []
        retention = retention or Retention()
        for i, key in enumerate(self.insert_keys(namespace, tokens, partial)):
            if self.is_partial(key) and self.held_elsewhere(key, pages[i], duplicates):
                continue
            if key in self.pages:
                info = self.pages[key]
                if info.page != pages[i]:
                    duplicates.append(pages[i])
                info.tick = self.tick
                self._raise(info, retention, now)
            else:
                self._drop_partial_prefix_of(key)
                info = self.pages[key] = RefPage(pages[i], self.tick, retention.priority,
                                                 now + retention.duration_s if retention.duration_s else math.inf,
                                                 DEFAULT_PRIORITY if retention.duration_s else retention.priority)
            for start, end, r in ranges:
                if start < (i + 1) * self.size and end > i * self.size:
                    self._raise(info, r, now)
        return duplicates

    def _locked(self, key: Key, locks: list[Key]) -> bool:
        if self.is_partial(key):  # nothing locks a partial page
            return False
        return any(len(lock) >= len(key) and lock[: len(key)] == key for lock in locks)

    def evict(self, n: int, now: float, locks: list[Key], held: set[int]) -> tuple[int, list[Key]]:
        """Pages freed in the pool, and the evicted keys in eviction order."""
        freed = 0
        evicted: list[Key] = []
        while freed < n:
            parents = {self.parent_of(key) for key in self.pages}
            leaves = [k for k in self.pages if k not in parents and not self._locked(k, locks)]
            if not leaves:
                break

            def order(key: Key) -> tuple:
                info = self.pages[key]
                priority = info.priority if info.expiry > now else info.floor
                return (priority, info.tick) if self.policy == "priority" else (info.tick,)

            leaves.sort(key=order)
            assert len(leaves) < 2 or order(leaves[0]) != order(leaves[1]), "reference order is ambiguous"
            page = self.pages.pop(leaves[0]).page
            evicted.append(leaves[0])
            freed += page not in held
        return freed, evicted

    def hash_of(self, key: Key) -> tuple[str, int]:
        """The cache-event name of the page cached under `key`."""
        return page_event_name(key, self.size)

    def reset(self, locks: list[Key]) -> None:
        self.pages = {k: v for k, v in self.pages.items() if self._locked(k, locks)}


@dataclass
class Live:
    namespace: object
    tokens: list[int]
    table: list[int]
    node: object
    lock_key: Key


RETENTIONS = [None, Retention(0), Retention(80), Retention(80, 5.0), Retention(10, 2.0), Retention(35, 4.0)]


class TreeMachine(RuleBasedStateMachine):
    page_size = 1
    num_pages = 24
    max_len = 10

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.live: list[Live] = []
        self.seen: list[list[int]] = []  # prompts so far: drawn again to hit whole leaves

    @initialize(policy=st.sampled_from(["priority", "lru"]), data=st.data())
    def setup(self, policy: str, data) -> None:
        self.pool = PagePool(self.num_pages, self.page_size)
        self.events: list[CacheEvent] = []
        self.indexed: set[tuple[str, int]] = set()  # what an indexer fed by the events holds
        hub = CacheEventHub(self.page_size)
        hub.subscribe(self.on_event)
        self.tree = RadixTree(self.pool, eviction_policy=policy, clock=lambda: self.now, events=hub)
        self.ref = ReferenceCache(self.page_size, policy)
        # Start warm: a few served requests, so most steps meet a populated tree.
        for _ in range(data.draw(st.integers(2, 6))):
            self.serve(data, data.draw(st.sampled_from([None, "b"])), data.draw(st.sampled_from(RETENTIONS)))

    def draw_tokens(self, data) -> list[int]:
        """Fresh tokens, or (once some were drawn) an earlier prompt again, or a conversation's
        next turn: an earlier prompt and a few more tokens (a longer partial page over a
        shorter one, or full pages over a partial one)."""
        kind = data.draw(TURN_KINDS, label="kind") if self.seen else "fresh"
        if kind == "fresh":
            tokens = data.draw(fresh_prompts(self.page_size, self.max_len))
        else:
            earlier = self.seen[data.draw(st.integers(0, len(self.seen) - 1), label="earlier")]
            tail = data.draw(TURN_TAIL) if kind == "continued" else []
            tokens = (earlier + tail)[: self.max_len]
        self.seen.append(tokens)
        return tokens

    # ------------------------------------------------------------ helpers
    def _locks(self) -> list[Key]:
        return [s.lock_key for s in self.live]

    def _held(self) -> set[int]:
        return {p for s in self.live for p in s.table}

    def on_event(self, event: CacheEvent) -> None:
        self.events.append(event)
        assert not isinstance(event, (BlockStored, BlockRemoved)) or event.hashes, "an event naming no page"
        if isinstance(event, BlockStored):
            self.indexed.update((event.namespace, h) for h in event.hashes)
        elif isinstance(event, BlockRemoved):
            self.indexed.difference_update((event.namespace, h) for h in event.hashes)
        elif isinstance(event, AllCleared):
            self.indexed.clear()

    def _evict(self, n: int) -> None:
        expect, keys = self.ref.evict(n, self.now, self._locks(), self._held())
        self.events.clear()
        assert self.tree.evict(n) == expect
        # Each removal event lists a leaf's tail in path order; eviction took it from the end.
        # Partial pages are never named in events; which ones went is checked by contents.
        order = [(e.namespace, h) for e in self.events if isinstance(e, BlockRemoved) for h in reversed(e.hashes)]
        assert order == [self.ref.hash_of(key) for key in keys if not self.ref.is_partial(key)], \
            "pages evicted out of order"

    def _match(self, namespace, tokens, update: bool):
        m = self.tree.match(tokens, namespace, update=update)
        pages, candidates, partial = self.ref.match(namespace, tokens, touch=update)
        if update:
            self.ref.touch_partial(m.partial_page)
        assert m.pages == pages
        assert m.partial_tokens == partial
        assert (m.partial_page is None) if not partial else (m.partial_page in candidates)
        assert m.num_tokens == len(pages) * self.page_size + partial
        return m

    # ------------------------------------------------------------ rules
    @rule(data=st.data(), namespace=st.sampled_from([None, "b"]))
    def admit(self, data, namespace) -> None:
        """A request arrives: match, lock, take the pages, allocate the rest (evicting)."""
        self._admit(data, namespace)

    def _admit(self, data, namespace) -> bool:
        tokens = self.draw_tokens(data)
        m = self._match(namespace, tokens, update=True)
        self.tree.lock(m.node)
        self.pool.incref(m.pages)
        lock_key = (namespace, *tokens[: len(m.pages) * self.page_size])
        need = math.ceil(len(tokens) / self.page_size) - len(m.pages)
        self.live.append(Live(namespace, tokens, list(m.pages), m.node, lock_key))
        if self.pool.num_free < need:
            self._evict(need - self.pool.num_free)
        if self.pool.num_free < need:
            self._release(self.live.pop())
            return False
        self.live[-1].table += self.pool.allocate(need)
        return True

    def _release(self, seq: Live) -> None:
        self.tree.unlock(seq.node)
        self.pool.decref(seq.table)
        cached = {info.page for info in self.ref.pages.values()}
        released = set(seq.table) - cached - self._held()
        self.check(released)

    @rule(data=st.data(), namespace=st.sampled_from([None, "b"]), retention=st.sampled_from(RETENTIONS))
    def serve(self, data, namespace, retention) -> None:
        """A request arrives and finishes before anything else happens."""
        if self._admit(data, namespace):
            self._finish(self.live.pop(), retention, data.draw(st.booleans()), data.draw(st.booleans()))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), retention=st.sampled_from(RETENTIONS), ranged=st.booleans(), partial=st.booleans())
    def finish(self, data, retention, ranged, partial) -> None:
        """A request finishes: its full pages go to the tree (with `partial`, its last, partly
        filled page too), then it lets go."""
        self._finish(self.live.pop(data.draw(st.integers(0, len(self.live) - 1))), retention, ranged, partial)

    def _finish(self, seq: Live, retention: Retention | None, ranged: bool, partial: bool = False) -> None:
        ranges = [(0, self.page_size + 1, Retention(90, 3.0))] if ranged else []
        dups = self.tree.insert(seq.tokens, seq.table, seq.namespace, retention, ranges, partial=partial)
        assert dups == self.ref.insert(seq.namespace, seq.tokens, seq.table, retention, ranges, self.now, partial)
        self._release(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data) -> None:
        self._release(self.live.pop(data.draw(st.integers(0, len(self.live) - 1))))

    @rule(n=st.integers(1, 6))
    def evict(self, n) -> None:
        self._evict(n)

    @rule(data=st.data(), namespace=st.sampled_from([None, "b"]), update=st.booleans())
    def lookup(self, data, namespace, update) -> None:
        self._match(namespace, self.draw_tokens(data), update)

    @rule(dt=st.sampled_from([0.5, 2.0, 6.0]))
    def advance_clock(self, dt) -> None:
        self.now += dt

    @rule()
    def flush(self) -> None:
        before = {info.page for info in self.ref.pages.values()}
        self.ref.reset(self._locks())
        dropped = before - {info.page for info in self.ref.pages.values()}
        assert self.tree.reset() == len(dropped - self._held())

    # ------------------------------------------------------------ checks
    def tree_contents(self) -> dict[Key, int]:
        return {key: node.pages[i] for node, key, i in page_keys(self.tree)}

    @invariant()
    def check(self, released=()) -> None:
        if not hasattr(self, "tree"):
            return
        check_invariants(self.pool, self.tree,
                         [SequenceView(s.table, len(s.tokens)) for s in self.live], released)
        assert self.tree_contents() == {k: v.page for k, v in self.ref.pages.items()}
        expected = {self.ref.hash_of(key) for key in self.ref.pages if not self.ref.is_partial(key)}
        assert self.tree.cached_page_hashes() == expected
        assert self.indexed == expected, "the event indexer disagrees with the tree"


class TreeMachinePage4(TreeMachine):
    page_size = 4
    num_pages = 9
    max_len = 18


SETTINGS = settings(max_examples=100, stateful_step_count=40, derandomize=True, database=None,
                    deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestTreePage1 = TreeMachine.TestCase
TestTreePage1.settings = SETTINGS
TestTreePage4 = TreeMachinePage4.TestCase
TestTreePage4.settings = SETTINGS
