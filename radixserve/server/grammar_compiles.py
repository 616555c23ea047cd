"""Where a request's grammar is compiled before the engine sees it: a worker thread, in turn.

The server (and each cluster replica) compiles a request's grammar on the request's way in, so
that a large schema neither holds the event loop nor stalls the engine's step (the engine then
finds it cached). A compile waits in a worker thread for its compile process (one that a
CPU-time limit stops: grammar/compile_workers.py), so they are bounded: without a bound of
their own a crowd of slow ones would take every thread of the pool that tokenizes other
requests' prompts. The bounded slots go round the tenants, or client addresses without keys
(`FairSlots`, the last one kept for one that holds none), and a spec compiled already takes
none. Nor does a spec being compiled for another request: an agent client's first wave of
requests, all with the same new tools, waits for one compile instead of each taking a slot
for its own (specs are scoped per tenant and salt, so only requests that could share the
compiled grammar share its compile).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

import anyio

from radixserve.grammar import GrammarSpec
from radixserve.grammar.compiled import Grammars
from radixserve.server.fair_slots import FairSlots

if TYPE_CHECKING:
    import xgrammar

GRAMMAR_COMPILES = 4  # grammar compiles at once, all requests together


class _Compile:
    """One compile in flight: `done` is set when it ends, `failed` says whether it cached nothing."""

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.failed = False


class GrammarCompiles:
    """Compiles specs in worker threads, `slots` at once, the slots shared fairly between tenants."""

    def __init__(self, slots: int = GRAMMAR_COMPILES) -> None:
        # One slot kept for tenants compiling nothing: a compile may run up to its timeout
        # (grammar/compile_workers.py), and a tenant's slow ones would hold every slot meanwhile.
        self.slots = FairSlots(slots, reserve=1 if slots > 1 else 0)
        self._threads = anyio.CapacityLimiter(slots)  # threads of their own: no queue behind other work
        self._in_flight: dict[tuple[int, GrammarSpec], _Compile] = {}
        self._queued: dict[tuple[int, GrammarSpec], set[anyio.CancelScope]] = {}  # waiting for a slot

    async def compile(self, grammars: Grammars, spec: GrammarSpec, param: str,
                      tenant: Hashable) -> xgrammar.CompiledGrammar:
        """Compiles `spec` (into `grammars`' cache) for `tenant`'s request, unless it is compiled
        already or being compiled (then waits for that), and returns it: the caller holds it
        until the engine has the request, so that the engine finds it whatever the cache
        evicted meanwhile (Grammars.cached). GrammarError naming `param` when it cannot be.
        A spec refused before is refused again at once, without a slot. A compile counts as
        being compiled only once it holds its slot: one queued behind its tenant's other
        compiles must not hold another tenant's request of the same spec back with it (a
        client's flood of slow specs, then a popular one). A compile that failed or was given
        up is not shared: its waiters then compile for themselves (a refusal answers them from
        the cache), side by side within the slots, so that each request gets its own error,
        naming its own parameter."""
        grammars.raise_if_refused(spec, param)
        key = (id(grammars), spec)
        while (compiled := grammars.cached(spec)) is None:
            running = self._in_flight.get(key)
            if running is not None:
                await running.done.wait()
                if running.failed:
                    grammars.raise_if_refused(spec, param)
                    async with self.slots.hold(tenant):  # not registered: not shared
                        return await self._in_thread(grammars, spec, param)
                continue
            # Queued for a slot until it gets one or another request starts this spec's
            # compile (then it waits for that instead of for its turn: `_start`).
            with anyio.CancelScope() as queued:
                self._queued.setdefault(key, set()).add(queued)
                try:
                    async with self.slots.hold(tenant):
                        self._unqueue(key, queued)
                        if grammars.is_cached(spec) or key in self._in_flight:
                            continue  # compiled, or started, while this waited for its turn: take that
                        return await self._start(key, grammars, spec, param)
                finally:
                    self._unqueue(key, queued)
        return compiled

    async def _start(self, key: tuple[int, GrammarSpec], grammars: Grammars, spec: GrammarSpec,
                     param: str) -> xgrammar.CompiledGrammar:
        """Compiles `spec` in a slot the caller holds, shared with requests of the same spec."""
        mine = self._in_flight[key] = _Compile()
        for queued in self._queued.pop(key, ()):
            queued.cancel()
        try:
            return await self._in_thread(grammars, spec, param)
        except BaseException as exc:
            # Cancelled before its thread ran (the client left): nothing failed, and
            # one of its waiters takes the compile over rather than each running it.
            mine.failed = not isinstance(exc, anyio.get_cancelled_exc_class())
            raise
        finally:
            del self._in_flight[key]
            mine.done.set()

    def _unqueue(self, key: tuple[int, GrammarSpec], queued: anyio.CancelScope) -> None:
        waiting = self._queued.get(key)
        if waiting is not None:
            waiting.discard(queued)
            if not waiting:
                del self._queued[key]

    async def _in_thread(self, grammars: Grammars, spec: GrammarSpec, param: str) -> xgrammar.CompiledGrammar:
        return await anyio.to_thread.run_sync(grammars.compile, spec, param, limiter=self._threads)
