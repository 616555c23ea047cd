"""Open sessions: which conversation turns are kept ahead of ordinary cache, and for how long.

A session's latest turn is raised to SESSION_PRIORITY in the tree for `ttl_s` after it ends.
Any client may open sessions, so what they can raise is bounded: at most `max_tokens` tokens
over all open sessions. Past that, the least recently active sessions end early (their pages
become ordinary cache), so one client opening thousands of sessions cannot push everyone
else's cache out; it only competes with its own oldest sessions.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from radixserve.cache.radix import RadixTree, Retention

SESSION_PRIORITY = 90  # an open session's latest turn outranks ordinary cache (35)
SESSION_SWEEP_S = 1.0  # how often idle sessions are looked for


@dataclass
class Session:
    """One open session: its latest turn's computed tokens and the cache namespace they are in."""

    tokens: list[int]
    namespace: Any
    last_active: float


class SessionTable:
    """Open sessions, least recently active first, bounded by idle time and by raised tokens.

    `demote(session)` is called for every session that ends (expired, closed, replaced by a
    newer turn, or pushed out by the token bound): the engine lowers its pages' retention.
    """

    def __init__(self, ttl_s: float, max_tokens: int, demote: Callable[[Session], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.max_tokens = max_tokens
        self._demote = demote
        self._clock = clock
        self._open: OrderedDict[str, Session] = OrderedDict()
        self._tokens = 0
        self.last_sweep = clock()

    @classmethod
    def over(cls, tree: RadixTree, ttl_s: float, max_tokens: int) -> SessionTable:
        """The engine's table: a session that ends has its turn's raised retention in `tree` ended."""
        return cls(ttl_s, max_tokens,
                   lambda session: tree.end_retention(session.tokens, session.namespace, SESSION_PRIORITY))

    def __len__(self) -> int:
        return len(self._open)

    @property
    def tokens(self) -> int:
        """Tokens raised by all open sessions together."""
        return self._tokens

    def reserve(self, session_id: str, num_tokens: int) -> None:
        """Before a turn of `session_id` is raised in the tree: its previous turn ends, and
        the least recently active other sessions end while the new turn would exceed the
        bound (a single session longer than the bound stays alone)."""
        self.expire()
        self._end(session_id)
        while self._open and self._tokens + num_tokens > self.max_tokens:
            self._end(next(iter(self._open)))

    def begin_turn(self, session_id: str, num_tokens: int) -> tuple[int, int, Retention]:
        """Makes room for a new latest turn of `num_tokens` computed tokens (`reserve`); returns
        the token range and retention to insert it with: ahead of ordinary cache for the TTL,
        on top of whatever retention its pages have for good (the turn before no longer is).
        Sessions end first, so what the new turn shares with them is raised again by that
        insert. `add` the turn once inserted."""
        self.reserve(session_id, num_tokens)
        return 0, num_tokens, Retention(SESSION_PRIORITY, self.ttl_s)

    def add(self, session_id: str, tokens: list[int], namespace: Any) -> None:
        """The turn `reserve` made room for is raised: it is the session's latest turn."""
        self._open[session_id] = Session(tokens, namespace, self._clock())
        self._tokens += len(tokens)

    def close(self, session_id: str) -> bool:
        """Ends a session now; False if it was not open (or had expired)."""
        self.expire()
        return self._end(session_id)

    def sweep(self) -> None:
        """Expires idle sessions at most every SESSION_SWEEP_S (every step would be wasted work)."""
        if self._open and self._clock() - self.last_sweep > min(SESSION_SWEEP_S, self.ttl_s):
            self.expire()

    def expire(self) -> None:
        """Ends the sessions idle past the TTL."""
        now = self._clock()
        self.last_sweep = now
        while self._open:
            sid, session = next(iter(self._open.items()))
            if now - session.last_active <= self.ttl_s:
                break  # least recently active first: the rest are younger
            self._end(sid)

    def _end(self, session_id: str) -> bool:
        session = self._open.pop(session_id, None)
        if session is None:
            return False
        self._tokens -= len(session.tokens)
        self._demote(session)
        return True
