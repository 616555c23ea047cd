"""Cache events: every change of what the prefix cache holds, in order, for indexers and routers.

The tree reports each change to a `CacheEventHub`: pages stored (a new leaf, or pages copied
to another tier), pages removed (evicted from a tier), and all cleared (a flush). The hub
numbers them and hands them to its subscribers synchronously, on the thread that changed the
tree (the engine's), so subscribers see them in exactly the order they happened. Pages are
named by their chained page hash (page_hash.py), so an indexer that applies the events to a
set of (namespace, hash) pairs holds exactly the tree's pages.

With no subscriber the tree computes no hashes: events cost nothing unless someone listens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

logger = logging.getLogger(__name__)

DEVICE = "device"
HOST = "host"
TIERS = (DEVICE, HOST)


class BlockStored(msgspec.Struct, tag="stored", tag_field="type"):
    """Pages became cached in `tier`: `hashes` in order along one path, right after the page
    named `parent_hash` (None: they start at the root of their namespace)."""

    seq: int
    namespace: str
    tier: str
    page_size: int
    parent_hash: int | None
    hashes: list[int]
    token_ids: list[int] | None = None  # only for subscribers that asked for token ids


class BlockRemoved(msgspec.Struct, tag="removed", tag_field="type"):
    """Pages stopped being cached in `tier`."""

    seq: int
    namespace: str
    tier: str
    hashes: list[int]


class AllCleared(msgspec.Struct, tag="cleared", tag_field="type"):
    """Every page of `tier` (None: of every tier) was dropped; stored events follow for the
    pages that were in use and stayed."""

    seq: int
    tier: str | None = None


CacheEvent = BlockStored | BlockRemoved | AllCleared
Subscriber = Callable[[CacheEvent], None]


class CacheEventHub:
    """Numbers cache events and delivers them to subscribers, in order, on the caller's thread.

    A subscriber that raises is dropped (it has missed an event, so its view is wrong from
    then on); the error is logged and the cache carries on.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._subscribers: dict[int, tuple[Subscriber, bool]] = {}
        self._next_id = 0
        self.seq = 0  # the number of the last event delivered

    @property
    def active(self) -> bool:
        """Whether anyone listens (the tree skips hashing when not)."""
        return bool(self._subscribers)

    @property
    def wants_tokens(self) -> bool:
        """Whether some subscriber asked for the pages' token ids."""
        return any(tokens for _, tokens in self._subscribers.values())

    def subscribe(self, callback: Subscriber, *, include_token_ids: bool = False) -> Callable[[], None]:
        """Calls `callback` with every later event; returns a function that unsubscribes."""
        self._next_id += 1
        key = self._next_id
        self._subscribers[key] = (callback, include_token_ids)
        return lambda: self._subscribers.pop(key, None) and None

    def stored(self, namespace: str, tier: str, parent_hash: int | None, hashes: list[int],
               token_ids: list[int] | None) -> None:
        """Reports pages stored; `token_ids` is given when `wants_tokens`."""
        self.seq += 1
        event = BlockStored(self.seq, namespace, tier, self.page_size, parent_hash, hashes, token_ids)
        if token_ids is None:
            self._deliver(event, event)
        else:
            self._deliver(event, msgspec.structs.replace(event, token_ids=None))

    def removed(self, namespace: str, tier: str, hashes: list[int]) -> None:
        """Reports pages removed from `tier`."""
        self.seq += 1
        event = BlockRemoved(self.seq, namespace, tier, hashes)
        self._deliver(event, event)

    def cleared(self, tier: str | None = None) -> None:
        """Reports that `tier` (None: every tier) was cleared."""
        self.seq += 1
        event = AllCleared(self.seq, tier)
        self._deliver(event, event)

    def _deliver(self, with_tokens: CacheEvent, without_tokens: CacheEvent) -> None:
        for key, (callback, tokens) in list(self._subscribers.items()):
            try:
                callback(with_tokens if tokens else without_tokens)
            except Exception:
                logger.exception("cache event subscriber failed; it is unsubscribed")
                self._subscribers.pop(key, None)
