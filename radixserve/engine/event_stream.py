"""Cache events for asyncio readers: one bounded ring filled by the engine thread, a cursor per reader.

`Engine.subscribe_events` calls back on the engine thread for every change of what the cache
holds. `CacheEventHub` is that callback for every reader at once: it encodes each event to JSON
once and appends it to a ring of `capacity` events, an O(1) step whatever the number of
readers, so no reader can slow the engine thread. Each `EventReader` (one per HTTP stream)
keeps its own position in the ring; a reader that falls more than `capacity` events behind has
lost events, and gets a `StreamReset` followed by a fresh `StreamSnapshot` instead of an
unbounded queue. Nothing else grows with a slow reader.

A reader starts with a snapshot: the set of cached page hashes and the `seq` of the last event
it reflects, and its cursor is placed at the event right after it, so "snapshot, then every
event with a larger seq" is exactly the cache's history. The snapshot comes from the hub's
`PageMirror`, the cached pages of both tiers kept on the event loop by applying the ring's events as
they come: a reader joining a hub that already listens costs the engine thread nothing, and
readers that join at the same `seq` share one encoded message. The mirror is built from a
copy of the tree only when there is none (the first reader, or a burst of events larger than
the ring): the engine thread copies the tree and hashes the copy in slices between its steps
(tree_copy.py, `AsyncEngine.run_sliced`), having subscribed and noted the ring's end in the
first slice; the events of the copying time, applied on top, make it exact
(a set of pages ends as its last event left it, and a page with no event was the same
throughout). Concurrent first readers share one build, which stops when they all leave.

A reader may be given `visible`, a test of namespace ids (a tenant's reader sees only its own
namespaces): its snapshot holds only those namespaces' pages, it receives only their events
(and every `cleared`), and its messages are numbered by what it was shown, 1, 2, ..., so that
neither gaps in `seq` nor ids tell it of anyone else's pages. Nor do resets: the hub notes the
namespace of every event the full ring drops (the newest position per namespace), and a
reader that fell behind only by events it may not see skips them without a reset — a burst of
another tenant's events must not show up in its stream.

The hub subscribes to the engine while it has readers and unsubscribes when the last one
leaves (with no subscriber the tree computes no hashes at all).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Generator
from itertools import islice
from typing import Any

import anyio
import msgspec

from radixserve.cache.events import AllCleared, BlockRemoved, BlockStored
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.shared_work import SharedWork
from radixserve.engine.tree_copy import copy_tree, page_hashes

DEFAULT_CAPACITY = 4096
SERVER_LINGER_S = 5.0  # the server's hub keeps listening this long after its last reader left


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
    --expose-cache-tokens). With `linger_s`, the hub keeps listening (and its mirror current)
    that long after its last reader left, so readers that come and go do not each cost a copy
    of the tree; 0 unsubscribes at once."""

    def __init__(self, engine: AsyncEngine, *, capacity: int = DEFAULT_CAPACITY,
                 include_token_ids: bool = False, linger_s: float = 0.0) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: must be >= 1, got {capacity}")
        self.engine = engine
        self.capacity = capacity
        self.include_token_ids = include_token_ids
        self.linger_s = linger_s
        self._ring: deque[tuple[int, bytes, Any]] = deque(maxlen=capacity)  # (seq, encoded, event)
        self._end = 0          # ring position of the next event (events ever appended)
        # Events the full ring dropped: namespace id (None: a `cleared`, which every reader
        # sees) -> ring position of the newest one dropped, oldest first; bounded by
        # `capacity` entries, the older half forgotten at once below `_forgotten`.
        self._dropped: dict[str | None, int] = {}
        self._forgotten = 0
        self._last_seq = 0     # seq of the newest event appended
        self._generation = 0   # bumped by every subscribe and unsubscribe
        self._lock = threading.Lock()  # ring vs readers' slices; held for O(1) or one copy
        self._readers: set[EventReader] = set()  # event loop only
        self._unsubscribe: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_pending = False
        self._encoder = msgspec.json.Encoder()
        self._mirror: PageMirror | None = None  # event loop only
        self._building: SharedWork[PageMirror] | None = None
        self.builds = 0        # mirrors built from a copy of the tree (for stats and tests)
        self._linger_timer: asyncio.TimerHandle | None = None
        self.closed = False

    # ------------------------------------------------------------------ engine thread
    def _on_event(self, event: Any) -> None:
        data = self._encoder.encode(event)
        with self._lock:
            if len(self._ring) == self.capacity:
                self._note_dropped()
            self._ring.append((event.seq, data, event))
            self._end += 1
            self._last_seq = event.seq
        if not self._wake_pending and self._loop is not None:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._wake)

    def _note_dropped(self) -> None:
        """The ring's oldest event is about to go (lock held): note its namespace."""
        position = self._end - len(self._ring)
        event = self._ring[0][2]
        key = None if isinstance(event, AllCleared) else event.namespace
        self._dropped.pop(key, None)
        self._dropped[key] = position
        if len(self._dropped) > self.capacity:  # forget the older half, in one pass
            entries = list(self._dropped.items())
            half = len(entries) // 2
            self._forgotten = max(self._forgotten, entries[half - 1][1] + 1)
            self._dropped = dict(entries[half:])

    def _copy_work(self) -> Generator[None, None, tuple[tuple[int, int, int], dict[str, set[int]]]]:
        """Sliced work: subscribes (if no one has), notes where the ring ends, then copies the
        tree and hashes its device pages; every event from that point on is in the ring (or
        known lost)."""
        engine = self.engine.engine
        if self._unsubscribe is None:
            self._unsubscribe = engine.subscribe_events(self._on_event, include_token_ids=self.include_token_ids)
            with self._lock:
                self._last_seq = engine.cache_events.seq
                self._generation += 1
        with self._lock:
            start = (self._end, self._last_seq, self._generation)
        copy = yield from copy_tree(engine.tree)
        pages = yield from page_hashes(copy, hashing=engine.hashing)
        return start, pages

    def _unsubscribe_if_idle(self) -> None:
        """On the engine thread: the last reader left, so stop listening (no hashes computed)."""
        if not self._readers and self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            with self._lock:
                self._ring.clear()  # positions stay valid: _end only grows
                self._generation += 1

    # ------------------------------------------------------------------ event loop
    def _linger(self) -> None:
        """Unsubscribes `linger_s` after the last reader left unless one came meanwhile."""
        if self._readers or self.closed or self._loop is None or self._linger_timer is not None:
            return

        def check() -> None:
            self._linger_timer = None
            if not self._readers and not self.closed and self._unsubscribe is not None:
                self.engine._command(self._unsubscribe_if_idle)

        self._linger_timer = self._loop.call_later(self.linger_s, check)

    def _wake(self) -> None:
        self._wake_pending = False
        if self._mirror is not None and not self._advance(self._mirror):
            self._mirror = None  # it fell more than the ring behind: the next reader rebuilds it
        for reader in self._readers.copy():
            reader.ready.set()

    async def open_reader(self, visible: Callable[[str], bool] | None = None) -> EventReader:
        """A new reader; its first `next()` is the snapshot. With `visible`, it sees only the
        namespaces whose ids pass it (see the module docstring)."""
        self._loop = asyncio.get_running_loop()
        reader = EventReader(self, visible)
        self._readers.add(reader)
        try:
            await reader.resync()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await reader.close()
            raise
        return reader

    def close(self) -> None:
        """Ends every reader's stream (the server is stopping)."""
        self.closed = True
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        if self._building is not None:
            self._building.future.cancel()
        for reader in self._readers.copy():
            reader.ready.set()

    def _take(self, cursor: int) -> tuple[list[tuple[int, bytes, Any]] | None, int]:
        """Events (seq, encoded, event) from ring position `cursor` on and the new cursor;
        None if some were lost."""
        with self._lock:
            start = self._end - len(self._ring)
            if cursor < start:
                return None, cursor
            return list(islice(self._ring, cursor - start, None)), self._end

    def _skip_unseen(self, cursor: int, visible: Callable[[str], bool]) -> int | None:
        """For a reader at `cursor` that lost events: the ring's start, when every event lost
        between them is one `visible` hides (it may skip them unseen); None otherwise."""
        with self._lock:
            start = self._end - len(self._ring)
            if cursor < self._forgotten:
                return None
            dropped = []  # newest position last: stop at the first one before the cursor
            for key, position in reversed(self._dropped.items()):
                if position < cursor:
                    break
                dropped.append(key)
        if any(key is None or visible(key) for key in dropped):
            return None
        return start

    def _advance(self, mirror: PageMirror) -> bool:
        """Applies the events `mirror` has not seen; False if it cannot (events were lost, or
        the hub unsubscribed since it was made)."""
        with self._lock:
            start = self._end - len(self._ring)
            if mirror.generation != self._generation or mirror.cursor < start:
                return False
            events = [event for _, _, event in islice(self._ring, mirror.cursor - start, None)]
            mirror.cursor = self._end
        mirror.apply(events)
        return True

    async def current_mirror(self) -> PageMirror:
        """The device pages the cache holds and the ring position that follows them: kept
        up to date from the events, built from a sliced copy of the tree only when there is
        none (the first reader, or after events were lost). Concurrent callers share one build;
        it is dropped when all of them have left."""
        mirror = self._mirror
        if mirror is not None and self._advance(mirror):
            return mirror
        self._mirror = None
        if self._building is None:
            build = asyncio.ensure_future(self._build())
            build.add_done_callback(self._built)
            self._building = SharedWork(build)
        return await self._building.wait()

    async def _build(self) -> PageMirror:
        page_size = self.engine.engine.page_size
        while True:
            (cursor, seq, generation), pages = await self.engine.run_sliced(self._copy_work)
            mirror = PageMirror(pages, seq=seq, cursor=cursor, generation=generation, page_size=page_size)
            self.builds += 1
            if self._advance(mirror):
                return mirror
            # More events than the ring holds came while copying: copy again.

    def _built(self, task: asyncio.Future[PageMirror]) -> None:
        if self._building is not None and self._building.future is task:
            self._building = None
        if not task.cancelled() and task.exception() is None:
            self._mirror = task.result()


