"""What tenants keep ahead of ordinary cache: open sessions and held retention, bounded.

A session's latest turn is raised to SESSION_PRIORITY in the tree for `ttl_s` after it ends.
A session belongs to its tenant: it is keyed by (tenant, id), so the same id sent by another
tenant is another session, and only its own tenant can close it.

A tenant's request asking for retention above the default (`retention_priority`,
`system_retention_priority`) is *held* the same way: once it finishes, the span it raises is
an entry keyed by (tenant, namespace, priority, the span's tokens), raised for its duration
but at most `ttl_s` after the last request that raised it (resending the span renews it).
Retention priorities order every tenant's pages in one pool, so a raise nobody bounded would
let one tenant push out the others' ordinary cache for as long as it resends; held, it is
bounded like a session. (The single tenant's and an admin's retention is not held: the tree
keeps it as given.)

Any client may open sessions and hold spans, so what they can raise is bounded: at most
`max_tokens` tokens over all entries, shared fairly between the tenants that hold them. Past
the bound, entries end early (their pages become ordinary cache): the least recently active
ones of the tenant holding the most tokens, so one tenant opening thousands of sessions only
competes with its own oldest entries and cannot push out another tenant's within its fair
share. With one tenant that is simply the least recently active entries first. A held span,
and a session's turn alike, is cut to its tenant's fair share (its leading tokens: the prefix
another request, or the session's next turn, reuses); the rest is ordinary cache.

An entry counts (as open, and toward the bound) until it ends, even if the cache evicted its
pages meanwhile (they are then simply recomputed by the next request that needs them).

Several entries may share a prefix (a system prompt): each is a holder of that retention,
and one that ends lowers only the pages no other open entry of its namespace holds (which
then stay at the ended entry's priority until it would have decayed, at most `ttl_s`).
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.cache.radix import RadixTree
from radixserve.cache.retention import DEFAULT_PRIORITY, Retention
from radixserve.engine.policy import common_prefix_len

SESSION_PRIORITY = 90  # an open session's latest turn outranks ordinary cache (35)
SESSION_SWEEP_S = 1.0  # how often idle entries are looked for
# Open entries (sessions and held spans) a tenant may have: past it its least recently active
# end. Ending one compares it with its tenant's other entries on the engine's thread, so a
# tenant opening thousands of tiny ones would slow every step (20,000: 0.1 s an end).
MAX_OPEN_PER_TENANT = 256
# The deadline heap holds one item per turn or renewal until its deadline; the stale ones
# (renewed, or ended early) are dropped once the heap passes twice the open entries plus this.
DEADLINE_SLACK = 64

# (tenant, what is raised): a session id, or a held span's HeldSpanKey. Either is its tenant's own.
HoldKey = tuple[str | None, Hashable]


@dataclass(frozen=True)
class HeldSpanKey:
    """What identifies a held span within its tenant: resending it renews the same entry."""

    namespace: Any
    priority: int
    digest: bytes


@dataclass
class Held:
    """One open entry: the computed tokens it raises (a session's latest turn, or a held
    span), their cache namespace, the tenant, the priority they are raised to and for how
    long after `last_active`."""

    tokens: list[int]
    namespace: Any
    last_active: float
    tenant: str | None = None
    priority: int = SESSION_PRIORITY
    duration_s: float = float("inf")

    @functools.cached_property
    def array(self) -> np.ndarray:
        """`tokens` as an array (compared with other entries' whenever one ends)."""
        return np.asarray(self.tokens, dtype=np.int64)

    @property
    def deadline(self) -> float:
        """When it ends unless raised again."""
        return self.last_active + self.duration_s


@dataclass(frozen=True)
class PendingHold:
    """A held span `SessionTable.begin_holds` made room for: raise `span` in the tree, then
    `add_holds`."""

    key: HoldKey
    tokens: list[int]
    retention: Retention

    @property
    def span(self) -> tuple[int, int, Retention]:
        """The token range and retention to insert with (RadixTree.insert's range form)."""
        return 0, len(self.tokens), self.retention


Demote = Callable[[Held, int], None]  # (ended entry, leading pages other entries still hold)


def hold_raised(retention: Retention | None, prefix_retention: tuple[int, Retention] | None
                ) -> tuple[Retention | None, tuple[int, Retention] | None, tuple[tuple[int | None, Retention], ...]]:
    """A tenant's request's retention split into what the tree applies while it runs (at most
    the default) and what is held once it finishes: (retention, prefix retention, held), each
    held item (tokens it covers, None for all computed; the retention asked for)."""
    held: list[tuple[int | None, Retention]] = []
    if retention is not None and retention.priority > DEFAULT_PRIORITY:
        held.append((None, retention))
        retention = None
    if prefix_retention is not None and prefix_retention[1].priority > DEFAULT_PRIORITY:
        held.append(prefix_retention)
        prefix_retention = None
    return retention, prefix_retention, tuple(held)


class SessionTable:
    """Open sessions and held spans, each tenant's least recently active first, bounded by
    time, by raised tokens and by MAX_OPEN_PER_TENANT entries a tenant.

    `demote(entry, keep_pages)` is called for every entry that ends (expired, closed,
    replaced by a newer turn, or pushed out by a bound): the engine lowers its pages'
    retention, except the first `keep_pages` pages, which another open entry holds too.
    The work an entry's end costs (it runs on the engine's thread) grows with its tenant's
    open entries alone, which the entry bound keeps small.
    """

    def __init__(self, ttl_s: float, max_tokens: int, demote: Demote,
                 clock: Callable[[], float] = time.monotonic, page_size: int = 1) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.page_size = page_size
        self._demote = demote
        self._clock = clock
        self._open: dict[str | None, OrderedDict[HoldKey, Held]] = {}  # per tenant holding any
        self._tokens = 0
        self._tenant_tokens: dict[str | None, int] = {}  # raised tokens per tenant holding any
        self._sessions = 0  # entries that are sessions (the rest are held spans)
        # (deadline, count, key) of every entry opened; renewed or ended ones are skipped later,
        # and dropped when the heap is rebuilt (past twice the open entries, `_open_entry`)
        self._deadlines: list[tuple[float, int, HoldKey]] = []
        self._opened = 0
        self._entries = 0  # open entries, sessions and held spans
        self.last_sweep = clock()

    @classmethod
    def over(cls, tree: RadixTree, ttl_s: float, max_tokens: int) -> SessionTable:
        """The engine's table: an entry that ends has its raised retention in `tree` ended."""
        return cls(ttl_s, max_tokens,
                   lambda held, keep: tree.end_retention(held.tokens, held.namespace, held.priority,
                                                         keep_pages=keep),
                   page_size=tree.page_size)

    def __len__(self) -> int:
        """Open sessions (held spans are not sessions)."""
        return self._sessions

    @property
    def held_spans(self) -> int:
        """Open held spans."""
        return self._entries - self._sessions

    @property
    def deadline_entries(self) -> int:
        """Entries of the deadline heap, the stale ones (renewed or ended) included: at most
        twice the open entries plus DEADLINE_SLACK."""
        return len(self._deadlines)

    def share(self, tenant: str | None) -> int:
        """`tenant`'s fair share of the bound: an equal part among the tenants holding
        entries, itself counted."""
        return self.max_tokens // len(self._tenant_tokens.keys() | {tenant})

    @property
    def tokens(self) -> int:
        """Tokens raised by all open entries together."""
        return self._tokens

    def tenant_tokens(self, tenant: str | None) -> int:
        """Tokens raised by the open entries of `tenant`."""
        return self._tenant_tokens.get(tenant, 0)

    def reserve(self, keys: Sequence[HoldKey], num_tokens: int, tenant: str | None = None) -> None:
        """Before `num_tokens` more of `tenant` are raised in the tree under `keys` (new
        entries of that tenant): what those keys raised before ends, the tenant's least
        recently active entries end past MAX_OPEN_PER_TENANT, and while the new tokens would
        exceed the bound, other entries end (`_victim` picks which; a single entry longer
        than the bound stays alone)."""
        self.expire()
        for key in keys:
            self._end(key)
        mine = self._open.get(tenant, {})
        while mine and len(mine) + len(keys) > MAX_OPEN_PER_TENANT:
            self._end(next(iter(mine)))
        while self._tokens + num_tokens > self.max_tokens:
            victim = self._victim(tenant, num_tokens)
            if victim is None:
                break
            self._end(victim)

    def _victim(self, tenant: str | None, num_tokens: int) -> HoldKey | None:
        """The entry that ends to make room for `num_tokens` more of `tenant`: the least
        recently active one of the tenant holding the most raised tokens (counting the new
        ones; the requester first among equals). A tenant within its fair share (an equal
        part of the bound among the tenants holding entries) is never pushed out by
        another: None then, and the new entry goes over the bound alone."""
        usage = dict(self._tenant_tokens)
        usage[tenant] = usage.get(tenant, 0) + num_tokens
        holders = [t for t in usage if t in self._tenant_tokens]
        if not holders:
            return None
        top = max(holders, key=lambda t: (usage[t], t == tenant))
        if top != tenant and usage[top] * len(usage) <= self.max_tokens:
            return None
        return next(iter(self._open[top]))

    def begin_turn(self, session_id: str, num_tokens: int, tenant: str | None = None) -> tuple[int, int, Retention]:
        """Makes room for a new latest turn of `num_tokens` computed tokens, cut to the
        tenant's fair share as a held span is (its leading tokens; `reserve`); returns the
        token range and retention to insert it with: ahead of ordinary cache for the TTL, on
        top of whatever retention its pages have for good (the turn before no longer is).
        Entries end first, so what the new turn shares with them is raised again by that
        insert. `add` the turn's tokens up to the range's end once inserted (none if it is
        empty: a bound of 0 tokens raises nothing)."""
        num_tokens = min(num_tokens, self.share(tenant))
        self.reserve([(tenant, session_id)], num_tokens, tenant)
        return 0, num_tokens, Retention(SESSION_PRIORITY, self.ttl_s)

    def add(self, session_id: str, tokens: list[int], namespace: Any, tenant: str | None = None) -> None:
        """The turn `reserve` made room for is raised: it is the session's latest turn
        (`tokens`: those `begin_turn`'s range covers; none opens nothing)."""
        if not tokens:
            return
        self._open_entry((tenant, session_id), Held(tokens, namespace, self._clock(), tenant, duration_s=self.ttl_s))
        self._sessions += 1

    def begin_holds(self, spans: Sequence[tuple[Sequence[int], Retention]], namespace: Any,
                    tenant: str | None) -> list[PendingHold]:
        """Makes room for the spans a finished request of `tenant` asked to raise (each its
        tokens and retention): each cut to the tenant's fair share of the bound, renewing the
        entry of the same span if there is one (`reserve`). Returns what to raise in the tree,
        for as long as the retention asks but at most the TTL; `add_holds` them once inserted."""
        share = self.share(tenant)
        pending: list[PendingHold] = []
        for tokens, retention in spans:
            cut = [int(t) for t in tokens[:share]]
            if not cut:
                continue
            digest = hashlib.blake2b(np.asarray(cut, dtype=np.int64).tobytes(), digest_size=16).digest()
            key = (tenant, HeldSpanKey(namespace, retention.priority, digest))
            duration = min(retention.duration_s or self.ttl_s, self.ttl_s)
            if all(hold.key != key for hold in pending):  # the same span twice: one entry
                pending.append(PendingHold(key, cut, Retention(retention.priority, duration)))
        self.reserve([hold.key for hold in pending], sum(len(hold.tokens) for hold in pending), tenant)
        return pending

    def add_holds(self, pending: Sequence[PendingHold], namespace: Any) -> None:
        """The spans `begin_holds` made room for are raised: they are open entries."""
        for hold in pending:
            self._open_entry(hold.key, Held(hold.tokens, namespace, self._clock(), hold.key[0],
                                            hold.retention.priority, hold.retention.duration_s or self.ttl_s))

    def _open_entry(self, key: HoldKey, held: Held) -> None:
        self._open.setdefault(held.tenant, OrderedDict())[key] = held
        self._tokens += len(held.tokens)
        self._tenant_tokens[held.tenant] = self._tenant_tokens.get(held.tenant, 0) + len(held.tokens)
        self._entries += 1
        self._opened += 1
        heapq.heappush(self._deadlines, (held.deadline, self._opened, key))
        if len(self._deadlines) > 2 * self._entries + DEADLINE_SLACK:  # mostly stale: rebuilt
            self._deadlines = [(entry.deadline, n, k) for n, (k, entry) in enumerate(
                (k, entry) for entries in self._open.values() for k, entry in entries.items())]
            heapq.heapify(self._deadlines)

    def close(self, session_id: str, tenant: str | None = None) -> bool:
        """Ends `tenant`'s session now; False if it was not open (or had expired) — which is
        also the answer for another tenant's session of that id."""
        self.expire()
        return self._end((tenant, session_id))

    def sweep(self) -> None:
        """Expires idle entries at most every SESSION_SWEEP_S (every step would be wasted work)."""
        if self._open and self._clock() - self.last_sweep > min(SESSION_SWEEP_S, self.ttl_s):
            self.expire()

    def expire(self) -> None:
        """Ends the entries whose time is up: sessions idle past the TTL, held spans past
        their duration since they were last raised."""
        now = self._clock()
        self.last_sweep = now
        while self._deadlines and self._deadlines[0][0] < now:
            deadline, _, key = heapq.heappop(self._deadlines)
            held = self._open.get(key[0], {}).get(key)
            if held is not None and held.deadline == deadline:  # else renewed since, or ended
                self._end(key)

    def _end(self, key: HoldKey) -> bool:
        entries = self._open.get(key[0])
        held = None if entries is None else entries.pop(key, None)
        if held is None:
            return False
        if not isinstance(key[1], HeldSpanKey):
            self._sessions -= 1
        self._entries -= 1
        self._tokens -= len(held.tokens)
        if entries:
            self._tenant_tokens[held.tenant] -= len(held.tokens)
        else:
            del self._open[held.tenant], self._tenant_tokens[held.tenant]
        self._demote(held, self._pages_held_by_others(held))
        return True

    def _pages_held_by_others(self, held: Held) -> int:
        """How many leading pages of `held`'s tokens another open entry of its namespace holds
        too (whose raised retention must outlive this one's). A namespace is one tenant's."""
        mine = held.array
        keep = 0
        for other in self._open.get(held.tenant, {}).values():
            if other.namespace != held.namespace or other.tokens[0] != held.tokens[0]:
                continue  # (nothing shared: a quick look first)
            theirs = other.array
            shared = common_prefix_len(mine, theirs)
            # Where one span ends inside the page the shared tokens reach, that page is the
            # other's (a full page supersedes a partial leaf): it is held too.
            ends_inside = shared in (len(mine), len(theirs))
            keep = max(keep, -(-shared // self.page_size) if ends_inside else shared // self.page_size)
        return keep
