"""A fixed number of slots shared fairly between tenants (the server's grammar compiles and its
JSON Schema checks).

A plain FIFO limiter lets one tenant's queue of slow jobs stand in front of every other
tenant's: a flood of 24 schemas that take two seconds each delays another tenant's one
compile by the whole flood. Here each tenant waits in its own FIFO, and a freed slot goes to
the waiting tenant that holds the fewest slots, among equals the one served longest ago (its
last slot granted or given back; so tenants take turns even with one slot, where every
waiting tenant holds none when it frees), so another tenant waits for one job to finish,
never for a flood. A tenant that holds and waits for nothing is forgotten (state only for the
tenants active now: without keys a tenant is a client address), and one not served since it
came ranks by when it came: a stream of new addresses does not go before a client that came
first.

With `reserve`, the last `reserve` free slots go only to tenants that hold none: where each
job may take long (a grammar compile, up to its timeout), one tenant's jobs would otherwise
hold every slot and another's wait for one of them to end, however fairly it is queued. The
price: a tenant alone gets `slots - reserve` at once.
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

    def __init__(self, slots: int, reserve: int = 0) -> None:
        if slots < 1 or not 0 <= reserve < slots:
            raise ValueError(f"FairSlots: at least one slot and 0 <= reserve < slots, got {slots}, {reserve}")
        self.slots = slots
        self.reserve = reserve
        self._free = slots
        self._held: Counter[Hashable] = Counter()
        self._served: dict[Hashable, int] = {}  # when each active tenant last took or gave back a slot (a count)
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
        if not self._waiting and self._may_take(tenant):
            self._take(tenant)
        else:
            waiter = _Waiter(next(self._order))
            self._waiting.setdefault(tenant, deque()).append(waiter)
            self._grant()  # a free slot that others may not take (the reserve) may be this tenant's
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

    def _may_take(self, tenant: Hashable) -> bool:
        return self._free > (self.reserve if self._held[tenant] else 0)

    def _take(self, tenant: Hashable) -> None:
        self._free -= 1
        self._held[tenant] += 1
        self._served[tenant] = next(self._order)

    def _release(self, tenant: Hashable) -> None:
        self._free += 1
        self._held[tenant] -= 1
        self._served[tenant] = next(self._order)
        if not self._held[tenant]:
            del self._held[tenant]
            self._forget_if_idle(tenant)
        self._grant()

    def _leave(self, tenant: Hashable, waiter: _Waiter) -> None:
        queue = self._waiting[tenant]
        queue.remove(waiter)
        if not queue:
            del self._waiting[tenant]
            self._forget_if_idle(tenant)

    def _forget_if_idle(self, tenant: Hashable) -> None:
        if tenant not in self._held and tenant not in self._waiting:
            self._served.pop(tenant, None)

    def _rank(self, tenant: Hashable) -> tuple[int, int, int]:
        """Fewest slots held first; among equals, the longest since it was last served, or
        since it came if it was not served since (both stamps count on one clock: `_order`)."""
        first_waiting = self._waiting[tenant][0].order
        return self._held[tenant], self._served.get(tenant, first_waiting), first_waiting

    def _grant(self) -> None:
        while self._free and self._waiting:
            tenant = min(self._waiting, key=self._rank)
            if not self._may_take(tenant):  # it holds fewest: none of the others may either
                return
            waiter = self._waiting[tenant].popleft()
            if not self._waiting[tenant]:
                del self._waiting[tenant]
            self._take(tenant)
            waiter.granted = True
            waiter.event.set()
