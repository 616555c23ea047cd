"""One engine replica: an Engine and its AsyncEngine inside a Ray Serve replica actor.

Its methods are what the ingress calls through a DeploymentHandle: `generate` (a stream:
Accepted or Refused first, then StreamDelta items), `events` (its cache-event stream),
`cache_view` (its part of the cache tree or of a tenant's stats), `close_session`, `flush`, `info`. A call made with `replica=<id>` must run on that replica
(the request router pins it there); if it reaches another one, the pinned replica is gone
and the call raises WrongReplica.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import torch
from ray import serve

from radixserve.cache.radix import PagesFreed
from radixserve.cluster.duel_pool import expect_seen, receive, tell_elsewhere, with_record
from radixserve.cluster.feed import EventFeed
from radixserve.cluster.protocol import Accepted, EventBatch, Refused, ReplicaInfo, ReplicaRequest, WrongReplica
from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import Engine
from radixserve.engine.params import PromptTooLong, QueueFull, StreamDelta
from radixserve.engine.request import namespace_of
from radixserve.grammar import GrammarError
from radixserve.grammar.compile_workers import CompileWorkerLost
from radixserve.engine.tree_snapshot import SnapshotOptions, TreeSnapshot
from radixserve.server.cache_views import CacheViews
from radixserve.server.grammar_compiles import GrammarCompiles
from radixserve.server.startup_gc import freeze_startup_objects
from radixserve.server.tenancy import Caller

logger = logging.getLogger(__name__)


def debug_step_hook(stall: bool, delay_s: float) -> Callable[[], object] | None:
    """The engine thread's hook before every step, as the single server's: with `stall`
    (--debug-stall-engine) the first step never ends; with `delay_s` (--debug-step-delay-s)
    each waits that long; else none."""
    if stall:
        return threading.Event().wait  # waits forever
    if delay_s:
        return functools.partial(time.sleep, delay_s)
    return None


class EngineReplica:
    """A Ray Serve deployment class: `engine_options` are Engine's keyword arguments,
    `async_options` AsyncEngine's (the watchdog's and the streams' settings; with
    `debug_stall_engine` the engine thread's first step never ends, with `debug_step_delay_s`
    each step waits that long: debug_step_hook); `torch_threads` caps the
    intra-op threads so replicas sharing a node do not fight.

    Serve asks `check_health` every few seconds: a replica whose engine thread died or whose
    loop stalled (AsyncEngine.health: work pending and no step for `stall_timeout_s`) fails
    it, and Serve replaces the replica, ending its streams, instead of routing to it for good."""

    async def __init__(self, engine_options: dict[str, Any], torch_threads: int | None = None,
                       async_options: dict[str, Any] | None = None, debug_stall_engine: bool = False,
                       debug_step_delay_s: float = 0.0) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.engine = Engine(**engine_options)
        self.feed = EventFeed(self.engine.page_size)
        # Subscribed before the engine thread starts: the feed sees every event.
        self._unsubscribe = self.engine.subscribe_events(self.feed.publish)
        self.async_engine = AsyncEngine(self.engine, step_hook=debug_step_hook(debug_stall_engine, debug_step_delay_s),
                                        **(async_options or {}))
        self.views = CacheViews(self.async_engine)
        self.grammar_compiles = GrammarCompiles()
        await self.async_engine.start()
        freeze_startup_objects()  # the replica's process keeps all of this (server/startup_gc.py)

    def check_health(self) -> None:
        """Serve's health check: raises while the engine cannot serve (see the class)."""
        reason = self.async_engine.health()
        if reason is not None:
            raise RuntimeError(f"replica {self.replica}: {reason}")

    def info(self) -> ReplicaInfo:
        """The model's name, limits, page size, tokenizer, device and queue bound."""
        return ReplicaInfo(self.engine.model_name, self.engine.max_context_len,
                           self.engine.max_sequence_len, self.engine.page_size, self.engine.tokenizer,
                           self.engine.sampling_defaults, device=self.engine.device, max_queue=self.engine.max_queue)

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[Accepted | Refused | StreamDelta]:
        """Accepted (or Refused, then nothing), then the request's deltas. Cancelling the
        stream (the client left) aborts the request and frees its pages. However it ends,
        the event feed then settles it: a request that ran to its end has published all its
        cache events by then; an aborted one may cache its pages a step later, and the
        router then learns of them from the events alone."""
        held_grammar = None
        if request.params.grammar is not None:
            # Compiled here in a worker thread, as the single server does before the engine
            # sees a request (the ingress has no grammar engine): on the engine thread a large
            # schema would stall every request's steps. The engine then finds it cached.
            try:
                held_grammar = await self.grammar_compiles.compile(self.engine.grammars, request.params.grammar,
                                                               "grammar", request.tenant)
            except GrammarError as exc:
                yield Refused("invalid", str(exc))
                return
            except CompileWorkerLost as exc:  # the replica's fault (lost or starved of CPU): a 503, retry
                logger.error("grammar compile failed: %s", exc)  # for the operator; the client learns no more
                yield Refused("queue_full", "the grammar compiler is unavailable; retry", replica=self.replica)
                return
        receive(self.engine, request.duel_records, self.replica)  # the other replicas' evidence
        expect_seen(self.engine, request.prompt_ids, request.cluster_seen)  # ... and what the cluster saw
        deltas = self.async_engine.generate(
            request.prompt_ids, request.params, request_id=request.request_id, priority=request.priority,
            cache_salt=request.cache_salt, retention=request.retention,
            prefix_retention=request.prefix_retention, session_id=request.session_id,
            tenant=request.tenant, admin=request.admin, client=request.client)
        try:
            async with aclosing(deltas):
                try:
                    first = await anext(deltas)
                    del held_grammar  # the engine holds it now (until here: Grammars.cached)
                except QueueFull as exc:
                    yield Refused("queue_full", str(exc), replica=self.replica)
                    return
                except PromptTooLong as exc:
                    yield Refused("prompt_too_long", str(exc), getattr(exc, "param", None))
                    return
                except ValueError as exc:
                    yield Refused("invalid", str(exc))
                    return
                yield Accepted(self.replica)
                yield first
                async for delta in deltas:
                    yield delta
        finally:
            self.feed.settle(request.request_id)

    async def events(self, replica: str) -> AsyncIterator[EventBatch]:
        """This replica's cache events, from a snapshot on, each batch with fresh stats."""
        self._check_pin(replica)
        async for batch in self.feed.subscribe():
            stats = with_record(self.async_engine.stats(), self.engine)  # its evidence, for the others
            yield EventBatch(self.replica, batch.events, stats, batch.settled)

    async def cache_view(self, kind: str, options: SnapshotOptions | None, caller: Caller,
                         replica: str) -> TreeSnapshot | dict[str, Any]:
        """This replica's cache tree ("tree") or `caller`'s stats ("tenant_stats"), as
        `caller` may see them (server/cache_views.py)."""
        self._check_pin(replica)
        if kind == "tree":
            return await self.views.tree(options or SnapshotOptions(), caller)
        return await self.views.tenant_stats(caller)

    def elsewhere(self, prompt_ids: list[int], cache_salt: str | None, tenant: str | None, replica: str) -> None:
        """The router sent this prompt, whose leading pages the cluster saw this replica serve
        last and it has lost, to another replica: the adaptive rule's ghost caches replay it
        (cluster/duel_pool.py)."""
        self._check_pin(replica)
        tell_elsewhere(self.engine, prompt_ids, namespace_of(self.engine.model_name, cache_salt, tenant))

    async def close_session(self, session_id: str, tenant: str | None, replica: str) -> bool:
        self._check_pin(replica)
        return await self.async_engine.close_session(session_id, tenant)

    def end_requests(self, replica: str) -> None:
        """Ends every request this replica holds (its streams' last delta: an abort), for a
        stop's drain (deploy.OpenAIIngress.drain), as the single server's end_requests does."""
        self._check_pin(replica)
        self.async_engine.abort_all()

    async def flush(self, replica: str) -> PagesFreed:
        self._check_pin(replica)
        return await self.async_engine.flush_cache()

    def cache_page_hashes(self, replica: str) -> list[tuple[str, int]]:
        """(namespace id, hash) of every page the engine's tree holds (for tests)."""
        self._check_pin(replica)
        return sorted(self.engine.cache_page_hashes())

    def _check_pin(self, replica: str) -> None:
        if replica != self.replica:
            raise WrongReplica(f"replica {replica} is gone (this is {self.replica})")

    async def __del__(self) -> None:
        self._unsubscribe()
        await self.async_engine.shutdown()
        self.engine.close()  # a tensor-parallel replica's worker processes end with it
