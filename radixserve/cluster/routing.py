"""The routing rules: which replica serves a request. Plain Python, shared by the Ray Serve
request router (radixserve.cluster.router) and `bench simulate --replicas` — the rule
measured is the rule served.

`ClusterState` is what a router knows: each replica's cached pages (a `CacheIndex` fed by
its cache events), the requests it has in flight, its latest reported free pages, and which
replica each session is on. A `RoutingPolicy` ranks the live replicas for one request.

The cache-aware rule (`CacheAwarePolicy`), in order:
1. A request of a session goes to the session's replica while that replica is alive.
2. Balance guard: what a replica holds draws a request only while its in-flight requests
   are at most `min + max(slack, balance_rel * min)`, where `min` is the least loaded
   replica's count. One hot prefix therefore cannot pile onto one replica: past the slack,
   the next request goes to another replica, which computes the prefix once and then shares
   it too. The slack depends on what is held: `balance_abs` for pages in flight,
   `cached_balance_abs` for cached ones, `continuation_balance_abs` for a cached prefix that
   runs through an earlier prompt routed there (the next turn of a conversation, which
   anywhere else would be recomputed whole, where a shared system prompt is computed once
   per replica).
3. Conversation guard: a replica that started more conversations lately than the least
   (`ClusterState.share`, by `share_abs` and `share_rel`) is *ahead*. It draws a request
   only if it saves `share_keep_pages` of prefill over every replica not ahead, and its
   cached slack is `ahead_cached_balance_abs`. The in-flight guard alone bounds the queue,
   not the conversations a replica holds, whose later turns all follow them.
4. Balance over time: requests in flight say nothing of conversations whose turns arrive
   minutes apart (between turns nothing is in flight, yet every turn follows its
   conversation). A replica that got more requests lately (`ClusterState.recent_requests`,
   each halving over `recent_half_life_s`) than the least by `recent_abs` plus `recent_rel`
   of it is *busy*: it draws a request only if it saves `recent_keep_pages` of prefill over
   every replica not busy. Past `recent_hard_rel`, what it holds draws nothing: even a
   conversation's next turn moves (recomputed once elsewhere) rather than pile up.
5. Among the replicas a held prefix draws, the longest prefix (cached pages from its
   events, or pages of a request in flight there; pages continuing them in the replica's
   host tier count `host_credit` each, as NVIDIA Dynamo's router does: loaded back, not
   recomputed, but not free), if at least `min_match_pages` pages; ties go as in 6.
6. Otherwise (nothing useful held anywhere): a replica within the cached slack of the least
   loaded, then one not busy, not ahead, the least loaded, the one with the most free pages
   (least cache to evict), then the fewest requests lately and the fewest cached pages.

`cache-aware-inflight` is the same rule without 4 and without host credit (the rule before
them), kept for comparison.

Baselines (for benchmarks): `power-of-two` (two random replicas, the less loaded: Ray
Serve's default), `round-robin`, and `prefix-affinity` — a re-implementation of Ray Serve
LLM's PrefixCacheAffinityRouter rule at page granularity (see `PrefixAffinityPolicy`).
"""

from __future__ import annotations

import math
import random
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from radixserve.cache.page_hash import PageHashing
from radixserve.cluster.index import CacheIndex

ROUTERS = ("cache-aware", "cache-aware-inflight", "power-of-two", "round-robin", "prefix-affinity")
ENDED_MEMORY = 65536  # finished request ids remembered (see ClusterState.finished)
SETTLE_GRACE_BATCHES = 40  # event batches of a replica after which an unsettled request is dropped
RECENT_HALF_LIFE_S = 300.0  # seconds over which a replica's count of recently routed requests halves
STARTS_HALF_LIFE = 1024  # conversations started (anywhere) over which a replica's count of starts halves
_STARTS_DECAY = 0.5 ** (1 / STARTS_HALF_LIFE)


