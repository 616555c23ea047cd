"""The cache-aware routing rule: a request goes where its prompt is held, within balance guards.

The cache-aware rule (`CacheAwarePolicy`), in order:
1. A request of a session goes to the session's replica while that replica is alive.
2. Balance guard: what a replica holds draws a request only while its in-flight requests
   are at most `min + max(slack, balance_rel * min)`, where `min` is the least loaded
   replica's count. One hot prefix therefore cannot pile onto one replica: past the slack,
   the next request goes to another replica, which computes the prefix once and then shares
   it too. Pages only in flight there (not cached yet) count only if the prefix they extend,
   counted with them, is at least `flight_match_rel` of the prompt: in a burst of new
   conversations that share a system prompt and then differ (a toolset, a document), the
   system prompt in flight would otherwise pull the next conversation after it whatever
   follows, so that every replica computes every toolset; placed by balance instead, a
   replica that computes a toolset draws the next conversations using it. A prefix that runs
   through an earlier prompt routed there (the conversation's previous turn, finished but
   not reported cached yet) counts whatever its share. The slack depends on what is held: `balance_abs`
   for pages in flight, `cached_balance_abs` for cached ones, `continuation_balance_abs` for
   a cached prefix that runs through an earlier prompt routed there (the next turn of a
   conversation, which anywhere else would be recomputed whole, where a shared system prompt
   is computed once per replica). A conversation's slack is counted over the replicas' mean, not the least
   loaded one (bounded loads, as consistent hashing with bounded loads caps a server at a
   margin over the average): when a closed loop's clients finish together on one replica,
   it is empty for a moment, and a slack over that minimum moved every other replica's
   conversations onto it.
3. Conversation guard: a replica that started more conversations lately than the least
   (`ClusterState.share`, by `share_abs` and `share_rel`) is *ahead*. It draws a request
   only if it saves `share_keep_pages` of prefill over every replica not ahead (or
   `share_keep_rel` of the prompt's pages if fewer: `keep_pages`), and its cached slack is
   `ahead_cached_balance_abs`. The in-flight guard alone bounds the queue, not the
   conversations a replica holds, whose later turns all follow them.
4. Balance over time: requests in flight say nothing of conversations whose turns arrive
   minutes apart (between turns nothing is in flight, yet every turn follows its
   conversation). A replica that got more requests lately (`ClusterState.recent_requests`,
   each halving over `recent_half_life` requests routed anywhere) than the least by
   `recent_abs` plus `recent_rel` of it is *busy*: it draws a request only if it saves
   `recent_keep_pages` of prefill over every replica not busy (or `recent_keep_rel` of the
   prompt's pages if fewer). The absolute margin is at least the replicas' mean in flight: a
   difference smaller than the requests a replica serves at once is one batch's timing, not
   a pile-up (in a closed loop the replica whose clients were served first sends their next
   turns first). Past `recent_hard_rel`, what it holds draws nothing: even a conversation's
   next turn moves (recomputed once elsewhere) rather than pile up. A request's own
   conversation's earlier turns there (`ClusterState.own_recent_requests`, from two up) do
   not count against a busy replica for it: moved, the conversation takes them along, and a
   lone chat would only hop.
5. Among the replicas a held prefix draws, the longest prefix (cached pages from its
   events, or pages of a request in flight there; pages continuing them in the replica's
   host tier count `host_credit` each, as NVIDIA Dynamo's router does: loaded back, not
   recomputed, but not free), if at least `min_match_pages` pages; ties go as in 6.
6. Otherwise (nothing useful held anywhere): a replica within the cached slack of the least
   loaded, then one not busy, not ahead, the least loaded, the one with the most free pages
   (least cache to evict), then the fewest requests lately and the fewest cached pages.

`cache-aware-inflight` is the same rule without 4, without host credit and without the
in-flight share of rule 2 (the rule before them), kept for comparison.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from radixserve.cluster.cluster_state import ClusterState, RouteRequest, RoutingPolicy


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
    share_keep_rel: float = 0.1    # ... or this fraction of the prompt's pages if fewer (at least one)
    min_match_pages: int = 1       # a shorter cached prefix does not attract a request
    flight_match_rel: float = 0.5  # a prefix only in flight attracts a request if this share of its prompt
    host_credit: float = 0.75      # a page held in a replica's host tier counts this much of one on its device
    recent_abs: float = 4.0        # requests routed lately (`ClusterState.recent_requests`) over the least
                                   # (or the replicas' mean in flight if more) ...
    recent_rel: float = 0.15       # ... plus this fraction of the least: past both, a replica is *busy*
    recent_keep_pages: int = 64    # ... and draws only requests it saves this many pages of prefill
    recent_keep_rel: float = 0.5   # ... or this fraction of the prompt's pages if fewer (at least one)
    recent_hard_rel: float = 0.35  # past this fraction (plus the margin above), what it holds draws nothing


def keep_pages(limit: int, fraction: float, prompt_pages: int) -> int:
    """Pages of prefill a replica past a guard must save to keep a request: `limit`, or
    `fraction` of the prompt if that is fewer, at least one. Relative, because what moving a
    request costs is relative: with short prompts (or large pages) a fixed count exceeds
    everything a replica could save, and the guard would move every conversation's next turn."""
    share = fraction * prompt_pages
    return max(1, limit if share >= limit else math.ceil(share))  # a fraction of inf: the limit


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
        sticky = state.session_replica(request)
        in_flight = {r: state.requests_in_flight(r) for r in replicas}
        least = min(in_flight.values())
        mean = sum(in_flight.values()) / len(replicas)
        relative = int(cfg.balance_rel * least)
        least_share = min(state.share(r) for r in replicas)
        share_limit = least_share * (1 + cfg.share_rel) + cfg.share_abs
        ahead = {r for r in replicas if state.share(r) > share_limit}
        lately = {r: state.recent_requests(r) for r in replicas}
        least_recent = min(lately.values())
        recent_abs = max(cfg.recent_abs, mean)  # less than a batch apart: timing, not a pile-up
        busy_limit = least_recent * (1 + cfg.recent_rel) + recent_abs
        for r in replicas:
            # The request's own conversation's turns do not make its replica busy for it:
            # moved, the conversation takes them along (a lone chat would only hop around).
            if lately[r] > busy_limit:
                lately[r] -= state.own_recent_requests(r, request)
        busy = {r for r in replicas if lately[r] > busy_limit}
        overloaded = {r for r in busy if lately[r] > least_recent * (1 + cfg.recent_hard_rel) + recent_abs}
        index, namespace, hashes = state.index, request.namespace, request.page_hashes
        credit = cfg.host_credit

        def held(replica: str) -> int:
            # What a replica holds counts only while it is not too far ahead of the least
            # loaded one: a prefix merely in flight there within the tight slack, a prefix
            # already cached within a looser one (a burst of new sessions sharing only a
            # system prompt in flight spreads; a cached conversation is worth a short queue).
            # A conversation's next turn (its cached prefix runs through an earlier prompt
            # routed there) within the loosest, over the mean rather than the least loaded
            # (one replica is empty for a moment whenever its clients finish together):
            # moving it recomputes the whole conversation, where a spilled request of a
            # shared prefix computes that prefix once for many.
            # Pages on a replica's host tier count at `host_credit` each: loaded back, not
            # recomputed, but a load is not free. Pages in flight count only if the prefix they
            # extend, counted with them, is `flight_match_rel` of the prompt: a burst's shared
            # system prompt would otherwise gather conversations that differ after it (each
            # toolset then computed everywhere). A conversation's own previous turn in flight
            # (finished, its events not in yet) counts whatever its share: the prompt runs
            # through it, and a long new message must not move the conversation.
            over = in_flight[replica] - least
            if replica in overloaded:
                matched = 0.0  # too many requests lately: even its conversations go elsewhere
            elif over <= max(cfg.balance_abs, relative):
                matched = index.matched_pages(replica, namespace, hashes, host_credit=credit)
                if (matched < cfg.flight_match_rel * len(hashes)
                        and not index.continued_pages(replica, namespace, hashes, in_flight=True,
                                                      host_credit=credit)):
                    matched = index.matched_pages(replica, namespace, hashes, in_flight=False, host_credit=credit)
            elif over <= max(cfg.ahead_cached_balance_abs if replica in ahead else cfg.cached_balance_abs, relative):
                matched = index.matched_pages(replica, namespace, hashes, in_flight=False, host_credit=credit)
            elif in_flight[replica] - mean <= max(cfg.continuation_balance_abs, relative):
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
        # `recent_abs` and `recent_rel`) keeps a request only for `recent_keep_pages` saved
        # (each keep threshold capped by its share of the prompt, `keep_pages`):
        # turns minutes apart leave nothing in flight, so only this sees them pile up.
        share_keep = keep_pages(cfg.share_keep_pages, cfg.share_keep_rel, len(hashes))
        recent_keep = keep_pages(cfg.recent_keep_pages, cfg.recent_keep_rel, len(hashes))
        best_elsewhere = max((holds[r] for r in replicas if r not in ahead), default=0)
        best_not_busy = max((holds[r] for r in replicas if r not in busy), default=0)
        useful = {r: 0 if (r in ahead and holds[r] - best_elsewhere < share_keep)
                  or (r in busy and holds[r] - best_not_busy < recent_keep) else holds[r]
                  for r in replicas}

        def key(replica: str) -> tuple:
            # Conversations started count after a queue past the cached slack: where nothing
            # held draws the request, a short queue goes before a conversation fewer.
            queued = state.requests_in_flight(replica) - least > max(cfg.cached_balance_abs, relative)
            return (replica != sticky, -useful[replica], queued, replica in busy, replica in ahead,
                    state.requests_in_flight(replica), -state.free_pages(replica), state.recent_requests(replica),
                    index.cached_pages(replica))

        return sorted(replicas, key=key)
