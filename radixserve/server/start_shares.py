"""Each tenant's share of the requests the server starts at once, while several have requests
in flight.

A request costs the server most before its first token: its body decoded, its prompt rendered
and tokenized, its checks, its admission and prefill, and each step it joins grows with its
rows. One client looping cheap requests from many connections (one-token answers to a
one-character prompt, 32 at once) was answered 170 times a second on 2 cores, and another
client's 32-token chats went from 31-33 to 7 in 20 s: fair share (engine/fair_share.py)
orders the engine's queue, but that client's requests were in every stage of the server at
once. Held to 4 starting at a time (the CPU default), it left the other 23
(bench/refusal_flood.py --flood valid).

So while requests of two or more tenants are in flight, each tenant may have at most
`limit // contending` (at least one) of its requests *starting*: from the read of its body to
its first output (or its end), `contending` being the tenants with requests not yet started.
Its further requests wait, in order, before their bodies are decoded. A tenant's requests
already streaming tokens do not count against it, so a client's long generations go on and
only how fast it starts new ones is shared; and a tenant whose requests all stream takes no
part of the limit, yet is protected by it (a flood beside its stream starts `limit` at most).
A tenant alone is never held, so a single client keeps its whole batch. Tenants are `share_key`s (an API key's
tenant, else the client's address).

Event-loop only (no locks): every method runs on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

SLOT_SCOPE_KEY = "radixserve.start_slot"  # where a request's slot lives in its ASGI scope
# The limit where the engine runs on a CPU (bench/refusal_flood.py --flood valid); elsewhere
# none by default: a GPU's step barely grows with its rows, and prefills batch well there.
DEFAULT_CPU_TENANT_STARTS = 4
# How long a tenant still counts as in flight after its last request ended: a client's think
# time between requests (an attack round: a flood's queue started whole in that gap, the
# other's chats 0.96 a second, 1.10 with half a second of grace).
GRACE_S = 0.5


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
            self._shares._started(self)

    def leave(self) -> None:
        """Its response ended (or it gave up waiting). Idempotent."""
        if not self.left:
            self.left = True
            self._shares._leave(self)


class StartShares:
    """The requests in flight per tenant, and the gate of their starts (see the module
    docstring). `limit` 0: nobody waits (the slots are still counted, for the metrics)."""

    def __init__(self, limit: int, *, grace_s: float = GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        if limit < 0:
            raise ValueError(f"limit: must be >= 0 (0: no limit), got {limit}")
        self.limit = limit
        self.grace_s = grace_s
        self.clock = clock
        self.in_flight: Counter[Hashable] = Counter()
        # Tenants whose last request ended within `grace_s`, and when: still counted as in
        # flight, so that a client sending one request after another does not leave a flood
        # alone (and its whole queue started) between them.
        # (An OrderedDict: its oldest entry is found in O(1) after deletions at the front,
        # where a dict's iteration skips every deleted slot: 100,000 graces ending took 2.5 s.)
        self._between: OrderedDict[Hashable, float] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None
        self.starting: Counter[Hashable] = Counter()
        # Requests in flight and not yet started (waiting or starting) per tenant: the tenants
        # here split the limit; one whose requests all stream tokens takes no part of it.
        self.unstarted: Counter[Hashable] = Counter()
        # Each tenant's waiting requests in arrival order: an OrderedDict of slots, so that one
        # given up leaves in O(1) (a deque's remove was O(queue): 10,000 leaving took 0.5 s).
        self._waiting: dict[Hashable, OrderedDict[StartSlot, None]] = {}
        self.waited = 0  # requests that waited for their tenant's share (a counter, for metrics)

    @property
    def waiting(self) -> int:
        """Requests waiting for their tenant's share of starts now."""
        return sum(len(queue) for queue in self._waiting.values())

    def share_of_starts(self) -> int | None:
        """How many requests each tenant with requests not yet started may be starting at once
        now: the limit split equally between those tenants, at least one; None (no limit)
        while only one tenant has requests in flight (or had, within `grace_s`)."""
        if not self.limit or len(self.in_flight) + len(self._between) < 2:
            return None
        return max(1, self.limit // max(1, len(self.unstarted)))

    def end_of_grace(self) -> None:
        """Forgets the tenants whose grace is over, and grants what their going frees; then
        sets the timer for the next (run by that timer on the event loop; tests call it)."""
        self._timer = None
        now = self.clock()
        over = None
        while self._between:  # oldest first: a tenant's entry is put last each time it leaves
            share, left = next(iter(self._between.items()))
            if now - left < self.grace_s:
                self._set_timer(left + self.grace_s - now)
                break
            del self._between[share]
            over = share
        if over is not None:
            self._wake_after(True, over)

    def _set_timer(self, delay_s: float) -> None:
        """One timer at most: for the oldest grace (a moment late, never early)."""
        if self._timer is None:
            self._timer = _call_later(delay_s + 0.001, self.end_of_grace)

    def join(self, share: Hashable) -> StartSlot:
        """A slot for a request of `share`, counted in flight from now: granted (it may start)
        or queued behind its tenant's earlier requests (`await slot.wait()`). Leave it at the
        request's end in any case (`LeaveAtResponseEnd`), which also takes it out of the queue."""
        slot = StartSlot(self, share)
        self._between.pop(share, None)
        self.in_flight[share] += 1
        self.unstarted[share] += 1
        if share not in self._waiting and self._may_start(share):
            self._grant(slot)
        else:
            self._waiting.setdefault(share, OrderedDict())[slot] = None
            self.waited += 1
        return slot

    def _may_start(self, share: Hashable) -> bool:
        allowed = self.share_of_starts()
        return allowed is None or self.starting[share] < allowed

    def _grant(self, slot: StartSlot) -> None:
        slot.granted = slot.starting = True
        self.starting[slot.share] += 1
        slot._event.set()

    def _started(self, slot: StartSlot) -> None:
        self._wake_after(self._unstart(slot), slot.share)

    def _unstart(self, slot: StartSlot) -> bool:
        """Takes a slot not yet started (starting, or waiting: its client gave up) out of the
        counts; True when its tenant has nothing left to start (it leaves the split)."""
        share = slot.share
        if slot.starting:
            slot.starting = False
            _take_one(self.starting, share)
        else:
            queue = self._waiting[share]
            del queue[slot]
            if not queue:
                del self._waiting[share]
        return _take_one(self.unstarted, share)

    def _leave(self, slot: StartSlot) -> None:
        share = slot.share
        tenants_fewer = self._unstart(slot) if slot.starting or not slot.granted else False
        if _take_one(self.in_flight, share):
            if self.limit and self.grace_s > 0:  # it counts a while longer (`_between`)
                self._between[share] = self.clock()
                self._set_timer(self.grace_s)
            else:
                tenants_fewer = True
        self._wake_after(tenants_fewer, share)

    def _wake_after(self, tenants_fewer: bool, share: Hashable) -> None:
        """Grants what a start freed: `share`'s next, or everyone's where a tenant left the
        split (the others' shares may have grown)."""
        if tenants_fewer:
            for each in list(self._waiting):
                self._wake(each)
        else:
            self._wake(share)

    def _wake(self, share: Hashable) -> None:
        queue = self._waiting.get(share)
        while queue and self._may_start(share):
            self._grant(queue.popitem(last=False)[0])
        if queue is not None and not queue:
            del self._waiting[share]


def _call_later(delay_s: float, callback: Callable[[], None]) -> asyncio.TimerHandle | None:
    """`callback` after `delay_s` on the running event loop (None outside one: tests)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later(delay_s, callback)


def _take_one(counts: Counter[Hashable], key: Hashable) -> bool:
    """Counts one fewer of `key`; True when that was its last (it is then dropped)."""
    counts[key] -= 1
    if counts[key]:
        return False
    del counts[key]
    return True


def default_tenant_starts(engine: Any) -> int:
    """The limit for a server over `engine` (an AsyncEngine, or a cluster's engine, whose
    `engine` is a replica's ReplicaInfo, device included): DEFAULT_CPU_TENANT_STARTS on a CPU,
    else 0 (none)."""
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