@dataclass(frozen=True)
class RouteRequest:
    """What routing looks at: the prompt's page hashes in its cache namespace."""

    request_id: str
    namespace: str              # namespace id and page hashes of the prompt: `prompt_pages`
    page_hashes: Sequence[int]
    prompt_tokens: int
    session_id: str | None = None
    replica_request_id: str | None = None  # the id the replica knows it by (default: request_id)

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
    sessions: dict[str, str] = field(default_factory=dict)        # session id → replica
    clock: Callable[[], float] = time.monotonic                    # seconds (the simulator's own clock there)
    recent_half_life_s: float = RECENT_HALF_LIFE_S
    _recent: dict[str, tuple[float, float]] = field(default_factory=dict)  # replica → (decayed count, as of)
    _placed: dict[str, tuple[str, str, bool]] = field(default_factory=dict)  # request id → (replica, settle key, a start)
    _ended: OrderedDict[str, None] = field(default_factory=OrderedDict)  # recently finished ids
    _batches: dict[str, int] = field(default_factory=dict)        # replica → event batches applied
    _unsettled: dict[str, tuple[str, int]] = field(default_factory=dict)  # settle key → (replica, batch)

    def routed(self, request: RouteRequest, replica: str) -> None:
        """The request goes to `replica`: count it and note its prompt as in flight there.
        Routing the same request again (a retry, or Serve choosing another replica than the
        one reserved) moves it."""
        placed = self._placed.get(request.request_id)
        if (placed is not None and placed[0] == replica) or request.request_id in self._ended:
            return  # already there, or a late report of a request that has finished
        self._unroute(request.request_id)
        start = not self.index.continued_pages(replica, request.namespace, request.page_hashes, in_flight=True)
        self._placed[request.request_id] = (replica, request.settle_key, start)
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        self.routed_total[replica] = self.routed_total.get(replica, 0) + 1
        self._add_recent(replica, 1.0)
        if start:
            self.share(replica)  # a replica first routed to joins at the least share
            for known in self.starts:
                self.starts[known] *= _STARTS_DECAY
            self.starts[replica] += 1.0
        self.index.add_in_flight(request.settle_key, replica, request.namespace, request.page_hashes)
        self.index.add_prompt_end(replica, request.namespace, request.page_hashes)
        if request.session_id is not None:
            self.sessions[request.session_id] = replica

    def finished(self, request_id: str) -> None:
        """The request ended (done, failed or cancelled): its replica's requests in flight drop by one; its
        prompt stays in flight until the replica settles it, or for SETTLE_GRACE_BATCHES of
        the replica's event batches (a request cancelled before the replica ran it is never
        settled). Ray Serve may report a short request's completion before its routing:
        the id is remembered for a while, and a late `routed` for it is ignored (else it
        would count as in flight forever)."""
        placed = self._release(request_id)
        if placed is not None:
            replica, key, _ = placed
            if self.index.in_flight_on(key) is not None:
                self._unsettled[key] = (replica, self._batches.get(replica, 0))
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

    def _release(self, request_id: str) -> tuple[str, str, bool] | None:
        """Forgets where a request was placed and drops it from its replica's requests in flight; returns
        (replica, settle key, whether it started a conversation), or None if it was not placed."""
        placed = self._placed.pop(request_id, None)
        if placed is not None and placed[0] in self.in_flight:
            self.in_flight[placed[0]] = max(0, self.in_flight[placed[0]] - 1)
        return placed

    def _unroute(self, request_id: str) -> None:
        """Takes back a routing: the request was not served there after all."""
        placed = self._release(request_id)
        if placed is None:
            return
        replica, key, start = placed
        if replica in self.routed_total:
            self.routed_total[replica] -= 1
        self._add_recent(replica, -1.0)
        if start and replica in self.starts:
            self.starts[replica] = max(0.0, self.starts[replica] - 1.0)
        self.index.end_in_flight(key)

    def remove(self, replica: str) -> None:
        """A replica died or left: forget its cache, its requests in flight and its sessions."""
        self.index.forget(replica)
        self.in_flight.pop(replica, None)
        self.starts.pop(replica, None)
        self._recent.pop(replica, None)
        self.reports.pop(replica, None)
        self._batches.pop(replica, None)
        for session in [s for s, r in self.sessions.items() if r == replica]:
            del self.sessions[session]
        for request_id in [q for q, (r, _, _) in self._placed.items() if r == replica]:
            del self._placed[request_id]
        for key in [k for k, (r, _) in self._unsettled.items() if r == replica]:
            del self._unsettled[key]

    def recent_requests(self, replica: str) -> float:
        """Requests routed to `replica` lately: each counts 1 when routed and halves every
        `recent_half_life_s` seconds. Unlike requests in flight, this sees the turns of
        conversations that arrive minutes apart: between two turns nothing is in flight,
        yet the replica serves them all."""
        count, at = self._recent.get(replica, (0.0, 0.0))
        if not count:
            return 0.0
        return count * 0.5 ** (max(0.0, self.clock() - at) / self.recent_half_life_s)

    def _add_recent(self, replica: str, amount: float) -> None:
        self._recent[replica] = (max(0.0, self.recent_requests(replica) + amount), self.clock())

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


