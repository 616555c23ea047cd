"""The cache's own routes: tree snapshot, pool stats, flush and the cache-event stream.

    GET  /v1/cache/tree     the radix tree, bounded (max_nodes, max_depth), small subtrees aggregated
    GET  /v1/cache/stats    the pool's occupancy, hit and eviction counters, TTFT sums, histograms
    POST /v1/cache/flush    drops every unlocked cached page; answers how many were freed
    GET  /v1/cache/events   Server-Sent Events: a snapshot, then every cache event, in order

All need the API key when one is set. No token id or text leaves the server unless the operator
started it with --expose-cache-tokens; namespaces (tenants) appear only as opaque ids. Reading
the tree runs on the engine thread between steps (`AsyncEngine.call`), so it never races one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from radixserve import AsyncEngine
from radixserve.cache.page_hash import namespace_id
from radixserve.engine.event_stream import DEFAULT_CAPACITY, CacheEventHub, EventReader
from radixserve.engine.tree_snapshot import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_NODES,
    DEFAULT_TOP_K,
    SnapshotOptions,
    TreeSnapshot,
    snapshot_tree,
)
from radixserve.server.errors import APIError
from radixserve.server.metrics import ServerMetrics

MAX_TREE_NODES = 100_000
MAX_TREE_DEPTH = 256  # nesting deeper than this trips JSON libraries' recursion limits
MAX_TOP_K = 100
MAX_EVENT_READERS = 64
KEEPALIVE_S = 15.0
_ENCODER = msgspec.json.Encoder()
_TTFT = "radixserve_time_to_first_token_seconds"


class CacheRoutes:
    """Handlers of the /v1/cache routes; `authorize` is the server's API-key check."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, authorize: Any, *,
                 expose_tokens: bool = False, event_buffer: int = DEFAULT_CAPACITY) -> None:
        self.engine = engine
        self.metrics = metrics
        self.authorize = authorize
        self.expose_tokens = expose_tokens
        self.hub = CacheEventHub(engine, capacity=event_buffer, include_token_ids=expose_tokens)
        self._readers = 0
        self._inflight: dict[SnapshotOptions, asyncio.Future[TreeSnapshot]] = {}

    def routes(self) -> list[Route]:
        """The routes to append to the app's."""
        return [
            Route("/v1/cache/tree", self.tree, methods=["GET"]),
            Route("/v1/cache/stats", self.stats, methods=["GET"]),
            Route("/v1/cache/flush", self.flush, methods=["POST"]),
            Route("/v1/cache/events", self.events, methods=["GET"]),
        ]

    def close(self) -> None:
        """Ends every event stream; call before the engine stops."""
        self.hub.close()

    # ------------------------------------------------------------------ routes
    async def tree(self, request: Request) -> Response:
        """GET /v1/cache/tree?max_nodes=&max_depth=&top_k=&hashes=&tokens=: the bounded tree view."""
        self.authorize(request)
        options = SnapshotOptions(
            max_nodes=_int_param(request, "max_nodes", DEFAULT_MAX_NODES, 1, MAX_TREE_NODES),
            max_depth=_int_param(request, "max_depth", DEFAULT_MAX_DEPTH, 1, MAX_TREE_DEPTH),
            top_k=_int_param(request, "top_k", DEFAULT_TOP_K, 0, MAX_TOP_K),
            include_hashes=_bool_param(request, "hashes"),
            include_tokens=self._tokens_param(request))
        return _json(await self._snapshot(options))

    async def stats(self, request: Request) -> Response:
        """GET /v1/cache/stats: the published engine stats (never waits for a step)."""
        self.authorize(request)
        s = self.engine.stats()
        registry = self.metrics.registry
        device = {
            "pages_total": s["pages_total"], "pages_free": s["pages_free"],
            "pages_cached": s["pages_cached"], "pages_evictable": s["pages_evictable"],
            "pages_locked": s["pages_locked"],
            # Pages only running sequences hold (their uncached tails): used but not cached.
            "pages_running": s["pages_used"] - s["pages_cached"],
        }
        host = None if not s["host_pages_total"] else {  # the host tier, when there is one
            "pages_total": s["host_pages_total"], "pages_free": s["host_pages_free"],
            "pages_cached": s["host_pages_cached"], "pages_host_only": s["host_only_pages"],
            "pages_offloaded": s["cache_offloaded_pages"], "pages_loaded": s["cache_loaded_pages"],
            "pages_evicted": s["cache_host_evicted_pages"],
        }
        body = {
            "object": "cache.stats", "time": time.time(), "page_size": s["page_size"],
            "tiers": {"device": device, "host": host},
            "nodes": s["cache_nodes"],
            "requests": {key: s[key] for key in ("requests_finished", "requests_aborted", "running", "waiting",
                                                 "preemptions", "prompt_tokens", "cached_tokens")},
            "hit_rate": s["hit_rate"],
            "lookups": {"count": s["cache_lookups"], "tokens": s["cache_lookup_tokens"],
                        "hit_tokens": s["cache_hit_tokens"], "hit_rate": s["cache_hit_rate"]},
            "evicted_pages": s["cache_evicted_pages"],
            "ttft": {"count": registry.get_sample_value(f"{_TTFT}_count") or 0.0,
                     "sum": registry.get_sample_value(f"{_TTFT}_sum") or 0.0},
            "histograms": s["histograms"],
            "events": {"readers": self._readers, "buffer": self.hub.capacity},
            "expose_tokens": self.expose_tokens,
        }
        return _json(body)

    async def flush(self, request: Request) -> Response:
        """POST /v1/cache/flush: drops every unlocked cached page (the engine emits `cleared`)."""
        self.authorize(request)
        freed = await self.engine.flush_cache()
        # `pages_freed` stays the device count (what it always was); "tiers" names both.
        tiers = {"device": int(freed), "host": getattr(freed, "host", 0)}
        return _json({"object": "cache.flush", "pages_freed": int(freed), "tiers": tiers})

    async def events(self, request: Request) -> Response:
        """GET /v1/cache/events: SSE, `data: <json>` per message (docs/server.md)."""
        self.authorize(request)
        if self._readers >= MAX_EVENT_READERS:
            raise APIError(503, f"Too many cache-event readers (at most {MAX_EVENT_READERS})",
                           code="too_many_readers", headers={"Retry-After": "5"})
        return StreamingResponse(self._sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ helpers
    async def _sse(self) -> AsyncIterator[bytes]:
        # The reader is opened here, not in the handler: a stream that never starts (the
        # client left at once) then leaves nothing subscribed behind.
        self._readers += 1
        reader: EventReader | None = None
        try:
            reader = await self.hub.open_reader()
            while True:
                batch = await reader.next(timeout=KEEPALIVE_S)
                if batch is None:
                    return
                if not batch:
                    yield b": keepalive\n\n"  # an SSE comment: keeps proxies from closing us
                    continue
                yield b"".join(b"data: " + data + b"\n\n" for data in batch)
        finally:
            self._readers -= 1
            if reader is not None:
                with anyio.CancelScope(shield=True):
                    await reader.close()

    async def _snapshot(self, options: SnapshotOptions) -> TreeSnapshot:
        """One engine-thread snapshot per distinct options at a time: concurrent requests for the
        same view (several dashboards) share it instead of each stalling the engine."""
        pending = self._inflight.get(options)
        if pending is None:
            engine = self.engine.engine
            decode = engine.tokenizer.decode if options.include_tokens and engine.tokenizer else None
            pending = self.engine.call(lambda: snapshot_tree(engine.tree, options, namespace_id=namespace_id,
                                                             decode=decode))
            self._inflight[options] = pending
            pending.add_done_callback(lambda _: self._inflight.pop(options, None))
        return await asyncio.shield(pending)

    def _tokens_param(self, request: Request) -> bool:
        wanted = _bool_param(request, "tokens")
        if wanted and not self.expose_tokens:
            raise APIError(403, "Token ids and text are not exposed: start the server with "
                                "--expose-cache-tokens to allow it", param="tokens",
                           code="tokens_not_exposed", error_type="permission_error")
        return wanted


def _bool_param(request: Request, name: str) -> bool:
    value = request.query_params.get(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise APIError(400, f"{name}: must be true or false", param=name, code="invalid_value")
    return value in ("true", "1")


def _int_param(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise APIError(400, f"{name}: must be an integer, got {raw!r}", param=name, code="invalid_value") from None
    if not low <= value <= high:
        raise APIError(400, f"{name}: must be in {low}..{high}, got {value}", param=name, code="invalid_value")
    return value


def _json(value: Any) -> Response:
    return Response(_ENCODER.encode(value), media_type="application/json")
