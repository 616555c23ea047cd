"""A replica's cache-event feed: the engine's events, fanned out to subscribers in batches.

The engine calls `publish` on its own thread for every cache event (Engine.subscribe_events).
The feed keeps the replica's current page set (a one-replica CacheIndex), so a new
subscriber starts from a snapshot — AllCleared, then BlockStored for every cached page of
each tier —
taken atomically with its registration: the snapshot plus the events after it are exactly
the replica's cache, whenever the subscriber joins (a restarted ingress, a new router).

`settle(request_id)` marks, in the same ordered stream, the point after which every cache
event of a finished request has been delivered: the router keeps the request's prompt
counted as in flight on this replica until then (radixserve.cluster.routing.ClusterState).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from radixserve.cache.events import DEVICE, HOST, AllCleared, BlockStored, CacheEvent
from radixserve.cluster.index import CacheIndex

_SELF = "self"


@dataclass(frozen=True)
class _Settled:
    request_id: str


@dataclass
class FeedBatch:
    """Cache events in order, and the requests settled after them (see `EventFeed.settle`)."""

    events: list[CacheEvent] = field(default_factory=list)
    settled: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.events or self.settled)


class EventFeed:
    """Thread-safe fan-out of cache events from the engine thread to asyncio subscribers."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._lock = threading.Lock()
        self._mirror = CacheIndex()
        self._last_seq = 0
        self._subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[CacheEvent | _Settled]]] = []

    def publish(self, event: CacheEvent) -> None:
        """Engine-thread callback: record the event and hand it to every subscriber."""
        with self._lock:
            self._mirror.apply(_SELF, [event])
            self._last_seq = event.seq
            self._send_locked(event)

    def settle(self, request_id: str) -> None:
        """A request's stream ended: every cache event it caused was published (the engine
        publishes a finished request's pages before its last delta), so subscribers get the
        marker after them. Callbacks reach one subscriber's loop in the order sent."""
        with self._lock:
            self._send_locked(_Settled(request_id))

    def _send_locked(self, item: CacheEvent | _Settled) -> None:
        for loop, queue in self._subscribers:
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def snapshot(self) -> list[CacheEvent]:
        """Events that rebuild the current cache from nothing."""
        with self._lock:
            captured = self._capture_locked()
        return self._snapshot(*captured)

    async def subscribe(self, batch_interval_s: float = 0.02,
                        heartbeat_s: float = 0.25) -> AsyncIterator[FeedBatch]:
        """Yields batches: first the snapshot, then whatever arrived in each
        `batch_interval_s`; an empty batch at least every `heartbeat_s` (a liveness beat
        the caller also uses to send fresh stats)."""
        queue: asyncio.Queue[CacheEvent | _Settled] = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:  # what is captured and what is sent after it, with nothing between
            captured = self._capture_locked()
            self._subscribers.append(entry)
        first = FeedBatch(self._snapshot(*captured))
        try:
            yield first
            while True:
                try:
                    items = [await asyncio.wait_for(queue.get(), heartbeat_s)]
                except asyncio.TimeoutError:
                    yield FeedBatch()
                    continue
                await asyncio.sleep(batch_interval_s)  # let a step's events gather
                while not queue.empty():
                    items.append(queue.get_nowait())
                # Settled ids go after the events: a batch is applied events first.
                yield FeedBatch([i for i in items if not isinstance(i, _Settled)],
                                [i.request_id for i in items if isinstance(i, _Settled)])
        finally:
            with self._lock:
                self._subscribers.remove(entry)

    def _capture_locked(self) -> tuple[int, dict[str, dict[str, list[int]]]]:
        """The cache's pages as of the last event, copied (C speed) under the lock: the engine
        thread's publish waits on it; sorting them and making the events does not (0.04 s at
        100k pages, per subscriber that starts, held the engine's steps)."""
        # Both tiers: without the host pages, a router that (re)subscribed lost every page
        # offloaded before, and its host credit and cached-token predictions with them.
        return self._last_seq, {tier: self._mirror.pages_by_namespace(_SELF, tier, ordered=False)
                                for tier in (DEVICE, HOST)}

    def _snapshot(self, seq: int, pages: dict[str, dict[str, list[int]]]) -> list[CacheEvent]:
        events: list[CacheEvent] = [AllCleared(seq=seq, tier=None)]
        for tier, spaces in pages.items():
            for namespace in sorted(spaces):
                # Order inside a snapshot does not matter to a set; parent_hash is unknown here.
                events.append(BlockStored(seq=seq, namespace=namespace, tier=tier, page_size=self.page_size,
                                          parent_hash=None, hashes=sorted(spaces[namespace]), token_ids=None))
        return events