class PageMirror:
    """The pages the cache held after event `seq`, per tier and namespace id, and the ring
    position of the next event; advanced on the event loop by applying events. Its snapshot
    message is encoded once per `seq` and shared by every reader that starts there."""

    def __init__(self, pages: dict[str, dict[str, set[int]]], *, seq: int, cursor: int, generation: int,
                 page_size: int) -> None:
        self.pages = pages
        self.seq = seq
        self.cursor = cursor
        self.generation = generation
        self.page_size = page_size
        self._encoded: tuple[int, bytes] | None = None

    def apply(self, events: list[Any]) -> None:
        """Applies events in order: stored and removed pages, and clears."""
        for event in events:
            if isinstance(event, AllCleared):
                for tier, spaces in self.pages.items():
                    if event.tier in (None, tier):
                        spaces.clear()
            elif isinstance(event, BlockStored):
                self.pages.setdefault(event.tier, {}).setdefault(event.namespace, set()).update(event.hashes)
            elif isinstance(event, BlockRemoved):
                spaces = self.pages.get(event.tier, {})
                held = spaces.get(event.namespace)
                if held is not None:
                    held.difference_update(event.hashes)
                    if not held:
                        del spaces[event.namespace]
            self.seq = event.seq

    def encoded(self, encoder: msgspec.json.Encoder) -> bytes:
        """The snapshot message of the current state (sorted, so equal states encode equally)."""
        if self._encoded is None or self._encoded[0] != self.seq:
            self._encoded = (self.seq, self.encoded_for(encoder, None, self.seq))
        return self._encoded[1]

    def encoded_for(self, encoder: msgspec.json.Encoder, visible: Callable[[str], bool] | None,
                    seq: int) -> bytes:
        """The snapshot message of the namespaces that pass `visible` (None: all), numbered `seq`."""
        blocks = [SnapshotBlock(namespace=ns, tier=tier, hashes=sorted(hashes))
                  for tier, spaces in sorted(self.pages.items())
                  for ns, hashes in sorted(spaces.items()) if hashes and (visible is None or visible(ns))]
        return encoder.encode(StreamSnapshot(seq=seq, page_size=self.page_size, blocks=blocks))


