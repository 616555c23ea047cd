"""The routing rules: which replica serves a request. Plain Python, shared by the Ray Serve
request router (radixserve.cluster.router) and `bench simulate --replicas` — the rule
measured is the rule served.

This module picks a rule by name (`make_routing_policy`, `ROUTERS`) and is where every name
of routing is imported from. The parts:
- cluster_state.py: `ClusterState`, what a router knows (each replica's cached pages from its
  cache events, requests in flight, reported free pages, sessions, requests and conversations
  routed lately); `RouteRequest` and `prompt_pages`; `RoutingPolicy`, a rule's interface.
- cache_aware.py: the cache-aware rule (`CacheAwarePolicy`, `CacheAwareConfig`): sessions, then
  the longest prefix a replica holds within balance guards (in flight, conversations started
  lately, requests routed lately), host-tier pages at a credit; its docstring states it.
  `cache-aware-inflight` is the same rule without balance over time, host credit and the
  in-flight share (the rule before them), kept for comparison.
- baseline_routers.py: `power-of-two` (Ray Serve's default), `round-robin` and
  `prefix-affinity` (Ray Serve LLM's PrefixCacheAffinityRouter rule at page granularity).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from radixserve.cluster.baseline_routers import (
    PowerOfTwoPolicy,
    PrefixAffinityPolicy,
    RoundRobinPolicy,
)
from radixserve.cluster.cache_aware import (
    CacheAwareConfig,
    CacheAwarePolicy,
    parse_routing_config,
)
from radixserve.cluster.cluster_state import (
    ENDED_MEMORY,
    RECENT_HALF_LIFE_ROUTINGS,
    SETTLE_GRACE_BATCHES,
    STARTS_HALF_LIFE,
    ClusterState,
    ReplicaReport,
    RouteRequest,
    RoutingPolicy,
    prompt_pages,
)

__all__ = [
    "ENDED_MEMORY", "RECENT_HALF_LIFE_ROUTINGS", "ROUTERS", "SETTLE_GRACE_BATCHES", "STARTS_HALF_LIFE",
    "CacheAwareConfig", "CacheAwarePolicy", "ClusterState", "PowerOfTwoPolicy", "PrefixAffinityPolicy",
    "ReplicaReport", "RoundRobinPolicy", "RouteRequest", "RoutingPolicy", "make_routing_policy",
    "parse_routing_config", "prompt_pages", "replica_imbalance",
]

ROUTERS = ("cache-aware", "cache-aware-inflight", "power-of-two", "round-robin", "prefix-affinity")


def make_routing_policy(name: str, state: ClusterState, *, page_size: int = 16, seed: int = 0,
                config: CacheAwareConfig | None = None) -> RoutingPolicy:
    """A routing policy by name (`ROUTERS`)."""
    if name == "cache-aware":
        return CacheAwarePolicy(state, config)
    if name == "cache-aware-inflight":  # the rule before balance over time, host credit, in-flight share
        return CacheAwarePolicy(state, replace(config or CacheAwareConfig(), host_credit=0.0, recent_abs=math.inf,
                                                       flight_match_rel=0.0))
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
