"""The cache's views for one engine: the bounded tree and a tenant's stats, built off the
engine's critical path from one shared copy of the tree.

The tree is copied in slices between steps (tree_copy.py, at most the engine's view budget
per step, all views together), one copy shared by every view that arrives while it is taken
or while the cache has not changed since, and each view is built from it in slices too; a
view whose callers all left stops, and a copy no one waits for stops. A tenant's views are
built from the copy with every other tenant's namespaces left out (`restrict`).

The HTTP routes (cache_routes.py) use a `CacheViews` of the local engine; a cluster's ingress
uses its replicas' (each replica holds one, cluster/replica.py) and merges their answers.
"""

from __future__ import annotations

import asyncio
from typing import Any

from radixserve import AsyncEngine
from radixserve.cache.page_hash import PageHashing
from radixserve.engine.shared_work import SharedWork
from radixserve.engine.tree_copy import TreeCopy, copy_tree, restrict
from radixserve.engine.tree_snapshot import SnapshotOptions, TreeSnapshot, build_view
from radixserve.server.tenancy import Caller

COPY_REUSE_S = 2.0  # a finished tree copy serves later views this long while the cache is unchanged
# Published stats that move whenever the tree may have changed: a copy is reused only while
# none of them has (lookups and hits, inserts at admission and finish, evictions, locks, flush).
_TREE_VERSION_KEYS = ("cache_lookups", "pages_cached", "pages_locked", "host_pages_cached", "admissions",
                      "requests_finished", "requests_aborted", "preemptions", "sessions_open")
_ADMIN = Caller(tenant=None, admin=True)


class CacheViews:
    """The tree view and a tenant's stats of one local engine (see the module docstring)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._inflight: dict[tuple[SnapshotOptions, Caller], SharedWork[TreeSnapshot]] = {}
        self._copy: tuple[tuple[Any, ...], float, TreeCopy] | None = None  # (version, when, copy)
        self._copying: SharedWork[TreeCopy] | None = None
        self.tree_copies = 0  # copies taken (for stats and tests)

    @property
    def hashing(self) -> PageHashing:
        """How the engine names pages and namespaces in what it publishes."""
        return self.engine.engine.hashing

    async def tree(self, options: SnapshotOptions, caller: Caller) -> TreeSnapshot:
        """One view per distinct options and caller at a time, from the shared tree copy:
        concurrent requests for the same view (several dashboards) share it."""
        key = (options, _ADMIN if caller.admin else caller)
        building = self._inflight.get(key)
        if building is None or building.stopped:
            # Shared, and cancelled when its last caller leaves: a shielded build went on
            # after every client had left (100 abandoned views ran 23,777 pieces on the
            # engine thread, and held a live view up from 0.4 s to 11 s).
            building = self._inflight[key] = SharedWork(asyncio.ensure_future(self._build_view(options, caller)))

            def done(_: asyncio.Future[TreeSnapshot], building: SharedWork[TreeSnapshot] = building) -> None:
                if self._inflight.get(key) is building:
                    del self._inflight[key]

            building.future.add_done_callback(done)
        return await building.wait()

    async def tenant_stats(self, caller: Caller) -> dict[str, Any]:
        """A tenant's cache counts over its own namespaces alone: pages per tier, locked
        pages, nodes and hits (the pool-wide counters would tell of other tenants' traffic)."""
        copy = await self._tree_copy()
        seen = await self.engine.run_sliced(lambda: restrict(copy, caller.sees))
        nodes = [node for node in seen.nodes if not node.is_root]
        host = sum(len(node.tokens) // seen.page_size for node in nodes if node.on_host)
        return {"page_size": seen.page_size,
                "tiers": {"device": {"pages_cached": sum(node.device_pages for node in nodes),
                                     "pages_locked": seen.locked_pages},
                          "host": {"pages_cached": host} if seen.has_host_tier else None},
                "nodes": len(nodes), "hits": sum(node.hits for node in nodes)}

    async def _build_view(self, options: SnapshotOptions, caller: Caller) -> TreeSnapshot:
        copy = await self._tree_copy()
        engine = self.engine.engine
        hashing = self.hashing
        decode = engine.tokenizer.decode if options.include_tokens and engine.tokenizer else None

        def work() -> Any:
            seen = copy if caller.admin else (yield from restrict(copy, caller.sees))
            # A tenant's ticks are ranks among its own nodes: the tree's counter moves with
            # every tenant's lookups and inserts (build_view).
            return (yield from build_view(seen, options, namespace_id=hashing.namespace_id, decode=decode,
                                          hashing=hashing, rank_ticks=not caller.admin))

        return await self.engine.run_sliced(work)

    async def _tree_copy(self) -> TreeCopy:
        """A copy of the tree taken in slices between steps; one at a time, shared by every
        caller that arrives meanwhile, and reused while the cache has not changed (for at most
        COPY_REUSE_S). When every caller has left, the copy stops."""
        stats = self.engine.stats()
        version = tuple(stats.get(key) for key in _TREE_VERSION_KEYS)
        loop = asyncio.get_running_loop()
        if self._copy is not None and self._copy[0] == version and loop.time() - self._copy[1] < COPY_REUSE_S:
            return self._copy[2]
        if self._copying is None or self._copying.stopped:
            tree = self.engine.engine.tree
            copying = self.engine.run_sliced(lambda: copy_tree(tree))
            self._copying = SharedWork(copying)
            self.tree_copies += 1

            def done(future: asyncio.Future[TreeCopy]) -> None:
                if self._copying is not None and self._copying.future is future:
                    self._copying = None
                if not future.cancelled() and future.exception() is None:
                    self._copy = (version, loop.time(), future.result())

            copying.add_done_callback(done)
        return await self._copying.wait()
