"""A request's output on its way from the engine thread to its reader, bounded (backpressure).

The engine thread hands each step's deltas to the request's `OutputBuffer` on the asyncio
loop. The buffer counts the tokens delivered but not yet taken by the reader. When that
passes `limit`, it calls `pause` (AsyncEngine asks the engine to stop scheduling the
request, engine/paused.py) and arms a timer of `read_timeout_s`; when the reader has taken
enough that at most half of `limit` is left, it calls `resume` and disarms the timer. If the
timer fires first, `on_timeout` aborts the request. So a client that stops reading costs at
most `limit` tokens (plus one step's deltas) of memory and no engine time, whatever it does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from radixserve.engine.params import StreamDelta


def delta_tokens(items: list[StreamDelta]) -> int:
    """What a batch of deltas weighs in the buffer: its tokens, at least one per delta."""
    return sum(max(1, len(delta.token_ids)) for delta in items)


class OutputBuffer:
    """One request's undelivered deltas and its backpressure state; event loop only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, limit: int, read_timeout_s: float,
                 pause: Callable[[], None], resume: Callable[[], None],
                 on_timeout: Callable[[], None]) -> None:
        self.queue: asyncio.Queue[list[StreamDelta]] = asyncio.Queue()
        self.buffered = 0  # tokens put but not taken
        self.paused = False
        self._loop = loop
        self._limit = limit
        self._read_timeout_s = read_timeout_s
        self._pause, self._resume, self._on_timeout = pause, resume, on_timeout
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    def put(self, items: list[StreamDelta]) -> None:
        """Adds a step's deltas; pauses the request once more than `limit` tokens wait. After
        `close` nothing: a delivery already on its way to the loop must not pause a request
        nobody reads (nor arm a read timeout for it)."""
        if self.closed:
            return
        self.queue.put_nowait(items)
        self.buffered += delta_tokens(items)
        if self.buffered > self._limit and not self.paused:
            self.paused = True
            self._pause()
            self._timer = self._loop.call_later(self._read_timeout_s, self._timed_out)

    async def get(self) -> list[StreamDelta]:
        """The next step's deltas; resumes the request once at most half of `limit` waits."""
        items = await self.queue.get()
        self.buffered -= delta_tokens(items)
        if self.paused and self.buffered <= self._limit // 2:
            self.paused = False
            self._disarm()
            self._resume()
        return items

    def close(self) -> None:
        """The reader is gone: no timer may fire for it, and nothing more is kept."""
        self.closed = True
        self._disarm()

    def _timed_out(self) -> None:
        self._timer = None
        self._on_timeout()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
