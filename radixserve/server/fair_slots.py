"""A fixed number of slots shared fairly between tenants (the server's grammar compiles and its
JSON Schema checks).

A plain FIFO limiter lets one tenant's queue of slow jobs stand in front of every other
tenant's: a flood of 24 schemas that take two seconds each delays another tenant's one
compile by the whole flood. Here each tenant waits in its own FIFO, and a freed slot goes to
the waiting tenant that holds the fewest slots, among equals the one granted a slot longest
ago (so tenants take turns even with one slot, where every waiting tenant holds none when it
frees), so another tenant waits for one job to finish, never for a flood.
"""

from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import AsyncIterator, Hashable
from contextlib import asynccontextmanager

import anyio


class _Waiter:
    __slots__ = ("event", "granted", "order")

    def __init__(self, order: int) -> None:
        self.event = anyio.Event()
        self.granted = False
        self.order = order


class FairSlots:
    """`slots` holders at once, handed out tenant by tenant (see the module docstring).
    Event-loop only (no locks): every method runs on the loop that awaits `hold`."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"FairSlots: at least one slot, got {slots}")
        self.slots = slots
        self._free = slots
        self._held: Counter[Hashable] = Counter()
        self._granted: dict[Hashable, int] = {}  # when each tenant was last granted a slot (a count)
        self._waiting: dict[Hashable, deque[_Waiter]] = {}
        self._order = itertools.count()

    def held(self, tenant: Hashable) -> int:
        """Slots `tenant` holds now."""
        return self._held[tenant]

    def waiting(self, tenant: Hashable) -> int:
        """`tenant`'s holders waiting for a slot now."""
        return len(self._waiting.get(tenant, ()))

    @asynccontextmanager
    async def hold(self, tenant: Hashable) -> AsyncIterator[None]:
        """Holds one slot for `tenant` while the block runs; waits for it fairly."""
        if self._free and not self._waiting:
            self._take(tenant)
        else:
            waiter = _Waiter(next(self._order))
            self._waiting.setdefault(tenant, deque()).append(waiter)
            try:
                await waiter.event.wait()
            except BaseException:  # cancelled while waiting: leave the queue, or give back a slot just granted
                if waiter.granted:
                    self._release(tenant)
                else:
                    self._leave(tenant, waiter)
                raise
        try:
            yield
        finally:
            self._release(tenant)

    def _take(self, tenant: Hashable) -> None:
        self._free -= 1
        self._held[tenant] += 1
        self._granted[tenant] = next(self._order)

    def _release(self, tenant: Hashable) -> None:
        self._free += 1
        self._held[tenant] -= 1
        if not self._held[tenant]:
            del self._held[tenant]
        self._grant()

    def _leave(self, tenant: Hashable, waiter: _Waiter) -> None:
        queue = self._waiting[tenant]
        queue.remove(waiter)
        if not queue:
            del self._waiting[tenant]

    def _grant(self) -> None:
        while self._free and self._waiting:
            tenant = min(self._waiting, key=lambda t: (self._held[t], self._granted.get(t, -1),
                                                       self._waiting[t][0].order))
            waiter = self._waiting[tenant].popleft()
            if not self._waiting[tenant]:
                del self._waiting[tenant]
            self._take(tenant)
            waiter.granted = True
            waiter.event.set()
