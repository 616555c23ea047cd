"""Cache events for asyncio readers: one bounded ring filled by the engine thread, a cursor per reader.

`Engine.subscribe_events` calls back on the engine thread for every change of what the cache
holds. `CacheEventHub` is that callback for every reader at once: it encodes each event to JSON
once and appends it to a ring of `capacity` events, an O(1) step whatever the number of
readers, so no reader can slow the engine thread. Each `EventReader` (one per HTTP stream)
keeps its own position in the ring; a reader that falls more than `capacity` events behind has
lost events, and gets a `StreamReset` followed by a fresh `StreamSnapshot` instead of an
unbounded queue. Nothing else grows with a slow reader.

A reader starts with a snapshot: the set of cached page hashes and the `seq` of the last event
it reflects, taken on the engine thread in the same command that places its cursor, so
"snapshot, then every event with a larger seq" is exactly the cache's history.

The hub subscribes to the engine while it has readers and unsubscribes when the last one
leaves (with no subscriber the tree computes no hashes at all).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Any

import msgspec

from radixserve.engine.async_engine import AsyncEngine

DEFAULT_CAPACITY = 4096
DEVICE_TIER = "device"


class SnapshotBlock(msgspec.Struct):
    """The cached pages of one namespace on one tier."""

    namespace: str
    tier: str
    hashes: list[int]


class StreamSnapshot(msgspec.Struct, tag="snapshot", tag_field="type"):
    """Every page cached after the event numbered `seq` (0: before any event); the events that
    follow it on the stream start at `seq + 1`."""

    seq: int
    page_size: int
    blocks: list[SnapshotBlock]


class StreamReset(msgspec.Struct, tag="reset", tag_field="type"):
    """The reader fell more than `buffer` events behind and lost the events after `seq` (the
    last one it received): drop the state built so far; a `snapshot` follows at once."""

    seq: int
    buffer: int
    reason: str = "slow_reader"


class CacheEventHub:
    """Fans an engine's cache events out to any number of asyncio readers; see the module
    docstring. `include_token_ids` asks the engine for the pages' token ids (the operator's
    --expose-cache-tokens)."""

    def __init__(self, engine: AsyncEngine, *, capacity: int = DEFAULT_CAPACITY,
                 include_token_ids: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.engine = engine
        self.capacity = capacity
        self.include_token_ids = include_token_ids
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=capacity)  # (seq, encoded event)
        self._end = 0          # ring position of the next event (events ever appended)
        self._last_seq = 0     # seq of the newest event appended
        self._lock = threading.Lock()  # ring vs readers' slices; held for O(1) or one copy
        self._readers: set[EventReader] = set()
        self._unsubscribe: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_pending = False
        self._encoder = msgspec.json.Encoder()
        self.closed = False

    # ------------------------------------------------------------------ engine thread
    def _on_event(self, event: Any) -> None:
        data = self._encoder.encode(event)
        with self._lock:
            self._ring.append((event.seq, data))
            self._end += 1
            self._last_seq = event.seq
        if not self._wake_pending and self._loop is not None:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._wake)

    def _attach(self, reader: EventReader) -> tuple[int, int, set[tuple[str, int]]]:
        """On the engine thread: subscribe if needed, place `reader` at the ring's end."""
        if self._unsubscribe is None:
            self._unsubscribe = self.engine.engine.subscribe_events(
                self._on_event, include_token_ids=self.include_token_ids)
            self._last_seq = self.engine.engine.cache_events.seq
        self._readers.add(reader)
        reader.cursor = self._end
        return self._last_seq, self.engine.engine.page_size, self.engine.engine.cache_page_hashes()

    def _detach(self, reader: EventReader) -> None:
        """On the engine thread: forget `reader`; the last one out unsubscribes."""
        self._readers.discard(reader)
        if not self._readers and self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            with self._lock:
                self._ring.clear()  # positions stay valid: _end only grows

    # ------------------------------------------------------------------ event loop
    def _wake(self) -> None:
        self._wake_pending = False
        for reader in self._readers.copy():
            reader.ready.set()

    async def open_reader(self) -> EventReader:
        """A new reader; its first `next()` is the snapshot."""
        self._loop = asyncio.get_running_loop()
        reader = EventReader(self)
        await reader.resync()
        return reader

    def close(self) -> None:
        """Ends every reader's stream (the server is stopping)."""
        self.closed = True
        for reader in self._readers.copy():
            reader.ready.set()

    def _take(self, cursor: int) -> tuple[list[tuple[int, bytes]] | None, int]:
        """Events from ring position `cursor` on and the new cursor; None if some were lost."""
        with self._lock:
            start = self._end - len(self._ring)
            if cursor < start:
                return None, cursor
            return list(islice(self._ring, cursor - start, None)), self._end

    def snapshot_message(self, seq: int, page_size: int, hashes: set[tuple[str, int]]) -> StreamSnapshot:
        """Groups `cache_page_hashes()` by namespace (sorted, so equal states encode equally)."""
        grouped: dict[str, list[int]] = {}
        for namespace, page_hash in hashes:
            grouped.setdefault(namespace, []).append(page_hash)
        blocks = [SnapshotBlock(namespace=ns, tier=DEVICE_TIER, hashes=sorted(h)) for ns, h in sorted(grouped.items())]
        return StreamSnapshot(seq=seq, page_size=page_size, blocks=blocks)


class EventReader:
    """One reader's position in the hub's ring. `next()` returns encoded messages in order."""

    def __init__(self, hub: CacheEventHub) -> None:
        self.hub = hub
        self.cursor = 0
        self.last_seq = 0
        self.ready = asyncio.Event()
        self._pending: list[bytes] = []
        self.resets = 0

    async def resync(self) -> None:
        """Places the cursor at the ring's end and queues the snapshot that matches it."""
        seq, page_size, hashes = await self.hub.engine.call(lambda: self.hub._attach(self))
        self.last_seq = seq
        self._pending = [self.hub._encoder.encode(self.hub.snapshot_message(seq, page_size, hashes))]

    async def next(self, timeout: float | None = None) -> list[bytes] | None:
        """The next messages (encoded JSON), waiting up to `timeout` seconds ([] when it
        passes). None once the hub is closed. After lost events: a reset, then a snapshot."""
        while True:
            if self._pending:
                out, self._pending = self._pending, []
                return out
            if self.hub.closed:
                return None
            self.ready.clear()
            events, cursor = self.hub._take(self.cursor)
            if events is None:
                self.resets += 1
                reset = self.hub._encoder.encode(StreamReset(seq=self.last_seq, buffer=self.hub.capacity))
                await self.resync()
                self._pending.insert(0, reset)
                continue
            if events:
                self.cursor = cursor
                self.last_seq = events[-1][0]
                return [data for _, data in events]
            try:
                await asyncio.wait_for(self.ready.wait(), timeout)
            except TimeoutError:
                return []

    async def close(self) -> None:
        """Leaves the hub (on the engine thread, so the last reader out unsubscribes cleanly)."""
        if not self.hub.closed:
            await self.hub.engine.call(lambda: self.hub._detach(self))
