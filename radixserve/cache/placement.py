"""The host tier at work: how the radix tree's pages move between the device and the host.

`HostPlacement` owns everything of the host tier that changes while the cache runs: the host
pool's pages held for the tree, the host eviction queue, the counters (host pages held, pages
on the host only), the shielding of the pages one device eviction takes, and the placement
operations — offload on device eviction (`leave_device`, `end_eviction`), host eviction,
load-back, write-through, adopting a caller's pages over host-only ones, and fencing
unfinished loads (`fence`). What may move is the rule of its `HostTier` (tiers.py:
`offloads`, `writes_through`); the data moves through the tier's `KVCopier` (transfer.py).

The seam. The tree (radix.py) holds one `HostPlacement` (None without a host tier) and calls
it where pages change tier: device eviction (`begin_eviction`, `leave_device` for each run
the device queue hands out, `end_eviction`), `load_back`, `write_through` after a match,
`adopt` when insert covers host-only pages, `release` when it drops nodes, `reset` on a
flush, `requeue` / `schedule_expiries` to keep the host queue current, and `track` for the
upper part of a split (which may hold a page on both tiers). The host tier in
turn works on the tree only through `TreeOps`, the operations the tree hands it at
construction (split a node, drop or detach one, tidy a parent, requeue, the eviction order,
put pages on or take them off the device: the `DeviceTier`'s moves). It reads
and writes nodes (node.py) but never the tree's own fields.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from radixserve.cache.event_reporter import TreeEventReporter
from radixserve.cache.events import HOST
from radixserve.cache.eviction import EvictionOrder, EvictionQueue
from radixserve.cache.node import MatchResult, RadixNode
from radixserve.cache.pool import PagePool
from radixserve.cache.stats import CacheStats
from radixserve.cache.tiers import HostTier


@dataclass(frozen=True)
class TreeOps:
    """What the host tier may ask of the tree (the tree's own operations, handed in)."""

    pool: PagePool                                    # the device pool
    page_size: int
    order: EvictionOrder                              # keys and priorities (both tiers' order)
    num_nodes: Callable[[], int]                      # nodes in the tree (bounds the queue)
    split: Callable[[RadixNode, int], RadixNode]      # cut after n pages; returns the upper node
    drop: Callable[[RadixNode], int]                  # remove a subtree (reported); device pages freed
    detach: Callable[[RadixNode, float], None]        # remove an emptied leaf
    after_removal: Callable[[RadixNode, float], None]  # a child of this node left the tree
    requeue: Callable[[RadixNode, float], None]       # queue a node where it is a candidate
    gain_device: Callable[[RadixNode, list[int]], None]  # a host-only node's device pages arrived
    lose_device: Callable[[RadixNode], int]           # free a node's device pages; pages freed


class EvictionCall:
    """One device eviction under way: its number (host eviction may not take the pages it
    takes off the device until they compete among themselves), the device-only runs leaving
    for host with their device pages, and every node that left the device."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.leaving: list[tuple[RadixNode, list[int]]] = []
        self.left: list[RadixNode] = []


class HostPlacement:
    """The host tier of one radix tree: its pages, eviction queue, counters and placement."""

    def __init__(self, tier: HostTier, tree: TreeOps, reporter: TreeEventReporter, stats: CacheStats,
                 clock: Callable[[], float]) -> None:
        if tier.pool.page_size != tree.page_size:
            raise ValueError(f"host pool: page size {tier.pool.page_size} != device page size {tree.page_size}")
        self.tier = tier
        self.pool = tier.pool
        self._tree = tree
        self._reporter = reporter
        self._stats = stats
        self._clock = clock
        self._queue: EvictionQueue[RadixNode] = EvictionQueue(tree.order.key, self.is_candidate, tree.num_nodes,
                                                              slot="host_heap_seq", expiry_slot="host_expiry_seq",
                                                              epoch=tree.order.epoch)
        self._cached = 0     # host pages held
        self._host_only = 0  # pages held on the host only
        self._calls = 0      # numbers device-eviction calls (see `leave_device`)
        self._shielded: int | None = None  # the call whose pages host eviction may not take yet
        self._settling: list[RadixNode] = []  # exclusive: loaded nodes whose host copy goes after the load
        # Nodes that may hold a page on both tiers (a superset: stale entries are skipped
        # when read), so that host room can be had from their host copies (`_free_copies`).
        self._copies: dict[RadixNode, None] = {}

    # ------------------------------------------------------------------ state
    @property
    def cached_pages(self) -> int:
        """Host pages held (host-only pages and host copies of device pages)."""
        return self._cached

    @property
    def host_only_pages(self) -> int:
        """Cached pages that live on the host only."""
        return self._host_only

    def stats(self) -> dict[str, int]:
        """The host tier's page counts, for the tree's `stats`."""
        return dict(host_cached_pages=self._cached, host_only_pages=self._host_only,
                    host_free_pages=self.pool.num_free)

    def is_candidate(self, node: RadixNode) -> bool:
        """A host eviction candidate: an unlocked host-only leaf, unless it left the device
        in the eviction call under way (see `leave_device`)."""
        return (node.parent is not None and not node.pages and not node.children and node.lock_ref == 0
                and node.left_device_in != self._shielded)

    def requeue(self, node: RadixNode, now: float) -> None:
        """Queues `node` for host eviction if it is a candidate (with its current key)."""
        if self.is_candidate(node):
            self._queue.push(node, now)

    def schedule_expiries(self, node: RadixNode, times: list[float], now: float) -> None:
        """Remembers that `node`'s key may drop at each of `times` (all of them after `now`)."""
        self._queue.schedule_expiries(node, times, now)

    def queued(self) -> Iterator[RadixNode]:
        """Nodes with a live entry in the host eviction queue (for checkers)."""
        return self._queue.queued()

    def tracked_copies(self) -> set[RadixNode]:
        """Nodes tracked as maybe holding pages on both tiers (for checkers: each that does
        must be among them)."""
        return set(self._copies)

    def track(self, node: RadixNode) -> None:
        """Notes `node` if it holds its pages on both tiers (the tree calls it for the upper
        part of a split, which inherits both copies)."""
        if node.pages and node.host is not None:
            self._copies[node] = None
            if len(self._copies) > 2 * (self._cached - self._host_only) + 64:  # bound the stale entries
                self._copies = {n: None for n in self._copies if self._holds_copy(n)}

    @staticmethod
    def _holds_copy(node: RadixNode) -> bool:
        return node.parent is not None and bool(node.pages) and node.host is not None

    # ------------------------------------------------------------------ device eviction
    def begin_eviction(self) -> EvictionCall:
        """Opens a device eviction call: what it takes off the device is shielded from host
        eviction until `end_eviction`."""
        self._calls += 1
        self._shielded = self._calls
        return EvictionCall(self._calls)

    def leave_device(self, call: EvictionCall, node: RadixNode, count: int, now: float) -> int:
        """Takes the last `count` pages of `node` off the device; returns device pages freed.

        The rule, per eviction call (all pages it takes off the device, S):
        - a page with a host copy just loses its device copy;
        - a device-only page goes to host if the tier offloads its priority and every page
          above it in S; the others are dropped, with everything below them;
        - host room for those pages is made from free host pages, then by host eviction of
          pages outside S; if that is not enough, the pages of S compete among themselves
          by the same order (host eviction, leaf first) and the losers are dropped.
        The split makes the run a node of its own; its device pages are freed now and
        copied to host at the end of the call (`end_eviction`), before anything can reuse
        them.
        """
        tree = self._tree
        keep = node.num_pages(tree.page_size) - count
        if keep:
            tree.split(node, keep)  # `node` keeps the run, its new parent the rest
        self._stats.evicted(count, now - node.inserted_at, node.hits)
        freed = 0
        if node.host is None:
            qualifies = self.tier.offloads(tree.order.effective(node, now))
            head = count if qualifies.all() else int(qualifies.argmin())
            if head < count:
                top = tree.split(node, head) if head else None
                parent = node.parent
                self._stats.dropped(count - head)
                # Host-only pages below it go with it: they leave the host (and the cache).
                below = sum(len(n.host) for n in node.subtree() if n.host is not None and not n.pages)
                if below:
                    self._stats.host_evicted(below)
                freed += tree.drop(node)
                if top is None:
                    tree.after_removal(parent, now)
                    return freed
                node = top
            call.leaving.append((node, node.pages))
        else:
            self._host_only += count
            self.fence(node)
        freed += tree.lose_device(node)
        node.left_device_in = call.number
        call.left.append(node)
        tree.requeue(node.parent, now)  # it may have no child on the device now
        return freed

    def end_eviction(self, call: EvictionCall, now: float) -> None:
        """Closes `call`: copies its leaving pages to host, then lifts the shield."""
        if call.leaving:
            self._place_on_host(call, now)
        self._shielded = None
        for node in call.left:
            if node.parent is not None:
                self._tree.requeue(node, now)

    def _place_on_host(self, call: EvictionCall, now: float) -> None:
        """Copies the device-only pages that left the device in `call` to host pages, making
        room as `leave_device` says; top down, each node after its parent."""
        size = self._tree.page_size
        self._settle_loaded()
        need = sum(node.num_pages(size) for node, _ in call.leaving if node.parent is not None)
        short = need - self.pool.num_free
        if short > 0:
            short -= self._free_copies(short)
        if short > 0:
            short -= self._evict(short, now)
        if short > 0:  # the pages of this call compete among themselves now
            self._shielded = None
            for node in call.left:
                if node.parent is not None and self.is_candidate(node):
                    self._queue.push(node, now)
            self._evict(short, now)
        # Parent first (events name a stored run's parent, which must be known by then): a
        # node leaves the device only after its children on the device, so in the call's
        # order every child comes before its parent.
        for node, device_pages in reversed(call.leaving):
            if node.parent is None:
                continue  # dropped since
            count = node.num_pages(size)
            host_pages = self.pool.allocate(count)
            self.tier.copier.offload(device_pages[:count], host_pages)
            self._host_only += count
            self._stats.offloaded(count)
            self._gain_host(node, host_pages)

    # ------------------------------------------------------------------ host eviction
    def _free_copies(self, needed: int) -> int:
        """Frees host copies of pages that are also on the device until `needed` host pages
        are free (or none is left but those a load in flight still reads); returns how many
        host pages. No cached page is lost: each stays on the device, and is copied to host
        again if it leaves the device. Left in place, such copies (kept by write-back's loads,
        made by write-through) filled a host pool no larger than the device's, and every page
        the device evicted was dropped.

        The most recently used go first, whole nodes at a time: the device keeps those
        longest, so their copies would wait longest to spare a copy, while a copy kept for a
        page near the device's eviction tail spares one soon (on the Mooncake trace at 0.5M +
        8M: 2% fewer tokens offloaded than freeing every copy at once). Which pages the host
        keeps on its own is the same either way: host-only pages are evicted only once no
        copy can be freed. Each call that needs room sorts the tracked copies (10k copy nodes:
        about 3 ms on a 2-core CPU; the trace simulation's time did not change)."""
        held = sorted((node for node in self._copies if self._holds_copy(node)),
                      key=lambda node: node.tick, reverse=True)
        freed = 0
        kept: dict[RadixNode, None] = {}
        for node in held:
            if freed >= needed or node.unfinished_load() is not None:
                kept[node] = None
                continue
            freed += len(node.host)
            self._drop_host_copy(node)
        self._copies = kept
        if freed:
            self._stats.host_copies_freed(freed)
        return freed

    def _evict(self, num_pages: int, now: float) -> int:
        """Takes up to `num_pages` pages off the host, from the tail of unlocked host-only
        leaves in the policy's order; returns how many (host pages freed, plus pages that
        were on their way to host and are dropped instead)."""
        self._queue.requeue_expired(now)
        return self._queue.drain(num_pages, now, self._tree.order.tail_run, self._evict_tail)

    def _evict_tail(self, node: RadixNode, count: int, now: float) -> int:
        keep = node.num_pages(self._tree.page_size) - count
        if node.host is None:  # on its way to host (this eviction call): dropped instead
            self._stats.dropped(count)
        else:
            if self._reporter.active:
                self._reporter.removed(node, keep, HOST)
            self.fence(node)
            evicted = node.host[keep:]
            del node.host[keep:]
            self._cached -= count
            self._host_only -= count
            self._stats.host_evicted(count)
            self.pool.decref(evicted)
        node.cut_tail(keep, self._tree.page_size)
        if keep:
            self._queue.push(node, now)
        else:
            self._tree.detach(node, now)
        return count

    # ------------------------------------------------------------------ copies to the device
    def load_back(self, match: MatchResult, max_pages: int | None = None) -> MatchResult:
        """Copies the leading pages of `match`'s host continuation into fresh device pages
        (see `RadixTree.load_back`); returns the match as it stands after the copy."""
        if not match.host_pages:
            return match
        self._settle_loaded()
        chain: list[RadixNode] = []
        up = match.host_node
        while up is not match.node:
            chain.append(up)
            up = up.parent
        device_pool, size = self._tree.pool, self._tree.page_size
        budget = min(len(match.host_pages), device_pool.num_free)
        if max_pages is not None:
            budget = min(budget, max_pages)
        pages, loads, node = list(match.pages), list(match.loads), match.node
        for step in reversed(chain):
            if budget == 0:
                break
            count = step.num_pages(size)
            if count > budget:
                step = self._tree.split(step, budget)
                count = budget
            device = device_pool.allocate(count)
            handle = self.tier.copier.load(step.host, device)
            self._gain_device(step, device)
            if handle is not None:
                step.loading = handle
                loads.append(handle)
            self._stats.loaded(count)
            self._settle_on_device(step)
            pages += device
            node = step
            budget -= count
        rest = match.host_pages[len(pages) - len(match.pages):]
        return MatchResult(len(pages) * size, pages, node, None, 0, rest,
                           match.host_node if rest else None, len(rest) * size, loads)

    def adopt(self, node: RadixNode, pages: list[int]) -> None:
        """The host-only `node` gets `pages` as its device copy (their holder adds the tree)."""
        self._tree.pool.incref(pages)
        self._gain_device(node, list(pages))
        self._settle_on_device(node)

    def _settle_on_device(self, node: RadixNode) -> None:
        """`node` is back on the device: under `exclusive` its host copy is freed, once its
        load is done (until then the load reads those host pages, and a request matching
        the node meanwhile must still find the load to wait for)."""
        if self.tier.keeps_device_copies_on_host:
            return
        if node.unfinished_load() is None:
            self._drop_host_copy(node)
        else:
            self._settling.append(node)

    def _settle_loaded(self) -> None:
        """Frees the host copies that `_settle_on_device` left to loads now done. A node
        split meanwhile left its upper part, on both tiers too, above it: those go as well
        (under `exclusive` no other node keeps both copies), also when the lower part has
        left the device since (it is settled from there up)."""
        if not self._settling:
            return
        waiting: list[RadixNode] = []
        for node in self._settling:
            while node.parent is not None and not node.pages:
                node = node.parent  # back on the host only: an upper part may still hold both
            if node.parent is None or node.host is None:
                continue  # dropped (or the root reached), or its host copy freed: nothing to free
            if node.unfinished_load() is not None:
                waiting.append(node)
                continue
            while not node.is_root and node.pages and node.host is not None and node.unfinished_load() is None:
                self._drop_host_copy(node)
                node = node.parent
        self._settling = waiting

    def _drop_host_copy(self, node: RadixNode) -> None:
        """Frees the host copy of `node`, which is on the device with no load in flight."""
        if self._reporter.active:
            self._reporter.removed(node, 0, HOST)
        self._cached -= len(node.host)
        self.pool.decref(node.host)
        node.host = None

    def _gain_device(self, node: RadixNode, pages: list[int]) -> None:
        """Host-only `node` now also lives in the device `pages` (already held for the tree)."""
        self._host_only -= len(pages)
        self._tree.gain_device(node, pages)
        self.track(node)

    # ------------------------------------------------------------------ copies to the host
    def write_through(self, match: MatchResult) -> None:
        """After a match, under write-through-selective: copies the matched device pages hit
        often enough to the host, top down, into free host pages only: a copy of a page the
        device still holds is worth less than any page cached on the host alone, and no
        less than another such copy."""
        if not self.tier.copies_on_hit:
            return
        path: list[RadixNode] = []
        up: RadixNode | None = match.node
        while up is not None and not up.is_root:
            path.append(up)
            up = up.parent
        size = self._tree.page_size
        for node in reversed(path):
            if node.host is not None or not self.tier.writes_through(node.hits):
                continue
            got = self.pool.allocate(min(node.num_pages(size), self.pool.num_free))
            if not got:
                break
            if len(got) < node.num_pages(size):
                node = self._tree.split(node, len(got))
            self.tier.copier.offload(node.pages, got)
            self._gain_host(node, got)
            self._stats.written_through(len(got))

    def _gain_host(self, node: RadixNode, host_pages: list[int]) -> None:
        """`node` now also lives in `host_pages` (copied, held for the tree)."""
        node.host = host_pages
        self._cached += len(host_pages)
        self.track(node)
        if self._reporter.active:
            self._reporter.stored(node, 0, HOST)

    # ------------------------------------------------------------------ removal
    def fence(self, node: RadixNode) -> None:
        """Before pages of `node` are freed: an unfinished load into it is fenced."""
        if node.loading is not None:
            if not node.loading.done():
                self.tier.copier.fence(node.loading)
            node.loading = None

    def release(self, nodes: Iterable[RadixNode]) -> None:
        """The tree drops `nodes` (on both tiers): fences their loads, frees their host pages."""
        host: list[int] = []
        for node in nodes:
            self.fence(node)
            if node.host is not None:
                host += node.host
                if not node.pages:
                    self._host_only -= len(node.host)
        if host:
            self._cached -= len(host)
            self.pool.decref(host)

    def reset(self, nodes: Iterable[RadixNode]) -> None:
        """A flush left only locked `nodes`: drops the host copies of their device pages and
        every queued entry (unlock re-queues a node)."""
        for node in nodes:
            if node.pages and node.host is not None:
                self.fence(node)
                self._cached -= len(node.host)
                self.pool.decref(node.host)
                node.host = None
        self._queue.forget(lambda node: node.parent is not None)
