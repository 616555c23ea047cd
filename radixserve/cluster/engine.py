"""ClusterEngine: AsyncEngine's interface over N engine replicas on Ray Serve.

The single server's Starlette app (radixserve.server.create_app) serves it unchanged: the
same endpoints, streaming, errors and extensions. Each request goes to one replica, chosen
by the deployment's request router; ClusterEngine follows every live replica's event
stream into the ClusterView the router reads (cache pages, stats), and

- retries a request on another replica when its replica dies before anything was streamed
  (nothing of it reached the client); after that the stream fails and the server reports
  it (an error event, or a 500);
- answers `stats()` with the sum over the replicas' latest stats (hit rate recomputed), so
  /metrics covers the whole cluster;
- closes a session and flushes the cache on every replica;
- serves the cache views over every replica (cache_views.py: the tree and a tenant's stats,
  merged; event_hub.py: the merged, labelled event stream).

Page hashes and namespace ids are named through `hashing`, which must hold the replicas'
secret (Engine's `cache_hash_secret`), so that the router's hashes of a prompt are theirs.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import replace
from typing import Any, TypeVar

from ray.exceptions import ActorUnavailableError, RayActorError, WorkerCrashedError
from ray.serve.exceptions import ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from radixserve.cache.events import CacheEvent
from radixserve.cache.page_hash import PageHashing
from radixserve.cache.radix import PagesFreed, Retention
from radixserve.cluster.cache_views import ClusterCacheViews
from radixserve.cluster.duel_pool import ClusterReuse, records_of
from radixserve.cluster.event_hub import ClusterEventHub
from radixserve.cluster.stats import merge_stats
from radixserve.cluster.protocol import Accepted, Refused, ReplicaInfo, ReplicaRequest, WrongReplica
from radixserve.cluster.routing import prompt_pages
from radixserve.cluster.view import ClusterView, cluster_view
from radixserve.engine.params import PromptTooLong, QueueFull, SamplingParams, StreamDelta
from radixserve.engine.request import namespace_of

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3            # a request is tried on at most this many replicas
RESUBSCRIBE_DELAY_S = 0.5   # before following a replica's events again after its stream broke
PINNED_ATTEMPTS = 5         # a call pinned to a live replica is sent this many times at most
PINNED_RETRY_DELAY_S = 0.05  # times the attempt, between them
_T = TypeVar("_T")
# What ends a replica for good. RayActorError covers ActorUnavailableError too, a temporary
# state: `_follow` catches that first and resubscribes; a generate call retries elsewhere.
REPLICA_GONE = (RayActorError, WorkerCrashedError, ReplicaUnavailableError, WrongReplica)


class ReplicaFailed(RuntimeError):
    """The replica serving a request died after part of the answer was streamed."""


class ClusterEngine:
    """AsyncEngine's interface (generate, abort, close_session, flush_cache, stats, start,
    shutdown) forwarding to the engine deployment behind `handle`.

    `engine` carries what the HTTP layer reads from a local engine: model_name, tokenizer,
    max_context_len, max_sequence_len (a ReplicaInfo from one replica; all are alike).
    `cluster_reuse=False` sends the replicas no cluster reuse history (duel_pool.ClusterReuse).
    `session_ttl_s` is the replicas' (Engine's): the router forgets a session idle that long.
    """

    def __init__(self, handle: DeploymentHandle, info: ReplicaInfo, *, app_name: str, deployment: str,
                 hash_secret: str | bytes | None = None, cluster_reuse: bool = True,
                 session_ttl_s: float | None = None) -> None:
        self.handle = handle
        self.engine = info
        self.hashing = PageHashing(hash_secret)
        # Told of every replica's cache events once the view has applied them, and of a
        # replica that left (None): the merged /v1/cache/events stream (event_hub.py).
        self.cache_listener: Callable[[str, list[CacheEvent] | None], None] | None = None
        self.view: ClusterView = cluster_view(app_name, deployment)
        if session_ttl_s is not None:
            self.view.set_session_ttl(session_ttl_s)
        self.reuse = ClusterReuse(cluster_reuse)  # what the cluster has seen: the replicas' adaptive rule boosts it
        self._telling: set[asyncio.Future[Any]] = set()  # `elsewhere` calls under way (kept from the GC)
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._following: dict[str, int] = {}  # replica → the view's generation of it its follower started at
        self._streams: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Follows the event stream of every replica the router reports, now and later."""
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        loop = self._loop
        self.view.listen(lambda: loop.call_soon_threadsafe(self._sync_followers))
        self._sync_followers()

    async def shutdown(self, timeout_s: float | None = None) -> bool:
        """Stops following the replicas (the replicas themselves belong to Ray Serve)."""
        self._stopping = True
        self.view.listen(None)
        for task in self._followers.values():
            task.cancel()
        await asyncio.gather(*self._followers.values(), return_exceptions=True)
        self._followers.clear()
        self._following.clear()
        return True

    def fault(self) -> str | None:
        """None: a replica's lasting fault is its own (its requests end with it; its health
        check fails and Serve replaces it), and the others serve on."""
        return None

    def health(self) -> str | None:
        """None while some replica is live and reporting; else why not (GET /health's 503)."""
        if not self.view.replica_stats():
            return "no engine replica is live"
        return None

    def _sync_followers(self) -> None:
        if self._stopping:
            return
        live = self.view.replicas
        # A replica the view forgot since its follower started (it left and came back before
        # this ran, or its actor died and Serve still lists it) is followed afresh: the old
        # stream would send only deltas over the emptied index, and no snapshot again.
        wiped = {r for r in live & set(self._followers) if self.view.generation(r) != self._following.get(r)}
        for replica in (set(self._followers) - live) | wiped:
            self._followers.pop(replica).cancel()
            self._following.pop(replica, None)
            if self.cache_listener is not None:
                self.cache_listener(replica, None)
        for replica in live - set(self._followers):
            self._following[replica] = self.view.generation(replica)
            self._followers[replica] = asyncio.create_task(self._follow(replica))

    async def _follow(self, replica: str) -> None:
        """Applies a replica's event batches to the view until its stream ends."""
        while not self._stopping:
            stream = _fresh_call(lambda: self.handle.options(stream=True).events.remote(replica=replica))
            try:
                async for batch in stream:
                    self.view.apply(batch)
                    if self.cache_listener is not None and batch.events and replica in self.view.replicas:
                        self.cache_listener(replica, batch.events)
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except WrongReplica:
                if not self._misdelivered(replica):
                    return  # it left the live set: the view has forgotten it already
            except ActorUnavailableError:
                # Ray: "temporarily unavailable but may be available later" (Serve itself only
                # retries on it). The replica stays live and is followed again from a fresh
                # snapshot: dropping it left Serve routing to a replica the view no longer
                # followed (its prompts in flight there for good, its stats gone).
                logger.warning("replica %s is unavailable for now; following it again", replica)
            except REPLICA_GONE:
                logger.warning("replica %s is gone; no longer routing to it", replica)
                self.view.replica_gone(replica)
                return
            except Exception:
                logger.exception("the event stream of replica %s broke; following it again", replica)
            stream.cancel()
            await asyncio.sleep(RESUBSCRIBE_DELAY_S)

    # ------------------------------------------------------------------ requests
    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, request_id: str,
                       priority: int = 0, cache_salt: str | None = None,
                       retention: Retention | None = None,
                       prefix_retention: tuple[int, Retention] | None = None,
                       session_id: str | None = None, tenant: str | None = None,
                       admin: bool = False, client: Hashable = None) -> AsyncIterator[StreamDelta]:
        """As AsyncEngine.generate: QueueFull / PromptTooLong / ValueError before the first
        item; closing the iterator early cancels the replica's stream, which aborts there."""
        namespace, hashes = prompt_pages(prompt_ids, self.engine.page_size,
                                         namespace_of(self.engine.model_name, cache_salt, tenant), self.hashing)
        stats = self.view.replica_stats()
        seen = self.reuse.observe(hashes, stats)
        request = ReplicaRequest(request_id, list(prompt_ids), params, priority, cache_salt, retention,
                                 prefix_retention, session_id, namespace, hashes, tenant,
                                 admin, records_of(stats), cluster_seen=seen, client=client)
        for attempt in range(1, MAX_ATTEMPTS + 1):
            stream = _fresh_call(lambda: self.handle.options(stream=True).generate.remote(request))
            self._streams[request_id] = stream
            streamed = False
            try:
                refused = None
                async for item in stream:
                    if isinstance(item, Accepted):
                        self._took(request, item.replica)
                        continue
                    if isinstance(item, Refused):
                        refused = item
                        break
                    streamed = True
                    yield item
                if refused is None:
                    return
                avoid = (*request.avoid, refused.replica or "")
                if (refused.kind != "queue_full" or refused.replica is None or attempt == MAX_ATTEMPTS
                        or not self.view.replicas - set(avoid)):
                    raise _refusal(refused)
                # One replica's queue is full (the cache-aware rule sends a prefix where it is
                # cached): another with room serves it, as one engine of the cluster's size would.
                request = replace(request, avoid=avoid)
            except REPLICA_GONE as exc:
                if streamed:
                    raise ReplicaFailed(f"the replica serving {request_id} died mid-answer") from exc
                if attempt == MAX_ATTEMPTS:
                    raise
                logger.warning("request %s: replica gone before it answered (%s); retrying", request_id,
                               type(exc).__name__)
            finally:
                stream.cancel()  # a no-op once the stream ended; aborts the request otherwise
                self._streams.pop(request_id, None)

    def _took(self, request: ReplicaRequest, replica: str) -> None:
        """`replica` accepted `request`: the cluster's reuse history records it, and the
        replica that served its seen pages last, if it lost them and is still live, is told
        it went elsewhere (duel_pool.py; in the background: nothing waits for it, and a
        failure only costs that replica one prompt of evidence)."""
        def held(home: str) -> int:
            with self.view.lock:
                return sum(self.view.state.index.tiered_pages(home, request.namespace, request.page_hashes))

        home = self.reuse.took(request.page_hashes, request.cluster_seen, replica, held, self.view.replicas)
        if home is None:
            return
        call = self._call_pinned("elsewhere", home, request.prompt_ids, request.cache_salt, request.tenant)
        task = asyncio.ensure_future(call)
        self._telling.add(task)
        task.add_done_callback(self._told)

    def _told(self, task: asyncio.Future[Any]) -> None:
        self._telling.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.debug("telling a replica its prompt went elsewhere failed: %r", task.exception())

    @property
    def max_queue(self) -> int | None:
        """The requests the live replicas' queues hold together (None: unbounded): a
        completions batch larger can never be queued whole (its prompts may go to any)."""
        per_replica = self.engine.max_queue
        return None if per_replica is None else per_replica * max(1, len(self.view.replicas))

    def abort(self, request_id: str, *, refused: bool = False) -> None:
        """Cancels a request's replica stream (a no-op if it already finished). `refused` (a
        batch's other prompt was refused) is not told to the replica: it counts an abort."""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()

    async def close_session(self, session_id: str, tenant: str | None = None) -> bool:
        """Ends `tenant`'s session on whichever replica holds it; False if none did."""
        results = await self._on_every_replica("close_session", session_id, tenant)
        closed = any(r is True for r in results)
        if closed:  # its id no longer pins a request to that replica
            self.view.session_closed(session_id, tenant)
        return closed

    async def flush_cache(self) -> PagesFreed:
        """Flushes every replica; returns the pages freed in all (device, with `host`)."""
        freed = [r for r in await self._on_every_replica("flush") if isinstance(r, int)]
        return PagesFreed(sum(freed), sum(getattr(r, "host", 0) for r in freed))

    def cache_views(self) -> ClusterCacheViews:
        """The cache routes' tree and tenant stats, over every replica."""
        return ClusterCacheViews(self)

    def event_hub(self, capacity: int) -> ClusterEventHub:
        """The cache routes' event stream, merged over every replica."""
        return ClusterEventHub(self, capacity=capacity)

    async def on_every_replica(self, method: str, *args: Any) -> dict[str, Any]:
        """`method(*args)` on every live replica: its result, or the exception it raised, by replica."""
        replicas = sorted(self.view.replicas)
        return dict(zip(replicas, await asyncio.gather(*(self._call_pinned(method, r, *args) for r in replicas),
                                                       return_exceptions=True)))

    async def _on_every_replica(self, method: str, *args: Any) -> list[Any]:
        calls = [self._call_pinned(method, r, *args) for r in sorted(self.view.replicas)]
        return await asyncio.gather(*calls, return_exceptions=True)

    async def _call_pinned(self, method: str, replica: str, *args: Any) -> Any:
        """`method` run on `replica`, sent again while it reached another one and `replica`
        is still live (see `_misdelivered`)."""
        for attempt in range(1, PINNED_ATTEMPTS + 1):
            try:
                return await _fresh_call(lambda: getattr(self.handle, method).remote(*args, replica=replica))
            except WrongReplica:
                if attempt == PINNED_ATTEMPTS or not self._misdelivered(replica):
                    raise
                await asyncio.sleep(PINNED_RETRY_DELAY_S * attempt)

    def _misdelivered(self, replica: str) -> bool:
        """A call pinned to `replica` reached another replica: True if `replica` is still
        live (Serve's router handed it a replica chosen for another pending call: it fulfils
        pending calls first come, first served), False if `replica` has left."""
        if replica not in self.view.replicas:
            return False
        logger.info("a call pinned to replica %s reached another replica; sending it again", replica)
        return True

    def stats(self) -> dict[str, Any]:
        """The sum of the replicas' latest stats; "replicas" (how many reported) and
        "routed_per_replica" (requests routed to each replica by this ingress) added."""
        per_replica = self.view.replica_stats()
        out = merge_stats(list(per_replica.values()))
        out["replicas"] = len(per_replica)
        out["routed_per_replica"] = self.view.routed_counts()
        return out


def _fresh_call(call: Callable[[], _T]) -> _T:
    """Makes a handle call outside the HTTP request's Serve context. Inside it, every call
    inherits the request's internal id, and Serve's router keys pending requests by that id:
    two concurrent calls of one request (closing a session on every replica, n samples)
    would collapse into one and the other would never be routed."""
    return contextvars.Context().run(call)


def _refusal(refused: Refused) -> Exception:
    if refused.kind == "queue_full":
        return QueueFull(refused.message)
    if refused.kind == "prompt_too_long":
        error = PromptTooLong(refused.message)
        error.param = refused.param  # type: ignore[attr-defined]
        return error
    return ValueError(refused.message)
