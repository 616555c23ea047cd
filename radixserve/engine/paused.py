"""Requests held out of scheduling because their client stopped reading (backpressure).

The asyncio side (AsyncEngine) bounds what each request may have delivered but not yet
read; past that bound it asks the engine to pause the request. Pausing is a preemption
(`Scheduler.preempt`): the request's computed full pages go to the tree as cache, its
sequences leave the running and waiting queues and are held here, so they take no slot,
no page and no step. Resuming puts them back in the waiting queue, where they are admitted
like any preempted sequence (their prefix is a cache hit, the rest is recomputed), so the
output is the one an unpaused run produces. A paused request that ends (an abort) is
simply forgotten: it holds nothing.
"""

from __future__ import annotations

from radixserve.engine.request import Request, SequenceState
from radixserve.engine.scheduler import Scheduler


class PausedRequests:
    """The sequences of paused requests, per request id, outside the scheduler's queues."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._held: dict[str, list[SequenceState]] = {}
        self.pauses = 0  # requests paused so far (a counter for stats)

    def pause(self, req: Request) -> bool:
        """Preempts `req`'s running sequences and holds all of its queued ones; False if it
        was paused already or is a beam search (whose output comes only at its end)."""
        if req.request_id in self._held or req.beam is not None:
            return False
        for seq in [s for s in self.scheduler.running if s.request is req]:
            self.scheduler.preempt(seq)
        held = [s for s in self.scheduler.waiting if s.request is req]
        for seq in held:
            self.scheduler.waiting.remove(seq)
        self._held[req.request_id] = held
        self.pauses += 1
        return True

    def resume(self, request_id: str) -> None:
        """Puts a paused request's sequences back in the waiting queue (a no-op if not paused)."""
        self.scheduler.waiting.extend(self._held.pop(request_id, ()))

    def forget(self, request_id: str) -> None:
        """Drops a request that ended while paused (its sequences hold no page)."""
        self._held.pop(request_id, None)

    @property
    def num_sequences(self) -> int:
        """Sequences held (what stats report as `paused`)."""
        return sum(len(held) for held in self._held.values())
