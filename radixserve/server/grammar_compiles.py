"""Where a request's grammar is compiled before the engine sees it: a worker thread, in turn.

The server (and each cluster replica) compiles a request's grammar on the request's way in, so
that a large schema neither holds the event loop nor stalls the engine's step (the engine then
finds it cached). A compile runs in a worker thread that nobody can stop, so they are bounded:
without a bound of their own a crowd of slow ones would take every thread of the pool that
tokenizes other requests' prompts. The bounded slots go round the tenants (`FairSlots`), and
a spec compiled already takes none.
"""

from __future__ import annotations

from collections.abc import Hashable

import anyio

from radixserve.grammar import GrammarSpec
from radixserve.grammar.compiled import Grammars
from radixserve.server.fair_slots import FairSlots

GRAMMAR_COMPILES = 4  # grammar compiles at once, all requests together


class GrammarCompiles:
    """Compiles specs in worker threads, `slots` at once, the slots shared fairly between tenants."""

    def __init__(self, slots: int = GRAMMAR_COMPILES) -> None:
        self.slots = FairSlots(slots)
        self._threads = anyio.CapacityLimiter(slots)  # threads of their own: no queue behind other work

    async def compile(self, grammars: Grammars, spec: GrammarSpec, param: str, tenant: Hashable) -> None:
        """Compiles `spec` (into `grammars`' cache) for `tenant`'s request, unless it is compiled
        already; GrammarError naming `param` when it cannot be."""
        if grammars.is_cached(spec):
            return
        async with self.slots.hold(tenant):
            await anyio.to_thread.run_sync(grammars.compile, spec, param, limiter=self._threads)
