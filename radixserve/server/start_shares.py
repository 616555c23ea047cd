"""Each tenant's share of the requests the server starts at once, while several have requests
in flight.

A request costs the server most before its first token: its body decoded, its prompt rendered
and tokenized, its checks, its admission and prefill, and each step it joins grows with its
rows. One client looping cheap requests from many connections (one-token answers to a
one-character prompt, 32 at once) was answered 170 times a second on 2 cores, and another
client's 32-token chats went from 31 to 7 in 20 s: fair share (engine/fair_share.py) orders
the engine's queue, but that client's requests were in every stage of the server at once.
Held to 4 starting at a time (the CPU default, 8, between two tenants), it left the other
18-19 (bench/refusal_flood.py --flood valid).

So while requests of two or more tenants are in flight, each tenant may have at most
`limit // tenants` (at least one) of its requests *starting*: from the read of its body to
its first output (or its end). Its further requests wait, in order, before their bodies are
decoded; a tenant's requests already streaming tokens do not count against it, so a client's
long generations go on, and only how fast it starts new ones is shared. A tenant alone is
never held, so a single client keeps its whole batch. Tenants are `share_key`s (an API key's
tenant, else the client's address).

Event-loop only (no locks): every method runs on the event loop.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable
from typing import Any

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

SLOT_SCOPE_KEY = "radixserve.start_slot"  # where a request's slot lives in its ASGI scope
# The limit where the engine runs on a CPU (bench/refusal_flood.py --flood valid); elsewhere
# none by default: a GPU's step barely grows with its rows, and prefills batch well there.
DEFAULT_CPU_TENANT_STARTS = 8


class StartSlot:
    """One request's place among its tenant's requests in flight (`StartShares.join`):
    `wait()` until it may start, `started()` once its first output is in (its start then goes
    to the tenant's next request), `leave()` at its end."""

    __slots__ = ("_event", "_shares", "granted", "left", "share", "starting")

    def __init__(self, shares: StartShares, share: Hashable) -> None:
        self._shares = shares
        self._event = anyio.Event()
        self.share = share
        self.granted = False  # may start (its wait is over, or it had none)
        self.starting = False  # counted among its tenant's starting requests
        self.left = False

    async def wait(self) -> StartSlot:
        """Returns (itself) once it may start."""
        await self._event.wait()
        return self

    def started(self) -> None:
        """Its first output is in: it no longer counts among its tenant's starting requests."""
        if self.starting:
            self.starting = False
            self._shares._stop_starting(self.share)

    def leave(self) -> None:
        """Its response ended (or it gave up waiting). Idempotent."""
        if not self.left:
            self.left = True
            self._shares._leave(self)


class StartShares:
    """The requests in flight per tenant, and the gate of their starts (see the module
    docstring). `limit` 0: nobody waits (the slots are still counted, for the metrics)."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"limit: must be >= 0 (0: no limit), got {limit}")
        self.limit = limit
        self.in_flight: Counter[Hashable] = Counter()
        self.starting: Counter[Hashable] = Counter()
        self._waiting: dict[Hashable, deque[StartSlot]] = {}
        self.waited = 0  # requests that waited for their tenant's share (a counter, for metrics)

    @property
    def waiting(self) -> int:
        """Requests waiting for their tenant's share of starts now."""
        return sum(len(queue) for queue in self._waiting.values())

    def share_of_starts(self) -> int | None:
        """How many requests each tenant may be starting at once now; None: no limit."""
        tenants = len(self.in_flight)
        if not self.limit or tenants < 2:
            return None
        return max(1, self.limit // tenants)

    def join(self, share: Hashable) -> StartSlot:
        """A slot for a request of `share`, counted in flight from now: granted (it may start)
        or queued behind its tenant's earlier requests (`await slot.wait()`). Leave it at the
        request's end in any case (`LeaveAtResponseEnd`), which also takes it out of the queue."""
        slot = StartSlot(self, share)
        self.in_flight[share] += 1
        if share not in self._waiting and self._may_start(share):
            self._grant(slot)
        else:
            self._waiting.setdefault(share, deque()).append(slot)
            self.waited += 1
        return slot

    def _may_start(self, share: Hashable) -> bool:
        allowed = self.share_of_starts()
        return allowed is None or self.starting[share] < allowed

    def _grant(self, slot: StartSlot) -> None:
        slot.granted = slot.starting = True
        self.starting[slot.share] += 1
        slot._event.set()

    def _stop_starting(self, share: Hashable) -> None:
        self.starting[share] -= 1
        if not self.starting[share]:
            del self.starting[share]
        self._wake(share)

    def _leave(self, slot: StartSlot) -> None:
        share = slot.share
        if slot.starting:
            slot.starting = False
            self.starting[share] -= 1
            if not self.starting[share]:
                del self.starting[share]
        elif not slot.granted:  # gave up waiting
            queue = self._waiting[share]
            queue.remove(slot)
            if not queue:
                del self._waiting[share]
        self.in_flight[share] -= 1
        if not self.in_flight[share]:
            del self.in_flight[share]
            self._wake_all()  # one tenant fewer: the others' shares may grow
        else:
            self._wake(share)

    def _wake(self, share: Hashable) -> None:
        queue = self._waiting.get(share)
        while queue and self._may_start(share):
            self._grant(queue.popleft())
        if queue is not None and not queue:
            del self._waiting[share]

    def _wake_all(self) -> None:
        for share in list(self._waiting):
            self._wake(share)


def default_tenant_starts(engine: Any) -> int:
    """The limit for a server over `engine` (an AsyncEngine, or a cluster's engine, whose
    `engine` has no device): DEFAULT_CPU_TENANT_STARTS on a CPU, else 0 (none)."""
    device = getattr(getattr(engine, "engine", None), "device", None)
    return DEFAULT_CPU_TENANT_STARTS if getattr(device, "type", None) == "cpu" else 0


class LeaveAtResponseEnd:
    """ASGI middleware: a request's start slot (`SLOT_SCOPE_KEY`, put there by its handler) is
    left once the app has answered it, streamed to its end or cut short by a disconnect: the
    one place every request's end passes through (a streamed response outlives its handler)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            slot = scope.get(SLOT_SCOPE_KEY)
            if slot is not None:
                slot.leave()
