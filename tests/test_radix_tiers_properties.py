"""Stateful property test: the two-tier tree (device + host) against a brute-force model.

The model keeps every cached page under the full token prefix it ends, with its device page
(or None), whether it has a host copy, its recency tick, hit count and retention, and
applies the rules of radix.py page by page with full scans:

- match reads device pages, then the pages that continue them on the host only; it touches
  all of them; under write-through-selective it copies matched device pages hit twice to free
  host pages;
- device eviction takes the device page with no child on the device that sorts first
  (priority, then recency), page by page; the pages one call takes off the device (S) then
  go to host if they have a host copy already, or if they and every page above them in S
  reach the offload floor (the others are dropped with everything below them); host room
  comes from free pages, then from host copies of pages on the device (the most recently
  used first, as many as needed: the tree's choice, checked), then from evicting host-only
  leaves outside S, then from S itself;
- load-back copies the host continuation into free device pages; insert over a host-only
  page makes the inserted page its device copy; under `exclusive` both free the host copy;
  flush keeps only locked pages, on the device;
- a partial page (a finished request's last, partly filled one) lives on the device only:
  device eviction drops it, it is never offloaded nor named in events.

After every step the tree must hold exactly the model's pages on each tier, pass
`check_invariants` (host tier included), evict device pages in the model's order, and an
indexer fed only by the tree's events must hold each tier's page hashes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from radixserve.cache.events import DEVICE, HOST, AllCleared, BlockRemoved, BlockStored, CacheEvent, CacheEventHub
from radixserve.cache.invariants import SequenceView, check_invariants
from radixserve.cache.pool import PagePool
from radixserve.cache.radix import DEFAULT_PRIORITY, RadixTree, Retention
from radixserve.cache.tiers import WRITE_POLICIES, HostTier
from radixserve.cache.transfer import PageCopier
from tests.test_radix_properties import RETENTIONS, SETTINGS, Live, ReferenceCache, TreeMachine, page_keys

Key = tuple  # (namespace, token, token, ...)
WRITE_THROUGH_HITS = 2


@dataclass
class Page:
    page: int | None  # the device page; None: on the host only
    host: bool
    tick: int
    priority: int = DEFAULT_PRIORITY
    expiry: float = math.inf
    floor: int = DEFAULT_PRIORITY
    hits: int = 0


class TieredModel(ReferenceCache):
    """The brute-force two-tier cache (the single-tier reference's keys, locks, retention and
    hashes; its own pages, eviction and matching)."""

    def __init__(self, page_size: int, policy: str, host_pages: int, floor: int, write_policy: str) -> None:
        super().__init__(page_size, policy)
        self.host_pages = host_pages
        self.floor = floor
        self.write_through = write_policy == "write-through-selective"
        self.exclusive = write_policy == "exclusive"
        self.pages: dict[Key, Page] = {}

    # ---------------------------------------------------------------- helpers
    def below(self, key: Key) -> list[Key]:
        """Every cached key that extends `key` (its subtree, without itself)."""
        return [k for k in self.pages if len(k) > len(key) and k[: len(key)] == key]

    def has_child(self, key: Key, on_device: bool = False) -> bool:
        return any(self.parent_of(k) == key and len(k) > len(key)
                   and (not on_device or p.page is not None) for k, p in self.pages.items())

    def effective(self, page: Page, now: float) -> int:
        return page.priority if page.expiry > now else page.floor

    def order(self, key: Key, now: float) -> tuple:
        page = self.pages[key]
        return (self.effective(page, now), page.tick) if self.policy == "priority" else (page.tick,)

    def first(self, candidates: list[Key], now: float) -> Key:
        candidates.sort(key=lambda k: self.order(k, now))
        assert len(candidates) < 2 or self.order(candidates[0], now) != self.order(candidates[1], now), \
            "model order is ambiguous"
        return candidates[0]

    def host_used(self) -> int:
        return sum(p.host for p in self.pages.values())

    # ---------------------------------------------------------------- host
    def evict_host(self, n: int, now: float, locks: list[Key], shielded: set[Key]) -> int:
        """Takes up to n pages off the host (host-only leaves, unlocked, outside `shielded`)."""
        done = 0
        while done < n:
            candidates = [k for k, p in self.pages.items() if p.page is None and not self.has_child(k)
                          and not self._locked(k, locks) and k not in shielded]
            if not candidates:
                break
            del self.pages[self.first(candidates, now)]
            done += 1
        return done

    def host_room(self, n: int) -> bool:
        """Whether n more host pages are free (write-through takes free pages only)."""
        return self.host_used() + n <= self.host_pages

    def free_copies(self, short: int, tree_host: set[Key]) -> int:
        """Frees host copies of pages on the device for `short` host pages, as the tree chose
        (its host keys after the call: `tree_host`); returns how many. The choice is checked,
        not recomputed (the tree frees whole nodes, which the model does not keep): only
        copies, every one where `short` asks for that many, else at least `short`, the most
        recently used first, and past `short` at most the pages of the last recency freed
        (one node's, or a path's touched together)."""
        copies = [k for k, p in self.pages.items() if p.page is not None and p.host]
        freed = [k for k in copies if k not in tree_host]
        if short >= len(copies):
            assert len(freed) == len(copies), "a host copy kept while host-only pages had to go"
        else:
            kept_ticks = [self.pages[k].tick for k in copies if k in tree_host]
            freed_ticks = [self.pages[k].tick for k in freed]
            assert len(freed) >= short, "host copies freed short of the room needed"
            assert not kept_ticks or min(freed_ticks) >= max(kept_ticks), "a copy freed before a more recent one"
            assert sum(t != min(freed_ticks) for t in freed_ticks) < short, "more host copies freed than needed"
        for key in freed:
            self.pages[key].host = False
        return len(freed)

    # ---------------------------------------------------------------- operations
    def match(self, namespace, tokens, touch: bool, now: float, locks: list[Key]):
        """(device pages, host-only keys, the best partial candidates on the device, their
        shared length)."""
        if touch:
            self.tick += 1
        matched: list[Key] = []
        for key in self._keys(namespace, tokens, len(tokens) // self.size):
            if key not in self.pages:
                break
            matched.append(key)
        on_device = [k for k in matched if self.pages[k].page is not None]
        host_keys = matched[len(on_device):]
        assert all(self.pages[k].page is None for k in host_keys), "model: device pages not prefix-closed"
        if touch:
            for key in matched:
                self.pages[key].tick = self.tick
                self.pages[key].hits += 1
        start = len(matched) * self.size
        best, device_best = 0, set()
        if not host_keys:
            rest = tuple(tokens[start:start + self.size])
            for key, page in self.pages.items():
                # (pages on the host only are passed over: a partial match copies a device page)
                if page.page is not None and self.parent_of(key) == (namespace, *tokens[:start]) \
                        and len(key) - 1 > start:
                    tail = key[start + 1:]
                    common = next((i for i, (a, b) in enumerate(zip(tail, rest)) if a != b), min(len(tail), len(rest)))
                    if common > best:
                        best, device_best = common, set()
                    if common == best and common:
                        device_best.add(page.page)
        if touch and self.write_through:
            for key in on_device:
                page = self.pages[key]
                if not page.host and page.hits >= WRITE_THROUGH_HITS:
                    if not self.host_room(1):
                        break
                    page.host = True
        return [self.pages[k].page for k in on_device], host_keys, device_best, best

    def insert(self, namespace, tokens, pages, retention, ranges, now, partial: bool = False) -> list[int]:
        self.tick += 1
        duplicates = []
        retention = retention or Retention()
        for i, key in enumerate(self.insert_keys(namespace, tokens, partial)):
            if self.is_partial(key) and self.held_elsewhere(key, pages[i], duplicates):
                continue
            page = self.pages.get(key)
            if page is None:
                self._drop_partial_prefix_of(key)
                page = self.pages[key] = Page(pages[i], False, self.tick, retention.priority,
                                              now + retention.duration_s if retention.duration_s else math.inf,
                                              DEFAULT_PRIORITY if retention.duration_s else retention.priority)
            else:
                if page.page is None:
                    page.page = pages[i]
                    page.host = page.host and not self.exclusive
                elif page.page != pages[i]:
                    duplicates.append(pages[i])
                page.tick = self.tick
                self._raise(page, retention, now)
            for start, end, r in ranges:
                if start < (i + 1) * self.size and end > i * self.size:
                    self._raise(page, r, now)
        return duplicates

    def drop(self, key: Key) -> None:
        for k in [key, *self.below(key)]:
            self.pages.pop(k, None)

    def evict(self, n: int, now: float, locks: list[Key], held: set[int],
              tree_host: set[Key]) -> tuple[int, list[Key]]:
        """Device pages freed in the pool, and the keys S taken off the device, in order (the
        tree's host keys after its call, `tree_host`, tell which host copies it freed)."""
        freed = 0
        taken: list[Key] = []
        while freed < n:
            leaves = [k for k, p in self.pages.items() if p.page is not None
                      and not self.has_child(k, on_device=True) and not self._locked(k, locks)]
            if not leaves:
                break
            key = self.first(leaves, now)
            page = self.pages[key]
            freed += page.page not in held
            taken.append(key)
            if self.is_partial(key):  # device only: dropped, never offloaded
                del self.pages[key]
                continue
            page.page = None
        taken_full = [k for k in taken if not self.is_partial(k)]
        for key in sorted(taken_full, key=len):  # top down: a dropped page takes everything below
            page = self.pages.get(key)
            if page is not None and not page.host and self.effective(page, now) < self.floor:
                self.drop(key)
        going = [k for k in taken_full if k in self.pages and not self.pages[k].host]
        short = len(going) - (self.host_pages - self.host_used())
        if short > 0:
            short -= self.free_copies(short, tree_host)
        if short > 0:
            short -= self.evict_host(short, now, locks, set(taken))
        if short > 0:
            self.evict_host(short, now, locks, set())
        for key in going:
            if key in self.pages:
                self.pages[key].host = True
        return freed, taken

    def load(self, keys: list[Key], pages: list[int]) -> None:
        for key, page in zip(keys, pages):
            assert self.pages[key].page is None
            self.pages[key].page = page
            self.pages[key].host = not self.exclusive

    def reset(self, locks: list[Key]) -> None:
        self.pages = {k: p for k, p in self.pages.items() if self._locked(k, locks)}
        for page in self.pages.values():
            if page.page is not None:
                page.host = False



class TieredTreeMachine(TreeMachine):
    """The single-tier machine's rules (serve, finish, abort, evict, lookup, clock) over a
    tree with a host tier; admission loads host continuations back (or recomputes them)."""

    num_pages = 16

    @initialize(policy=st.sampled_from(["priority", "lru"]), host_pages=st.sampled_from([3, 8, 20]),
                floor=st.sampled_from([0, DEFAULT_PRIORITY, 50]), write_policy=st.sampled_from(WRITE_POLICIES),
                data=st.data())
    def setup(self, policy: str, host_pages: int, floor: int, write_policy: str, data) -> None:
        self.pool = PagePool(self.num_pages, self.page_size)
        host_pool = PagePool(host_pages, self.page_size)
        tier = HostTier(host_pool, PageCopier(self.pool, host_pool),
                        write_policy=write_policy,
                        offload_min_priority=floor, write_through_hits=WRITE_THROUGH_HITS)
        self.indexed = {DEVICE: set(), HOST: set()}
        self.events: list[CacheEvent] = []
        hub = CacheEventHub(self.page_size)
        hub.subscribe(self.on_event)
        self.tree = RadixTree(self.pool, eviction_policy=policy, clock=lambda: self.now, events=hub, host=tier)
        self.ref = TieredModel(self.page_size, policy, host_pages, floor, write_policy)
        for _ in range(data.draw(st.integers(3, 8))):
            self.serve(data, data.draw(st.sampled_from([None, "b"])), data.draw(st.sampled_from(RETENTIONS)))

    def on_event(self, event: CacheEvent) -> None:
        self.events.append(event)
        assert not isinstance(event, (BlockStored, BlockRemoved)) or event.hashes, "an event naming no page"
        if isinstance(event, BlockStored):
            self.indexed[event.tier].update((event.namespace, h) for h in event.hashes)
        elif isinstance(event, BlockRemoved):
            self.indexed[event.tier].difference_update((event.namespace, h) for h in event.hashes)
        elif isinstance(event, AllCleared):
            for tier in ([event.tier] if event.tier else self.indexed):
                self.indexed[tier].clear()

    def _evict(self, n: int, locks: list[Key] | None = None) -> None:
        self.events.clear()
        freed = self.tree.evict(n)
        expect, keys = self.ref.evict(n, self.now, self._locks() if locks is None else locks, self._held(),
                                      self.tree_contents()[1])
        assert freed == expect
        order = [(e.namespace, h) for e in self.events
                 if isinstance(e, BlockRemoved) and e.tier == DEVICE for h in reversed(e.hashes)]
        assert order == [self.ref.hash_of(key) for key in keys if not self.ref.is_partial(key)], \
            "device pages evicted out of order"

    def _match(self, namespace, tokens, update: bool):
        m = self.tree.match(tokens, namespace, update=update)
        pages, host_keys, device_best, best = self.ref.match(namespace, tokens, update, self.now, self._locks())
        if update:
            self.ref.touch_partial(m.partial_page)
        assert m.pages == pages
        assert len(m.host_pages) == len(host_keys) and m.host_tokens == len(host_keys) * self.page_size
        if m.partial_tokens:
            assert m.partial_tokens == best and m.partial_page in device_best
        else:
            assert m.partial_page is None and best == 0
        assert m.num_tokens == len(pages) * self.page_size + m.partial_tokens
        self.host_keys = host_keys
        return m

    def _admit(self, data, namespace) -> bool:
        """Match (both tiers), lock, load the host continuation back or recompute it, take
        the rest (evicting)."""
        tokens = self.draw_tokens(data)
        m = self._match(namespace, tokens, update=True)
        handle = m.host_node or m.node
        self.tree.lock(handle)
        path_key = (namespace, *tokens[: (len(m.pages) + len(m.host_pages)) * self.page_size])
        if m.host_pages and data.draw(st.booleans(), label="load back (else recompute)"):
            short = len(m.host_pages) - self.pool.num_free
            if short > 0:
                self._evict(short, self._locks() + [path_key])
            loaded = self.tree.load_back(m)
            self.ref.load(self.host_keys, loaded.pages[len(m.pages):])
            self.tree.lock(loaded.node)
            self.tree.unlock(handle)
            m, handle = loaded, loaded.node
        elif m.host_pages:  # recompute the host part: lock only what is on the device
            self.tree.lock(m.node)
            self.tree.unlock(handle)
            handle = m.node
        self.pool.incref(m.pages)
        lock_key = (namespace, *tokens[: len(m.pages) * self.page_size])
        self.live.append(Live(namespace, tokens, list(m.pages), handle, lock_key))
        need = math.ceil(len(tokens) / self.page_size) - len(m.pages)
        if self.pool.num_free < need:
            self._evict(need - self.pool.num_free)
        if self.pool.num_free < need:
            self._release(self.live.pop())
            return False
        self.live[-1].table += self.pool.allocate(need)
        return True

    @rule()
    def flush(self) -> None:
        before = {p.page for p in self.ref.pages.values() if p.page is not None}
        host_before = self.ref.host_used()
        self.ref.reset(self._locks())
        dropped = before - {p.page for p in self.ref.pages.values()}
        freed = self.tree.reset()
        assert freed == len(dropped - self._held()) and freed.host == host_before - self.ref.host_used()
        assert self.tree.host.pool.num_free == self.tree.host.pool.num_pages - self.ref.host_used()

    def tree_contents(self) -> tuple[dict[Key, int], set[Key]]:
        device, host = {}, set()
        for node, key, i in page_keys(self.tree):
            if node.pages:
                device[key] = node.pages[i]
            if node.host is not None:
                host.add(key)
        return device, host

    @invariant()
    def check(self, released=()) -> None:
        if not hasattr(self, "tree"):
            return
        check_invariants(self.pool, self.tree, [SequenceView(s.table, len(s.tokens)) for s in self.live], released)
        device, host = self.tree_contents()
        assert device == {k: p.page for k, p in self.ref.pages.items() if p.page is not None}
        assert host == {k for k, p in self.ref.pages.items() if p.host}
        assert set(device) | host == set(self.ref.pages), "a cached page on no tier"
        for tier, keys in ((DEVICE, device), (HOST, host)):
            expected = {self.ref.hash_of(key) for key in keys if not self.ref.is_partial(key)}
            assert self.tree.cached_page_hashes(tier) == expected
            assert self.indexed[tier] == expected, f"the {tier} event indexer disagrees with the tree"


class TieredTreeMachinePage4(TieredTreeMachine):
    page_size = 4
    num_pages = 8
    max_len = 18


TestTieredTreePage1 = TieredTreeMachine.TestCase
TestTieredTreePage1.settings = SETTINGS
TestTieredTreePage4 = TieredTreeMachinePage4.TestCase
TestTieredTreePage4.settings = SETTINGS
