"""The baseline routing rules the cache-aware rule is measured against (benchmarks).

`power-of-two` (two random replicas, the less loaded: Ray Serve's default), `round-robin`,
and `prefix-affinity` — a re-implementation of Ray Serve LLM's PrefixCacheAffinityRouter rule
at page granularity (see `PrefixAffinityPolicy`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from radixserve.cluster.cluster_state import ClusterState, RouteRequest, RoutingPolicy


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
