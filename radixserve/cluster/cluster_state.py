"""What a router knows about the replicas, and the interface of a routing rule over it.

`ClusterState` is what a router knows: each replica's cached pages (a `CacheIndex` fed by
its cache events), the requests it has in flight, its latest reported free pages, which
replica each session is on, and how many requests and conversations went to each lately.
A `RouteRequest` is what a rule looks at (`prompt_pages` names a prompt's pages as the
replicas' events do); a `RoutingPolicy` ranks the live replicas for one (the rules:
cache_aware.py and baseline_routers.py, chosen by name in routing.py). Plain Python, shared
by the Ray Serve request router and `bench simulate --replicas`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from radixserve.cache.page_hash import PageHashing
from radixserve.cluster.index import CacheIndex

ENDED_MEMORY = 65536  # finished request ids remembered (see ClusterState.finished)
SETTLE_GRACE_BATCHES = 40  # event batches of a replica after which an unsettled request is dropped
RECENT_HALF_LIFE_ROUTINGS = 256  # requests routed (anywhere) over which a replica's count of recent ones halves
STARTS_HALF_LIFE = 1024  # conversations started (anywhere) over which a replica's count of starts halves
_STARTS_DECAY = 0.5 ** (1 / STARTS_HALF_LIFE)
SESSION_MEMORY = 65536  # sessions remembered (the least recently routed are forgotten)
SESSION_TTL_S = 600.0   # a session unrouted this long is forgotten (Engine's default session_ttl_s)


@dataclass(frozen=True)
class RouteRequest:
    """What routing looks at: the prompt's page hashes in its cache namespace."""

    request_id: str
    namespace: str              # namespace id and page hashes of the prompt: `prompt_pages`
    page_hashes: Sequence[int]
    prompt_tokens: int
    session_id: str | None = None
    replica_request_id: str | None = None  # the id the replica knows it by (default: request_id)
    tenant: str | None = None   # whose session `session_id` is (replicas key sessions by both)

    @property
    def settle_key(self) -> str:
        """The id the replica names when the request's pages are in its events."""
        return self.replica_request_id or self.request_id


def prompt_pages(prompt_ids: Sequence[int] | np.ndarray, page_size: int,
                 namespace: Hashable, hashing: PageHashing | None = None) -> tuple[str, list[int]]:
    """The namespace's id and the prompt's page hashes, exactly as the cache names them in
    its events (radixserve.cache.page_hash): through `hashing`, which must hold the replicas'
    secret when they key their hashes (default: the public spec). The engine's namespace of
    a request is `request.namespace_of`; the simulator's is None."""
    hashing = hashing or PageHashing()
    ns_id, seed = hashing.named(namespace)
    hashes, _ = hashing.page_hashes(np.asarray(prompt_ids, dtype=np.int64), page_size, seed)
    return ns_id, hashes.tolist()


@dataclass
class ReplicaReport:
    """A replica's latest self-report (its stats): memory and queue."""

    pages_free: int = 0
    pages_total: int = 0
    waiting: int = 0
    running: int = 0


class _Placement(NamedTuple):
    """Where a routed request went, for as long as it may still move or be taken back."""

    replica: str
    key: str               # its settle key
    start: bool            # it started a conversation there (`ClusterState.share`)
    routing: int           # the routing's number when it was first routed (a move keeps it)
    starts_counted: int    # conversation starts counted once it was placed (its start's age)