@dataclass(frozen=True)
class CacheAwareConfig:
    """Thresholds of the cache-aware rule (measured in docs/benchmark.md)."""

    balance_abs: int = 1           # in-flight requests over the least loaded replica's, always allowed
    cached_balance_abs: int = 8    # ... when the prefix is already cached there (not only in flight)
    ahead_cached_balance_abs: int = 3  # ... the same on a replica *ahead* in conversations started lately
    continuation_balance_abs: int = 8  # ... when the cached prefix continues a conversation held there
    balance_rel: float = 0.25      # ... or this fraction of the least loaded replica's count
    share_abs: float = 1.0         # conversations started lately (`ClusterState.share`) over the least ...
    share_rel: float = 0.1         # ... plus this fraction of the least: past both, a replica is *ahead*
    share_keep_pages: int = 8      # ... and draws only requests it saves this many pages of prefill
    min_match_pages: int = 1       # a shorter cached prefix does not attract a request
    host_credit: float = 0.75      # a page held in a replica's host tier counts this much of one on its device
    recent_abs: float = 4.0        # requests routed lately (`ClusterState.recent_requests`) over the least ...
    recent_rel: float = 0.15       # ... plus this fraction of the least: past both, a replica is *busy*
    recent_keep_pages: int = 64    # ... and draws only requests it saves this many pages of prefill
    recent_hard_rel: float = 0.35  # past this fraction (plus recent_abs), what it holds draws nothing


