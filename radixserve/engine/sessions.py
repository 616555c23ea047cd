"""Open sessions: which conversation turns are kept ahead of ordinary cache, and for how long.

A session's latest turn is raised to SESSION_PRIORITY in the tree for `ttl_s` after it ends.
A session belongs to its tenant: it is keyed by (tenant, id), so the same id sent by another
tenant is another session, and only its own tenant can close it.

Any client may open sessions, so what they can raise is bounded: at most `max_tokens` tokens
over all open sessions, shared fairly between the tenants that hold sessions. Past the
bound, sessions end early (their pages become ordinary cache): the least recently active
ones of the tenant holding the most tokens, so one tenant opening thousands of sessions only
competes with its own oldest sessions and cannot push out another tenant's within its fair
share. With one tenant that is simply the least recently active sessions first.

Several open sessions may share a prefix (a system prompt): each is a holder of that
retention, and a session that ends lowers only the pages no other open session of its
namespace holds.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.cache.radix import RadixTree, Retention
from radixserve.engine.policy import common_prefix_len

SESSION_PRIORITY = 90  # an open session's latest turn outranks ordinary cache (35)
SESSION_SWEEP_S = 1.0  # how often idle sessions are looked for

SessionKey = tuple[str | None, str]  # (tenant, session id): a session id is its tenant's own


@dataclass
class Session:
    """One open session: its latest turn's computed tokens, the cache namespace they are in,
    and the tenant it belongs to."""

    tokens: list[int]
    namespace: Any
    last_active: float
    tenant: str | None = None


Demote = Callable[[Session, int], None]  # (ended session, leading pages other sessions still hold)


class SessionTable:
    """Open sessions, least recently active first, bounded by idle time and by raised tokens.

    `demote(session, keep_pages)` is called for every session that ends (expired, closed,
    replaced by a newer turn, or pushed out by the token bound): the engine lowers its pages'
    retention, except the first `keep_pages` pages, which another open session holds too.
    """

    def __init__(self, ttl_s: float, max_tokens: int, demote: Demote,
                 clock: Callable[[], float] = time.monotonic, page_size: int = 1) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self.page_size = page_size
        self._demote = demote
        self._clock = clock
        self._open: OrderedDict[SessionKey, Session] = OrderedDict()
        self._tokens = 0
        self._tenant_tokens: dict[str | None, int] = {}  # raised tokens per tenant with open sessions
        self.last_sweep = clock()

    @classmethod
    def over(cls, tree: RadixTree, ttl_s: float, max_tokens: int) -> SessionTable:
        """The engine's table: a session that ends has its turn's raised retention in `tree` ended."""
        return cls(ttl_s, max_tokens,
                   lambda session, keep: tree.end_retention(session.tokens, session.namespace, SESSION_PRIORITY,
                                                            keep_pages=keep),
                   page_size=tree.page_size)

    def __len__(self) -> int:
        return len(self._open)

    @property
    def tokens(self) -> int:
        """Tokens raised by all open sessions together."""
        return self._tokens

    def tenant_tokens(self, tenant: str | None) -> int:
        """Tokens raised by the open sessions of `tenant`."""
        return self._tenant_tokens.get(tenant, 0)

    def reserve(self, session_id: str, num_tokens: int, tenant: str | None = None) -> None:
        """Before a turn of (`tenant`, `session_id`) is raised in the tree: its previous turn
        ends, and while the new turn would exceed the bound, other sessions end (`_victim`
        picks which; a single session longer than the bound stays alone)."""
        self.expire()
        self._end((tenant, session_id))
        while self._tokens + num_tokens > self.max_tokens:
            victim = self._victim(tenant, num_tokens)
            if victim is None:
                break
            self._end(victim)

    def _victim(self, tenant: str | None, num_tokens: int) -> SessionKey | None:
        """The session that ends to make room for `num_tokens` more of `tenant`: the least
        recently active one of the tenant holding the most raised tokens (counting the new
        turn; the requester first among equals). A tenant within its fair share (an equal
        part of the bound among the tenants holding sessions) is never pushed out by
        another: None then, and the new turn goes over the bound alone."""
        usage = dict(self._tenant_tokens)
        usage[tenant] = usage.get(tenant, 0) + num_tokens
        holders = [t for t in usage if t in self._tenant_tokens]
        if not holders:
            return None
        top = max(holders, key=lambda t: (usage[t], t == tenant))
        if top != tenant and usage[top] * len(usage) <= self.max_tokens:
            return None
        return next(key for key in self._open if key[0] == top)

    def begin_turn(self, session_id: str, num_tokens: int, tenant: str | None = None) -> tuple[int, int, Retention]:
        """Makes room for a new latest turn of `num_tokens` computed tokens (`reserve`); returns
        the token range and retention to insert it with: ahead of ordinary cache for the TTL,
        on top of whatever retention its pages have for good (the turn before no longer is).
        Sessions end first, so what the new turn shares with them is raised again by that
        insert. `add` the turn once inserted."""
        self.reserve(session_id, num_tokens, tenant)
        return 0, num_tokens, Retention(SESSION_PRIORITY, self.ttl_s)

    def add(self, session_id: str, tokens: list[int], namespace: Any, tenant: str | None = None) -> None:
        """The turn `reserve` made room for is raised: it is the session's latest turn."""
        self._open[(tenant, session_id)] = Session(tokens, namespace, self._clock(), tenant)
        self._tokens += len(tokens)
        self._tenant_tokens[tenant] = self._tenant_tokens.get(tenant, 0) + len(tokens)

    def close(self, session_id: str, tenant: str | None = None) -> bool:
        """Ends `tenant`'s session now; False if it was not open (or had expired) — which is
        also the answer for another tenant's session of that id."""
        self.expire()
        return self._end((tenant, session_id))

    def sweep(self) -> None:
        """Expires idle sessions at most every SESSION_SWEEP_S (every step would be wasted work)."""
        if self._open and self._clock() - self.last_sweep > min(SESSION_SWEEP_S, self.ttl_s):
            self.expire()

    def expire(self) -> None:
        """Ends the sessions idle past the TTL."""
        now = self._clock()
        self.last_sweep = now
        while self._open:
            key, session = next(iter(self._open.items()))
            if now - session.last_active <= self.ttl_s:
                break  # least recently active first: the rest are younger
            self._end(key)

    def _end(self, key: SessionKey) -> bool:
        session = self._open.pop(key, None)
        if session is None:
            return False
        self._tokens -= len(session.tokens)
        left = self._tenant_tokens[session.tenant] - len(session.tokens)
        if left or any(k[0] == session.tenant for k in self._open):
            self._tenant_tokens[session.tenant] = left
        else:
            del self._tenant_tokens[session.tenant]
        self._demote(session, self._pages_held_by_others(session))
        return True

    def _pages_held_by_others(self, session: Session) -> int:
        """How many leading pages of `session`'s turn another open session of its namespace
        holds too (whose raised retention must outlive this one's)."""
        mine = np.asarray(session.tokens, dtype=np.int64)
        keep = 0
        for other in self._open.values():
            if other.namespace != session.namespace:
                continue
            theirs = np.asarray(other.tokens, dtype=np.int64)
            shared = common_prefix_len(mine, theirs)
            # Where one turn ends inside the page the shared tokens reach, that page is the
            # other's (a full page supersedes a partial leaf): it is held too.
            ends_inside = shared in (len(mine), len(theirs))
            keep = max(keep, -(-shared // self.page_size) if ends_inside else shared // self.page_size)
        return keep