class EventReader:
    """One reader's position in the hub's ring. `next()` returns encoded messages in order;
    with `visible`, only those of the namespaces it passes (module docstring)."""

    def __init__(self, hub: CacheEventHub, visible: Callable[[str], bool] | None = None) -> None:
        self.hub = hub
        self.visible = visible
        self.cursor = 0
        self.last_seq = 0  # the seq of the last message it was given (its own numbers, with `visible`)
        self.ready = asyncio.Event()
        self._pending: list[bytes] = []
        self.resets = 0

    async def resync(self) -> None:
        """Queues the current snapshot and places the cursor at the event that follows it."""
        mirror = await self.hub.current_mirror()
        self.cursor = mirror.cursor
        if self.visible is None:
            self.last_seq = mirror.seq
            self._pending = [mirror.encoded(self.hub._encoder)]
        else:
            self._pending = [mirror.encoded_for(self.hub._encoder, self.visible, self.last_seq)]

    async def next(self, timeout: float | None = None) -> list[bytes] | None:
        """The next messages (encoded JSON), waiting up to `timeout` seconds ([] when it
        passes). None once the hub is closed. After lost events: a reset, then a snapshot."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            if self._pending:
                out, self._pending = self._pending, []
                return out
            if self.hub.closed:
                return None
            self.ready.clear()
            events, cursor = self.hub._take(self.cursor)
            if events is None and self.visible is not None:
                skipped = self.hub._skip_unseen(self.cursor, self.visible)
                if skipped is not None:  # it lost only what it may not see: nothing to tell it
                    self.cursor = skipped
                    continue
            if events is None:
                self.resets += 1
                reset = self.hub._encoder.encode(StreamReset(seq=self.last_seq, buffer=self.hub.capacity))
                await self.resync()
                self._pending.insert(0, reset)
                continue
            if events:
                self.cursor = cursor
                shown = self._shown(events)
                if shown:
                    return shown
                continue  # none it may see: wait on, as if nothing had happened
            try:
                await asyncio.wait_for(self.ready.wait(), None if deadline is None else max(0.0, deadline - loop.time()))
            except TimeoutError:
                return []

    def _shown(self, events: list[tuple[int, bytes, Any]]) -> list[bytes]:
        """The messages of `events` this reader is given, renumbered with `visible`."""
        if self.visible is None:
            self.last_seq = events[-1][0]
            return [data for _, data, _ in events]
        out = []
        for _, _, event in events:
            if isinstance(event, AllCleared) or self.visible(event.namespace):
                self.last_seq += 1
                out.append(self.hub._encoder.encode(msgspec.structs.replace(event, seq=self.last_seq)))
        return out

    async def close(self) -> None:
        """Leaves the hub; the last reader out unsubscribes it (on the engine thread), at
        once or, with the hub's `linger_s`, if no reader has come by then."""
        self.hub._readers.discard(self)
        if self.hub.linger_s:
            self.hub._linger()
        elif not self.hub.closed and not self.hub._readers:
            await self.hub.engine.call(self.hub._unsubscribe_if_idle)
