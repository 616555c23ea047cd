"""One piece of work awaited by many callers, and stopped when the last of them leaves."""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

_T = TypeVar("_T")


class SharedWork(Generic[_T]):
    """A future that any number of callers `wait()` for together (a view's tree copy, a page
    mirror's build): a caller that leaves does not cancel it for the others, and when every
    caller has left before it is done, it is cancelled (a closed client's work stops)."""

    def __init__(self, future: asyncio.Future[_T]) -> None:
        self.future = future
        self._waiters = 0
        self.stopped = False  # cancelled as its last caller left: a newcomer must start anew

    async def wait(self) -> _T:
        """The work's result, shared with every other caller."""
        self._waiters += 1
        try:
            return await asyncio.shield(self.future)
        finally:
            self._waiters -= 1
            if not self._waiters and not self.future.done():
                # A task is done only once it has run its cancellation; till then a newcomer
                # that joined it would get its CancelledError.
                self.stopped = True
                self.future.cancel()  # no one waits any more: sliced work stops before its next piece
