"""The cache's own routes: tree snapshot, pool stats, flush and the cache-event stream.

    GET  /v1/cache/tree     the radix tree, bounded (max_nodes, max_depth), small subtrees aggregated
    GET  /v1/cache/stats    the pool's occupancy, hit and eviction counters, TTFT sums, histograms
    POST /v1/cache/flush    drops every unlocked cached page; answers how many were freed
    GET  /v1/cache/events   Server-Sent Events: a snapshot, then every cache event, in order

All need the API key when one is set. No token id or text leaves the server unless the operator
started it with --expose-cache-tokens; namespaces (tenants) appear only as opaque ids, and
page hashes and ids are keyed with the engine's secret when it has one (page_hash.py).

Tenants (tenancy.py): an admin's key, or the single-tenant server's, sees the whole cache. A
tenant's key sees only its own namespaces: the tree is built from a copy with the others left
out, the event stream carries only its namespaces' pages, numbered by what it was shown, and
its stats are counted over its own namespaces alone (no pool-wide counter, which would tell
of the others' traffic). A tenant may not flush (403): a flush drops every tenant's pages.

A flush needs no body, so a page of another site could fire it from the operator's browser
(a no-cors fetch, a form) at a server without keys; a browser says where a request comes from
(`Sec-Fetch-Site`, else `Origin`), and a flush that another origin sent is refused (403
`cross_origin`). Clients that are not browsers send neither and are unaffected.

Views stay off the engine's critical path (cache_views.py: one sliced copy of the tree shared
by every view; a request whose client left stops waiting). An event stream that has sent no event for
`events_idle_timeout_s` (or cannot send one for that long: a client that does not read) is
closed; its client reconnects for a fresh snapshot.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from radixserve import AsyncEngine
from radixserve.engine.event_stream import (
    DEFAULT_CAPACITY,
    SERVER_LINGER_S,
    CacheEventHub,
    EventReader,
)
from radixserve.engine.tree_snapshot import DEFAULT_MAX_DEPTH, DEFAULT_MAX_NODES, DEFAULT_TOP_K, SnapshotOptions
from radixserve.server.cache_views import CacheViews
from radixserve.server.errors import APIError
from radixserve.server.host_check import from_another_origin
from radixserve.server.metrics import ServerMetrics
from radixserve.server.streams import unless_disconnected
from radixserve.server.tenancy import Caller, admin_only

MAX_TREE_NODES = 100_000
MAX_TREE_DEPTH = 256  # nesting deeper than this trips JSON libraries' recursion limits
MAX_TOP_K = 100
MAX_EVENT_READERS = 64
CLIENT_CLOSED_REQUEST = 499  # as app.py answers a client that left (nobody reads it)
KEEPALIVE_S = 15.0
DEFAULT_EVENTS_IDLE_TIMEOUT_S = 300.0  # an event stream with no event sent for this long closes
_ENCODER = msgspec.json.Encoder()


class CacheRoutes:
    """Handlers of the /v1/cache routes; `authorize` is the server's API-key check."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, authorize: Any, *,
                 expose_tokens: bool = False, event_buffer: int = DEFAULT_CAPACITY,
                 events_idle_timeout_s: float = DEFAULT_EVENTS_IDLE_TIMEOUT_S,
                 on_flush: Callable[[], None] | None = None) -> None:
        if events_idle_timeout_s <= 0:
            raise ValueError(f"events_idle_timeout_s: must be > 0, got {events_idle_timeout_s}")
        self.events_idle_timeout_s = events_idle_timeout_s
        self.engine = engine
        self.metrics = metrics
        self.authorize = authorize
        self.expose_tokens = expose_tokens
        # A cluster's engine (cluster/engine.py) serves its replicas' views and merged events.
        self.hub = (engine.event_hub(capacity=event_buffer) if hasattr(engine, "event_hub") else
                    CacheEventHub(engine, capacity=event_buffer, include_token_ids=expose_tokens,
                                  linger_s=SERVER_LINGER_S))
        self._readers = 0
        self._tenant_readers: Counter[str | None] = Counter()  # open event streams per tenant
        self.views = engine.cache_views() if hasattr(engine, "cache_views") else CacheViews(engine)
        self.idle_closed = 0  # event streams closed for idleness
        self.on_flush = on_flush  # what else a flush forgets (the server's generated turns)
        # When this server process began (stats' `started`): the counters are cumulative since
        # then, so a client taking their differences knows when they started again from zero.
        self.started = round(time.time(), 3)

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
        caller = self.authorize(request)
        options = SnapshotOptions(
            max_nodes=_int_param(request, "max_nodes", DEFAULT_MAX_NODES, 1, MAX_TREE_NODES),
            max_depth=_int_param(request, "max_depth", DEFAULT_MAX_DEPTH, 1, MAX_TREE_DEPTH),
            top_k=_int_param(request, "top_k", DEFAULT_TOP_K, 0, MAX_TOP_K),
            include_hashes=_bool_param(request, "hashes"),
            include_tokens=self._tokens_param(request))
        snapshot = await unless_disconnected(request, self.views.tree(options, caller))
        return Response(status_code=CLIENT_CLOSED_REQUEST) if snapshot is None else _json(snapshot)

    async def stats(self, request: Request) -> Response:
        """GET /v1/cache/stats: the published engine stats (never waits for a step); a
        tenant's, counted over its own namespaces from a tree copy."""
        caller = self.authorize(request)
        if not caller.admin:
            stats = await unless_disconnected(request, self.views.tenant_stats(caller))
            if stats is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            # No pool-wide counter: they would tell of the other tenants' traffic.
            return _json({"object": "cache.stats", "time": time.time(), "started": self.started,
                          "tenant": caller.tenant, **stats,
                          "requests": None, "lookups": None, "ttft": None, "histograms": None,
                          "hit_rate": None, "expose_tokens": self.expose_tokens})
        s = self.engine.stats()
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
            "object": "cache.stats", "time": time.time(), "started": self.started, "page_size": s["page_size"],
            "tiers": {"device": device, "host": host},
            "nodes": s["cache_nodes"],
            "requests": {key: s[key] for key in ("requests_finished", "requests_aborted", "running", "waiting",
                                                 "preemptions", "prompt_tokens", "cached_tokens")},
            "hit_rate": s["hit_rate"],
            "lookups": {"count": s["cache_lookups"], "tokens": s["cache_lookup_tokens"],
                        "hit_tokens": s["cache_hit_tokens"], "hit_rate": s["cache_hit_rate"]},
            "evicted_pages": s["cache_evicted_pages"],
            "ttft": dict(zip(("count", "sum"), self.metrics.ttft_count_sum())),
            "histograms": s["histograms"],
            "events": {"readers": self._readers, "buffer": self.hub.capacity,
                       "idle_timeout_s": self.events_idle_timeout_s, "idle_closed": self.idle_closed,
                       "snapshot_builds": self.hub.builds},
            "tree_copies": self.views.tree_copies,
            "expose_tokens": self.expose_tokens,
        }
        return _json(body)

    async def flush(self, request: Request) -> Response:
        """POST /v1/cache/flush: drops every unlocked cached page (the engine emits `cleared`);
        an admin's only, and never sent by a page of another origin."""
        admin_only(self.authorize(request))  # a flush drops every tenant's pages
        if from_another_origin(request.headers):
            raise APIError(403, "A flush may not come from a page of another origin", code="cross_origin",
                           error_type="permission_error")
        freed = await self.engine.flush_cache()
        if self.on_flush is not None:  # the answers' texts and ids too: a flush is to forget
            self.on_flush()
        # `pages_freed` stays the device count (what it always was); "tiers" names both.
        tiers = {"device": int(freed), "host": getattr(freed, "host", 0)}
        return _json({"object": "cache.flush", "pages_freed": int(freed), "tiers": tiers})

    async def events(self, request: Request) -> Response:
        """GET /v1/cache/events: SSE, `data: <json>` per message (docs/server.md)."""
        caller = self.authorize(request)
        if self._reader_refused(caller.tenant):
            raise APIError(503, f"Too many cache-event readers (at most {MAX_EVENT_READERS}, shared between tenants)",
                           code="too_many_readers", headers={"Retry-After": "5"})
        # The slot is taken here, before any await: counted only once the stream started,
        # readers arriving together all passed the check first (300 opened at once were all
        # admitted, and every other tenant got a 503). The stream gives it back when it ends,
        # or the response does when its stream never started.
        release = self._take_reader(caller.tenant)
        try:
            return SendTimeoutStreamingResponse(self._sse(caller, release), self.events_idle_timeout_s,
                                                on_close=release, media_type="text/event-stream",
                                                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        except BaseException:
            release()
            raise

    # ------------------------------------------------------------------ helpers
    def _reader_refused(self, tenant: str | None) -> bool:
        """Whether `tenant` may not open another event stream: it holds its share of
        MAX_EVENT_READERS (an equal part among the tenants holding streams, itself counted),
        or twice that many are open. One tenant holding all of them left every other tenant,
        the admin too, a 503 for as long as it kept them."""
        holders = len(self._tenant_readers.keys() | {tenant})
        return (self._tenant_readers[tenant] >= max(1, MAX_EVENT_READERS // holders)
                or self._readers >= 2 * MAX_EVENT_READERS)

    def _take_reader(self, tenant: str | None) -> Callable[[], None]:
        """Counts one more event stream of `tenant`; the function returned gives it back
        (only its first call does: the stream and its response both call it)."""
        self._readers += 1
        self._tenant_readers[tenant] += 1
        taken = True

        def release() -> None:
            nonlocal taken
            if taken:
                taken = False
                self._readers -= 1
                self._tenant_readers[tenant] -= 1
                if not self._tenant_readers[tenant]:
                    del self._tenant_readers[tenant]

        return release

    async def _sse(self, caller: Caller, release: Callable[[], None]) -> AsyncIterator[bytes]:
        # The reader is opened here, not in the handler: a stream that never starts (the
        # client left at once) then leaves nothing subscribed behind.
        reader: EventReader | None = None
        try:
            reader = await self.hub.open_reader(None if caller.admin else self._sees_id(caller))
            loop = asyncio.get_running_loop()
            last_sent = loop.time()
            while True:
                idle_left = last_sent + self.events_idle_timeout_s - loop.time()
                if idle_left <= 0:
                    self.idle_closed += 1
                    return  # idle: the slot goes to someone else; a live client reconnects
                batch = await reader.next(timeout=min(KEEPALIVE_S, idle_left))
                if batch is None:
                    return
                if not batch:
                    yield b": keepalive\n\n"  # an SSE comment: keeps proxies from closing us
                    continue
                yield b"".join(b"data: " + data + b"\n\n" for data in batch)
                last_sent = loop.time()
        finally:
            release()
            if reader is not None:
                with anyio.CancelScope(shield=True):
                    await reader.close()

    def _sees_id(self, caller: Caller) -> Any:
        """The test of published namespace ids that `caller` may see (for its event stream)."""
        hashing = self.views.hashing
        return lambda ns_id: caller.sees(hashing.namespace_of_id(ns_id))

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


class SendTimeoutStreamingResponse(StreamingResponse):
    """A StreamingResponse that gives up on a client whose every send has stalled for
    `send_timeout_s` (it does not read): the stream ends and its connection closes.
    `on_close` is called once the response is over, whether or not its stream ever started."""

    def __init__(self, content: AsyncIterator[bytes], send_timeout_s: float, *,
                 on_close: Callable[[], None] | None = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout_s = send_timeout_s
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()

    async def stream_response(self, send: Any) -> None:
        async def timed_send(message: Any) -> None:
            with anyio.fail_after(self.send_timeout_s):
                await send(message)

        try:
            await super().stream_response(timed_send)
        except TimeoutError:
            pass
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
