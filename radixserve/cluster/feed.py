"""A replica's cache-event feed: the engine's events, fanned out to subscribers in batches.

The engine calls `publish` on its own thread for every cache event (Engine.subscribe_events).
The feed keeps the replica's current page set (a one-replica CacheIndex), so a new
subscriber starts from a snapshot — AllCleared, then BlockStored for every cached page —
taken atomically with its registration: the snapshot plus the events after it are exactly
the replica's cache, whenever the subscriber joins (a restarted ingress, a new router).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from radixserve.cache.events import DEVICE, AllCleared, BlockStored, CacheEvent
from radixserve.cluster.index import CacheIndex

_SELF = "self"


class EventFeed:
    """Thread-safe fan-out of cache events from the engine thread to asyncio subscribers."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._lock = threading.Lock()
        self._mirror = CacheIndex()
        self._last_seq = 0
        self._subscribers: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue[CacheEvent]]] = []

    def publish(self, event: CacheEvent) -> None:
        """Engine-thread callback: record the event and hand it to every subscriber."""
        with self._lock:
            self._mirror.apply(_SELF, [event])
            self._last_seq = event.seq
            for loop, queue in self._subscribers:
                loop.call_soon_threadsafe(queue.put_nowait, event)

    def snapshot(self) -> list[CacheEvent]:
        """Events that rebuild the current cache from nothing."""
        with self._lock:
            return self._snapshot_locked()

    async def subscribe(self, batch_interval_s: float = 0.02,
                        heartbeat_s: float = 0.25) -> AsyncIterator[list[CacheEvent]]:
        """Yields batches of events: first the snapshot, then whatever arrived in each
        `batch_interval_s`; an empty batch at least every `heartbeat_s` (a liveness beat
        the caller also uses to send fresh stats)."""
        queue: asyncio.Queue[CacheEvent] = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:
            first = self._snapshot_locked()
            self._subscribers.append(entry)
        try:
            yield first
            while True:
                try:
                    batch = [await asyncio.wait_for(queue.get(), heartbeat_s)]
                except asyncio.TimeoutError:
                    yield []
                    continue
                await asyncio.sleep(batch_interval_s)  # let a step's events gather
                while not queue.empty():
                    batch.append(queue.get_nowait())
                yield batch
        finally:
            with self._lock:
                self._subscribers.remove(entry)

    def _snapshot_locked(self) -> list[CacheEvent]:
        events: list[CacheEvent] = [AllCleared(seq=self._last_seq, tier=None)]
        by_namespace: dict[str, list[int]] = {}
        for namespace, page_hash in self._mirror.page_set(_SELF):
            by_namespace.setdefault(namespace, []).append(page_hash)
        for namespace, hashes in sorted(by_namespace.items()):
            # Order inside a snapshot does not matter to a set; parent_hash is unknown here.
            events.append(BlockStored(seq=self._last_seq, namespace=namespace, tier=DEVICE,
                                      page_size=self.page_size, parent_hash=None,
                                      hashes=sorted(hashes), token_ids=None))
        return events