@dataclass
class ClusterState:
    """What the router knows about the replicas. One per router; not thread-safe.

    A request's prompt pages count as in flight on its replica from routing until the
    replica *settles* it (`settled`): its event stream has then delivered the events that
    cache those pages. Ending them when the request finishes instead would leave a gap (the
    completion can overtake the events) in which a repeat of the prompt finds it nowhere.
    """

    index: CacheIndex = field(default_factory=CacheIndex)
    in_flight: dict[str, int] = field(default_factory=dict)      # replica → requests routed, not finished
    routed_total: dict[str, int] = field(default_factory=dict)   # replica → requests routed ever
    starts: dict[str, float] = field(default_factory=dict)        # replica → conversations started, decayed (`share`)
    reports: dict[str, ReplicaReport] = field(default_factory=dict)
    # (tenant, session id) → (replica, when last routed), least recently routed first
    sessions: OrderedDict[tuple[str | None, str], tuple[str, float]] = field(default_factory=OrderedDict)
    session_ttl_s: float = SESSION_TTL_S                           # the replicas' idle TTL of a session
    clock: Callable[[], float] = time.monotonic                     # seconds, for the sessions' TTL
    recent_half_life: float = RECENT_HALF_LIFE_ROUTINGS             # in requests routed (`recent_requests`)
    _routings: int = 0                                              # requests routed ever (moves not counted)
    _recent: dict[str, tuple[float, int]] = field(default_factory=dict)  # replica → (decayed count, as of routing)
    _starts_counted: int = 0                                         # conversation starts ever (the decay of `starts`)
    _placed: dict[str, _Placement] = field(default_factory=dict)    # request id → where it went
    _ended: OrderedDict[str, None] = field(default_factory=OrderedDict)  # recently finished ids
    _batches: dict[str, int] = field(default_factory=dict)        # replica → event batches applied
    _unsettled: dict[str, tuple[str, int]] = field(default_factory=dict)  # settle key → (replica, batch)

    def routed(self, request: RouteRequest, replica: str) -> None:
        """The request goes to `replica`: count it and note its prompt as in flight there.
        Routing the same request again (a retry, or Serve choosing another replica than the
        one reserved) moves it: it stays the request routed when it first was, so it moves
        what it weighs by now in the decayed counts (a retry long after counts less than 1)."""
        placed = self._placed.get(request.request_id)
        if (placed is not None and placed.replica == replica) or request.request_id in self._ended:
            return  # already there, or a late report of a request that has finished
        if placed is None:
            self._routings += 1
            routing = self._routings
        else:
            routing = placed.routing  # a move is the same request, routed when it first was
        self._unroute(request.request_id)
        if placed is not None:  # its prompt end there is no conversation of that replica's
            self.index.drop_prompt_end(placed.replica, request.namespace, request.page_hashes, routing)
        start = not self.index.continued_pages(replica, request.namespace, request.page_hashes, in_flight=True)
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        self.routed_total[replica] = self.routed_total.get(replica, 0) + 1
        self._add_recent(replica, self._recent_weight(routing))  # 1 unless moved after other routings
        counted = self._starts_counted if placed is None else placed.starts_counted
        if start:
            self.share(replica)  # a replica first routed to joins at the least share
            if placed is None:
                for known in self.starts:
                    self.starts[known] *= _STARTS_DECAY
                self.starts[replica] += 1.0
                self._starts_counted = counted = self._starts_counted + 1
            else:  # a move: a start as old as its first routing, the others not aged again
                self.starts[replica] += self._start_weight(counted)
        self._placed[request.request_id] = _Placement(replica, request.settle_key, start, routing, counted)
        self.index.add_in_flight(request.settle_key, replica, request.namespace, request.page_hashes)
        self.index.add_prompt_end(replica, request.namespace, request.page_hashes, routing)
        if request.session_id is not None:
            key = (request.tenant, request.session_id)
            self.sessions.pop(key, None)
            self.sessions[key] = (replica, self.clock())
            self._expire_sessions()

    def finished(self, request_id: str) -> None:
        """The request ended (done, failed or cancelled): its replica's requests in flight drop by one; its
        prompt stays in flight until the replica settles it, or for SETTLE_GRACE_BATCHES of
        the replica's event batches (a request cancelled before the replica ran it is never
        settled). Ray Serve may report a short request's completion before its routing:
        the id is remembered for a while, and a late `routed` for it is ignored (else it
        would count as in flight forever)."""
        placed = self._release(request_id)
        if placed is not None and self.index.in_flight_on(placed.key) is not None:
            self._unsettled[placed.key] = (placed.replica, self._batches.get(placed.replica, 0))
        self._remember_ended(request_id)

    def withdrawn(self, request: RouteRequest) -> None:
        """A request reserved on a replica (the cache-aware router reserves as it ranks) was
        cancelled before Ray Serve sent it anywhere: Serve reports neither its routing nor its
        completion, so the reservation is taken back whole here (else it counted in flight on
        that replica for good). A late report of it is ignored, as of a finished request."""
        placed = self._placed.get(request.request_id)
        if placed is None:
            return
        self._unroute(request.request_id)
        self.index.drop_prompt_end(placed.replica, request.namespace, request.page_hashes, placed.routing)
        self._remember_ended(request.request_id)

    def _remember_ended(self, request_id: str) -> None:
        """A late routing report of this request is to be ignored (the last ENDED_MEMORY ids)."""
        self._ended[request_id] = None
        if len(self._ended) > ENDED_MEMORY:
            self._ended.popitem(last=False)

    def settled(self, replica: str, keys: Sequence[str]) -> None:
        """`replica`'s event stream now covers these requests' cached pages (their settle
        keys): from here on its events alone say what it holds."""
        for key in keys:
            if self.index.in_flight_on(key) == replica:  # a retry may hold the key elsewhere
                self.index.end_in_flight(key)
            # Only this replica's own wait ends: a late settle from a replica the request
            # was moved away from must not cancel the grace of the one that holds it now.
            pending = self._unsettled.get(key)
            if pending is not None and pending[0] == replica:
                del self._unsettled[key]

    def batch_applied(self, replica: str) -> None:
        """One more event batch of `replica` was applied: requests it finished long ago and
        never settled stop counting as in flight."""
        count = self._batches[replica] = self._batches.get(replica, 0) + 1
        stale = [k for k, (r, at) in self._unsettled.items() if r == replica and count - at > SETTLE_GRACE_BATCHES]
        for key in stale:
            del self._unsettled[key]
            if self.index.in_flight_on(key) == replica:  # a retry may hold the key elsewhere
                self.index.end_in_flight(key)

    def _release(self, request_id: str) -> _Placement | None:
        """Forgets where a request was placed and drops it from its replica's requests in
        flight; returns where it was, or None if it was not placed."""
        placed = self._placed.pop(request_id, None)
        if placed is not None and placed.replica in self.in_flight:
            self.in_flight[placed.replica] = max(0, self.in_flight[placed.replica] - 1)
        return placed

    def _unroute(self, request_id: str) -> None:
        """Takes back a routing: the request was not served there after all. What it added to
        the replica's decayed counts has decayed since: that share is taken back, not a whole
        one (which would count the replica short of requests it did get)."""
        placed = self._release(request_id)
        if placed is None:
            return
        replica = placed.replica
        if replica in self.routed_total:
            self.routed_total[replica] -= 1
        self._add_recent(replica, -self._recent_weight(placed.routing))
        if placed.start and replica in self.starts:
            self.starts[replica] = max(0.0, self.starts[replica] - self._start_weight(placed.starts_counted))
        self.index.end_in_flight(placed.key)

    def remove(self, replica: str) -> None:
        """A replica died or left: forget its cache, its requests in flight and its sessions."""
        self.index.forget(replica)
        self.in_flight.pop(replica, None)
        self.starts.pop(replica, None)
        self._recent.pop(replica, None)
        self.reports.pop(replica, None)
        self._batches.pop(replica, None)
        for session in [s for s, (r, _) in self.sessions.items() if r == replica]:
            del self.sessions[session]
        for request_id in [q for q, placed in self._placed.items() if placed.replica == replica]:
            del self._placed[request_id]
        for key in [k for k, (r, _) in self._unsettled.items() if r == replica]:
            del self._unsettled[key]

    def session_replica(self, request: RouteRequest) -> str | None:
        """The replica the request's session is on (None: no session, or one not routed within
        the replicas' TTL, which they have closed by now). Keyed by tenant as the replicas
        key sessions: another tenant's id neither pins the request nor reveals the session."""
        if request.session_id is None:
            return None
        self._expire_sessions()
        held = self.sessions.get((request.tenant, request.session_id))
        return held[0] if held is not None else None

    def end_session(self, session_id: str, tenant: str | None = None) -> None:
        """The session was closed: its next request is placed afresh."""
        self.sessions.pop((tenant, session_id), None)

    def _expire_sessions(self) -> None:
        """Forgets sessions past the cap (least recently routed first) and past the TTL: the
        map is in routing order, so the expired ones lead it."""
        while len(self.sessions) > SESSION_MEMORY:
            self.sessions.popitem(last=False)
        deadline = self.clock() - self.session_ttl_s
        while self.sessions and next(iter(self.sessions.values()))[1] < deadline:
            self.sessions.popitem(last=False)

    def recent_requests(self, replica: str) -> float:
        """Requests routed to `replica` lately: each counts 1 when routed and halves over every
        `recent_half_life` requests routed anywhere after it. Unlike requests in flight, this
        sees the turns of conversations that arrive minutes apart: between two turns nothing
        is in flight, yet the replica serves them all. Counted in requests, not seconds, so
        that it covers the same traffic at any arrival rate: a half-life in seconds spans
        thousands of requests at a peak (a replica drawing a third fewer for two minutes
        stayed within the margin of a count averaged over some seven minutes) and a handful
        in a lull."""
        count, at = self._recent.get(replica, (0.0, 0))
        if not count:
            return 0.0
        return count * self._recent_weight(at)

    def joined(self, replica: str) -> None:
        """`replica` joined the live set (a replacement, a scale-up): its count of requests
        routed lately starts at the least of the others', as its `share` does. At 0, every
        established replica looked busy past the hard limit next to it, and their
        conversations moved to it, each recomputed whole (26 of 30 when one replaced another)."""
        if replica not in self._recent:
            least = min((self.recent_requests(r) for r in self._recent), default=0.0)
            self._recent[replica] = (least, self._routings)

    def own_recent_requests(self, replica: str, request: RouteRequest) -> float:
        """The part of `recent_requests(replica)` that is the request's own conversation: its
        earlier turns routed there (the prompts it runs through, `CacheIndex.prompt_ends_through`),
        decayed alike. Moving the conversation would take these along. Counted only from two
        such prompts up: a single one may have ended inside a prefix that many prompts share (a
        system prompt, a document) and so be no conversation of this one's, while each turn of
        a conversation leaves its own."""
        ends = self.index.prompt_ends_through(replica, request.namespace, request.page_hashes)
        if len(ends) < 2:
            return 0.0
        return sum(self._recent_weight(at) for at in ends)

    def _recent_weight(self, routing: int) -> float:
        """What a request routed as routing number `routing` weighs in `recent_requests` now."""
        return 0.5 ** ((self._routings - routing) / self.recent_half_life)

    def _start_weight(self, counted: int) -> float:
        """What a start counted as start number `counted` weighs in `starts` now."""
        return _STARTS_DECAY ** (self._starts_counted - counted)

    def _add_recent(self, replica: str, amount: float) -> None:
        self._recent[replica] = (max(0.0, self.recent_requests(replica) + amount), self._routings)

    def requests_in_flight(self, replica: str) -> int:
        """Requests routed to `replica` and not yet ended."""
        return self.in_flight.get(replica, 0)

    def share(self, replica: str) -> float:
        """Conversations started on `replica` lately: requests routed there that do not
        continue one it holds (`CacheIndex.continued_pages`), each counting 1 and halving over
        STARTS_HALF_LIFE starts anywhere. Starts, not requests, because a conversation's
        later turns follow it: balancing where conversations start balances the requests
        they bring, while a replica that runs slower (and so gets fewer turns per second)
        would look underused by a count of requests and draw ever more conversations. A
        replica first seen joins at the least share, so one that joins late is not flooded."""
        if replica not in self.starts:
            self.starts[replica] = min(self.starts.values(), default=0.0)
        return self.starts[replica]

    def free_pages(self, replica: str) -> int:
        report = self.reports.get(replica)
        return report.pages_free if report is not None else 0


class RoutingPolicy(ABC):
    """Ranks live replicas for a request, best first; the caller records where it went
    (`ClusterState.routed`)."""

    name: str

    def __init__(self, state: ClusterState) -> None:
        self.state = state

    @abstractmethod
    def rank(self, request: RouteRequest, replicas: Sequence[str]) -> list[str]:
        """`replicas` (non-empty, live) ordered from most to least preferred."""

    def choose(self, request: RouteRequest, replicas: Sequence[str]) -> str:
        """The preferred replica, recorded as routed (the simulator's one-call form)."""
        replica = self.rank(request, replicas)[0]
        self.state.routed(request, replica)
        return replica