def parse_routing_config(text: str) -> CacheAwareConfig:
    """`CacheAwareConfig` from "field=value,..." (the benchmarks' --router-kwargs)."""
    from dataclasses import fields

    kinds = {f.name: f.type for f in fields(CacheAwareConfig)}
    values: dict[str, float | int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in kinds:
            raise ValueError(f"router kwargs: expected field=value with a field of {sorted(kinds)}, got {item!r}")
        try:
            values[name] = int(value) if kinds[name] == "int" else float(value)
        except ValueError:
            raise ValueError(f"router kwargs: {name} needs a number, got {value!r}") from None
    return CacheAwareConfig(**values)


class CacheAwarePolicy(RoutingPolicy):
    """Sessions, then the longest prefix a replica holds within the balance and conversation
    guards, then requests in flight (the rule in the module docstring)."""

    name = "cache-aware"

    def __init__(self, state: ClusterState, config: CacheAwareConfig | None = None) -> None:
        super().__init__(state)
        self.config = config or CacheAwareConfig()

    def rank(self, request: RouteRequest, replicas: Sequence[str]) -> list[str]:
        state, cfg = self.state, self.config
        sticky = state.sessions.get(request.session_id) if request.session_id is not None else None
        least = min(state.requests_in_flight(r) for r in replicas)
        relative = int(cfg.balance_rel * least)
        least_share = min(state.share(r) for r in replicas)
        share_limit = least_share * (1 + cfg.share_rel) + cfg.share_abs
        ahead = {r for r in replicas if state.share(r) > share_limit}
        least_recent = min(state.recent_requests(r) for r in replicas)
        busy = {r for r in replicas if state.recent_requests(r) > least_recent * (1 + cfg.recent_rel) + cfg.recent_abs}
        overloaded = {r for r in busy
                      if state.recent_requests(r) > least_recent * (1 + cfg.recent_hard_rel) + cfg.recent_abs}
        index, namespace, hashes = state.index, request.namespace, request.page_hashes
        credit = cfg.host_credit

        def held(replica: str) -> int:
            # What a replica holds counts only while it is not too far ahead of the least
            # loaded one: a prefix merely in flight there within the tight slack, a prefix
            # already cached within a looser one (a burst of new sessions sharing only a
            # system prompt in flight spreads; a cached conversation is worth a short queue).
            # A conversation's next turn (its cached prefix runs through an earlier prompt
            # routed there) within the loosest: moving it recomputes the whole conversation,
            # where a spilled request of a shared prefix computes that prefix once for many.
            # Pages on a replica's host tier count at `host_credit` each: loaded back, not
            # recomputed, but a load is not free.
            over = state.requests_in_flight(replica) - least
            if replica in overloaded:
                matched = 0.0  # too many requests lately: even its conversations go elsewhere
            elif over <= max(cfg.balance_abs, relative):
                matched = index.matched_pages(replica, namespace, hashes, host_credit=credit)
            elif over <= max(cfg.ahead_cached_balance_abs if replica in ahead else cfg.cached_balance_abs, relative):
                matched = index.matched_pages(replica, namespace, hashes, in_flight=False, host_credit=credit)
            elif over <= max(cfg.continuation_balance_abs, relative):
                matched = index.continued_pages(replica, namespace, hashes, host_credit=credit)
            else:
                matched = 0.0
            return matched if matched >= cfg.min_match_pages else 0.0

        holds = {r: held(r) for r in replicas}
        # A replica ahead in conversations started lately draws a request only if it saves
        # at least `share_keep_pages` of prefill over every replica not ahead. Otherwise new
        # conversations (whose shared system prompt every replica caches) and the early turns
        # of one, cheap to move, stay where first turns happened to pile up, and the replica
        # serves their later turns too. A hot prefix cached there alone still wins.
        # Likewise a *busy* replica (more requests routed there lately than the least, by
        # `recent_abs` and `recent_rel`) keeps a request only for `recent_keep_pages` saved:
        # turns minutes apart leave nothing in flight, so only this sees them pile up.
        best_elsewhere = max((holds[r] for r in replicas if r not in ahead), default=0)
        best_not_busy = max((holds[r] for r in replicas if r not in busy), default=0)
        useful = {r: 0 if (r in ahead and holds[r] - best_elsewhere < cfg.share_keep_pages)
                  or (r in busy and holds[r] - best_not_busy < cfg.recent_keep_pages) else holds[r]
                  for r in replicas}

        def key(replica: str) -> tuple:
            # Conversations started count after a queue past the cached slack: where nothing
            # held draws the request, a short queue goes before a conversation fewer.
            queued = state.requests_in_flight(replica) - least > max(cfg.cached_balance_abs, relative)
            return (replica != sticky, -useful[replica], queued, replica in busy, replica in ahead,
                    state.requests_in_flight(replica), -state.free_pages(replica), state.recent_requests(replica),
                    index.cached_pages(replica))

        return sorted(replicas, key=key)


class PowerOfTwoPolicy(RoutingPolicy):
    """Two replicas at random, the one with fewer requests in flight first (Ray Serve's
    default PowerOfTwoChoicesRequestRouter, on the router's own in-flight counts)."""

    name = "power-of-two"

    def __init__(self, state: ClusterState, seed: int = 0) -> None:
        super().__init__(state)
        self.rng = random.Random(seed)

    def rank(self, request: RouteRequest, replicas: Sequence[str]) -> list[str]:
        picked = self.rng.sample(list(replicas), min(2, len(replicas)))
        picked.sort(key=self.state.requests_in_flight)
        return picked + [r for r in replicas if r not in picked]


class RoundRobinPolicy(RoutingPolicy):
    """Each replica in turn, ignoring cache and requests in flight."""

    name = "round-robin"

    def __init__(self, state: ClusterState) -> None:
        super().__init__(state)
        self._next = 0

    def rank(self, request: RouteRequest, replicas: Sequence[str]) -> list[str]:
        ordered = sorted(replicas)
        start = self._next % len(ordered)
        self._next += 1
        return ordered[start:] + ordered[:start]


class PrefixAffinityPolicy(RoutingPolicy):
    """A re-implementation of Ray Serve LLM's PrefixCacheAffinityRouter rule (Ray 2.x,
    defaults), for the simulator; `bench serve` runs Ray's own class.

    Ray keeps a character prefix tree of every prompt it routed, per replica (a guess from
    routing history, not the replicas' caches; no eviction by default). A request goes to
    the replicas owning the longest matched prefix, or — when the match is under
    `match_rate_threshold` of the prompt — to the replicas with the fewest characters in the
    tree; Serve then takes the one with the shortest queue among them. With the default
    `imbalanced_threshold` of infinity, queue lengths never override the match.

    Differences, all of granularity: prompts are token ids here, so the tree is over tokens,
    kept as chained page hashes (a match is counted in whole pages; the "smallest tenant" by
    routed pages instead of characters).
    """

    name = "prefix-affinity"

    def __init__(self, state: ClusterState, match_rate_threshold: float = 0.1,
                 imbalanced_threshold: float = float("inf"), page_size: int = 16) -> None:
        super().__init__(state)
        self.match_rate_threshold = match_rate_threshold
        self.imbalanced_threshold = imbalanced_threshold
        self.page_size = page_size
        self.history: dict[str, set[tuple[str, int]]] = {}
        self._fallback = PowerOfTwoPolicy(state)

    def rank(self, request: RouteRequest, replicas: Sequence[str]) -> list[str]:
        loads = [self.state.requests_in_flight(r) for r in replicas]
        if max(loads) - min(loads) > self.imbalanced_threshold:
            return self._fallback.rank(request, replicas)
        matched = {r: self._matched(r, request) for r in replicas}
        best = max(matched.values())
        if best * self.page_size / max(request.prompt_tokens, 1) < self.match_rate_threshold:
            sizes = {r: len(self.history.get(r, ())) for r in replicas}
            chosen = [r for r in replicas if sizes[r] == min(sizes.values())]
        else:
            chosen = [r for r in replicas if matched[r] == best]
        chosen.sort(key=self.state.requests_in_flight)
        ranked = chosen + [r for r in replicas if r not in chosen]
        return ranked

    def choose(self, request: RouteRequest, replicas: Sequence[str]) -> str:
        replica = super().choose(request, replicas)
        self.history.setdefault(replica, set()).update((request.namespace, h) for h in request.page_hashes)
        return replica

    def _matched(self, replica: str, request: RouteRequest) -> int:
        seen = self.history.get(replica, set())
        matched = 0
        for h in request.page_hashes:
            if (request.namespace, h) not in seen:
                break
            matched += 1
        return matched


def make_routing_policy(name: str, state: ClusterState, *, page_size: int = 16, seed: int = 0,
                config: CacheAwareConfig | None = None) -> RoutingPolicy:
    """A routing policy by name (`ROUTERS`)."""
    if name == "cache-aware":
        return CacheAwarePolicy(state, config)
    if name == "cache-aware-inflight":  # the rule before time-decayed balance and host credit
        return CacheAwarePolicy(state, replace(config or CacheAwareConfig(), host_credit=0.0, recent_abs=math.inf))
    if name == "power-of-two":
        return PowerOfTwoPolicy(state, seed)
    if name == "round-robin":
        return RoundRobinPolicy(state)
    if name == "prefix-affinity":
        return PrefixAffinityPolicy(state, page_size=page_size)
    raise ValueError(f"router: unknown {name!r}, expected one of {list(ROUTERS)}")


def replica_imbalance(counts: Sequence[int]) -> float:
    """max / min requests per replica (inf when a replica got none)."""
    if not counts:
        return float("nan")
    return max(counts) / min(counts) if min(counts) else float("inf")
