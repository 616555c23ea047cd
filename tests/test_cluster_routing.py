"""The routing rules, the per-replica cache index and the replica's event feed (no Ray)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from radixserve import Engine, SamplingParams
from radixserve.cache.events import AllCleared, BlockRemoved, BlockStored
from radixserve.cache.page_hash import namespace_id
from radixserve.cli import build_parser, main
from radixserve.cluster import cluster_state
from radixserve.cluster.cache_aware import keep_pages
from radixserve.cluster.feed import EventFeed
from radixserve.cluster.index import CacheIndex
from radixserve.cluster.routing import (
    CacheAwareConfig,
    ClusterState,
    PrefixAffinityPolicy,
    SETTLE_GRACE_BATCHES,
    STARTS_HALF_LIFE,
    ReplicaReport,
    RouteRequest,
    make_routing_policy,
    parse_routing_config,
    prompt_pages,
    replica_imbalance,
)
from radixserve.cluster.stats import merge_stats
from radixserve.cluster.view import ClusterView

PAGE = 4
NS = namespace_id(("demo", None))
NS_B = namespace_id(("demo", "tenant-b"))


def hashes(tokens: list[int], namespace: str = NS) -> list[int]:
    salt = {NS: None, NS_B: "tenant-b"}[namespace]
    ns, out = prompt_pages(tokens, PAGE, ("demo", salt))
    assert ns == namespace
    return out


def stored(seq: int, hs: list[int], namespace: str = NS, tier: str = "device") -> BlockStored:
    return BlockStored(seq=seq, namespace=namespace, tier=tier, page_size=PAGE, parent_hash=None,
                       hashes=hs, token_ids=None)


def request(tokens: list[int], request_id: str = "r", namespace: str = NS,
            session_id: str | None = None) -> RouteRequest:
    return RouteRequest(request_id, namespace, hashes(tokens, namespace), len(tokens), session_id)


SYSTEM = list(range(100, 116))            # 4 pages
PROMPT = SYSTEM + [7, 8, 9, 10, 11, 12]   # 5 full pages + 2 tokens


# ---------------------------------------------------------------- the index


def test_index_applies_events_in_order_and_matches_leading_pages() -> None:
    index = CacheIndex()
    h = hashes(PROMPT)
    assert len(h) == 5
    index.apply("a", [stored(1, h[:3])])
    assert index.matched_pages("a", NS, h) == 3
    assert index.matched_pages("a", NS_B, hashes(PROMPT, NS_B)) == 0  # another tenant's namespace
    assert index.matched_pages("b", NS, h) == 0
    index.apply("a", [stored(2, h[3:]), BlockRemoved(seq=3, namespace=NS, tier="device", hashes=[h[4], h[3]])])
    assert index.matched_pages("a", NS, h) == 3
    index.apply("a", [BlockRemoved(seq=4, namespace=NS, tier="device", hashes=[h[1]])])
    assert index.matched_pages("a", NS, h) == 1  # a gap ends the match even if later pages are held
    index.apply("a", [stored(5, h, tier="host")])
    assert index.matched_pages("a", NS, h) == 1  # only the device tier counts
    assert index.page_set("a") == {(NS, h[0]), (NS, h[2])}
    index.apply("a", [AllCleared(seq=6, tier=None), stored(7, h[:2])])
    assert index.page_set("a") == {(NS, h[0]), (NS, h[1])} and index.cached_pages("a") == 2


def test_index_in_flight_counts_until_the_request_ends() -> None:
    index = CacheIndex()
    h = hashes(PROMPT)
    index.add_in_flight("q1", "a", NS, h[:4])
    index.add_in_flight("q2", "a", NS, h[:2])
    assert index.matched_pages("a", NS, h) == 4
    index.end_in_flight("q1")
    assert index.matched_pages("a", NS, h) == 2  # q2 still holds the first two
    index.end_in_flight("q2")
    index.end_in_flight("q2")  # twice is harmless
    assert index.matched_pages("a", NS, h) == 0
    index.add_in_flight("q3", "a", NS, h)
    index.forget("a")
    assert index.matched_pages("a", NS, h) == 0 and index.replicas == []


def test_index_keeps_no_empty_namespace_and_counts_pages_as_events_apply() -> None:
    # A cache salt per request: 200 namespaces used once, each page later evicted (both
    # tiers) and each prompt settled. Nothing of them stays, and the page count follows.
    index = CacheIndex()
    for i in range(200):
        ns = f"salt-{i}"
        index.add_in_flight(f"q{i}", "a", ns, [1, 2, 3])
        index.apply("a", [BlockStored(seq=i, namespace=ns, tier=tier, page_size=PAGE, parent_hash=None,
                                      hashes=[1, 2, 3], token_ids=None) for tier in ("device", "host")])
        index.end_in_flight(f"q{i}")
    index.apply("a", [stored(1000, [7, 8])])
    assert index.cached_pages("a") == 602
    for i in range(200):
        index.apply("a", [BlockRemoved(seq=2000 + i, namespace=f"salt-{i}", tier=tier, hashes=[1, 2, 3, 9])
                          for tier in ("device", "host")])
    assert index.cached_pages("a") == 2
    assert (index._cached["a"], index._host["a"], index._in_flight["a"]) == ({NS: {7, 8}}, {}, {})
    index.apply("a", [stored(3000, [7, 9]), AllCleared(seq=3001, tier="host")])
    assert index.cached_pages("a") == 3
    index.apply("a", [AllCleared(seq=3002, tier=None), stored(3003, [5])])
    assert index.cached_pages("a") == 1
    index.forget("a")
    assert index.cached_pages("a") == 0
    # A prompt of no full page in flight beside one of the same namespace: the other's end
    # empties the namespace's entry; its own end then finds none (it raised KeyError).
    index.add_in_flight("short", "a", NS, [])
    index.add_in_flight("long", "a", NS, [1, 2])
    index.end_in_flight("long")
    index.end_in_flight("short")
    assert index._in_flight["a"] == {}


# ---------------------------------------------------------------- the cache-aware rule


def cluster(*replicas: str) -> ClusterState:
    state = ClusterState()
    for r in replicas:
        state.index.apply(r, [])
        state.reports[r] = ReplicaReport(pages_free=100, pages_total=100)
    return state


def test_cache_aware_prefers_the_longest_real_prefix() -> None:
    state = cluster("a", "b", "c")
    h = hashes(PROMPT)
    state.index.apply("b", [stored(1, h[:2])])
    state.index.apply("c", [stored(1, h[:4])])
    policy = make_routing_policy("cache-aware", state)
    assert policy.rank(request(PROMPT), ["a", "b", "c"]) == ["c", "b", "a"]
    # Another tenant's salt: nothing is shared, the emptiest replica wins.
    state.reports["b"].pages_free = 120
    assert policy.rank(request(PROMPT, namespace=NS_B), ["a", "b", "c"])[0] == "b"


def test_cache_aware_balance_guard_spreads_a_hot_prefix() -> None:
    state = cluster("a", "b")
    policy = make_routing_policy("cache-aware", state, config=CacheAwareConfig(balance_abs=2, cached_balance_abs=2, balance_rel=0.5))
    placed = [policy.choose(request(PROMPT, f"r{i}"), ["a", "b"]) for i in range(8)]
    # The first lands on either (tie), then sticks (in flight) until it is 2 ahead, and so on.
    first = placed[0]
    other = "b" if first == "a" else "a"
    assert placed[:4] == [first, first, first, other]
    assert state.in_flight == {first: 4, other: 4} or state.in_flight == {first: 5, other: 3}
    assert abs(state.in_flight["a"] - state.in_flight["b"]) <= 2
    # At 10 in flight the relative slack (0.5 * 10 = 5) allows more affinity.
    state = cluster("a", "b")
    state.in_flight = {"a": 14, "b": 10}
    state.index.apply("a", [stored(1, hashes(PROMPT))])
    assert policy.__class__(state, policy.config).rank(request(PROMPT), ["a", "b"])[0] == "a"
    state.in_flight = {"a": 16, "b": 10}
    assert policy.__class__(state, policy.config).rank(request(PROMPT), ["a", "b"])[0] == "b"


def test_a_prefix_only_in_flight_binds_less_than_a_cached_one() -> None:
    """Default slack: 1 request over the least loaded for a prefix still being computed
    there, 8 for a prefix already cached there."""
    state = cluster("a", "b")
    policy = make_routing_policy("cache-aware", state)
    state.index.add_in_flight("q0", "a", NS, hashes(PROMPT))
    state.in_flight = {"a": 2, "b": 0}
    assert policy.rank(request(PROMPT), ["a", "b"])[0] == "b"   # in flight only: 2 over is too far
    state.in_flight = {"a": 1, "b": 0}
    assert policy.rank(request(PROMPT), ["a", "b"])[0] == "a"
    state.index.apply("a", [stored(1, hashes(PROMPT))])
    state.in_flight = {"a": 8, "b": 0}
    assert policy.rank(request(PROMPT), ["a", "b"])[0] == "a"   # cached: 8 over is still worth it
    state.in_flight = {"a": 9, "b": 0}
    assert policy.rank(request(PROMPT), ["a", "b"])[0] == "b"


def test_a_conversation_continued_holds_its_replica_longer_than_a_shared_prefix() -> None:
    """Default slack 8 for a cached prefix over the least loaded replica, and for a prompt
    whose cached prefix runs through an earlier prompt routed to that replica (the next turn
    of a conversation) over the replicas' mean; on a replica ahead in conversations started,
    3 for a cached prefix merely shared (the system prompt another conversation left there),
    still 8 over the mean for the conversation."""
    state = cluster("a", "b")
    policy = make_routing_policy("cache-aware", state)
    turn1 = SYSTEM + list(range(7, 39))             # 12 full pages
    state.routed(request(turn1, "t1"), "a")
    state.finished("t1")
    turn2 = turn1 + [50, 51, 52, 53] + [60, 61]     # + its reply + a new message
    state.index.apply("a", [stored(1, hashes(turn1 + [50, 51, 52, 53]))])
    state.settled("a", ["t1"])
    assert state.index.continued_pages("a", NS, hashes(turn2)) == 13
    hot = SYSTEM + list(range(200, 240))            # a prompt cached on a alone, no conversation
    state.index.apply("a", [stored(2, hashes(hot))])
    assert state.index.matched_pages("a", NS, hashes(hot)) == 14
    assert state.index.continued_pages("a", NS, hashes(hot)) == 0
    state.starts = {"a": 0.0, "b": 0.0}
    state.in_flight = {"a": 8, "b": 0}
    assert policy.rank(request(turn2, "t2"), ["a", "b"])[0] == "a"
    assert policy.rank(request(turn1, "again"), ["a", "b"])[0] == "a"   # a repeat continues too
    assert policy.rank(request(hot + [1], "h"), ["a", "b"])[0] == "a"
    state.in_flight = {"a": 9, "b": 0}
    assert policy.rank(request(turn2, "t2"), ["a", "b"])[0] == "a"  # 4.5 over the mean
    assert policy.rank(request(hot + [1], "h"), ["a", "b"])[0] == "b"  # 9 over the least
    state.in_flight = {"a": 16, "b": 0}
    assert policy.rank(request(turn2, "t2"), ["a", "b"])[0] == "a"  # 8 over the mean
    state.in_flight = {"a": 17, "b": 0}
    assert policy.rank(request(turn2, "t2"), ["a", "b"])[0] == "b"
    state.starts = {"a": 3.0, "b": 0.0}             # a is ahead
    state.in_flight = {"a": 3, "b": 0}
    assert policy.rank(request(hot + [1], "h"), ["a", "b"])[0] == "a"
    state.in_flight = {"a": 4, "b": 0}
    assert policy.rank(request(hot + [1], "h"), ["a", "b"])[0] == "b"
    state.in_flight = {"a": 16, "b": 0}
    assert policy.rank(request(turn2, "t2"), ["a", "b"])[0] == "a"
    state.in_flight = {"a": 17, "b": 0}
    assert policy.rank(request(turn2, "t2"), ["a", "b"])[0] == "b"
    # Evicted down to the system prompt, the conversation no longer holds the replica.
    state.index.apply("a", [BlockRemoved(seq=3, namespace=NS, tier="device", hashes=hashes(turn2)[4:])])
    assert state.index.continued_pages("a", NS, hashes(turn2)) == 0


def test_a_replica_empty_for_a_moment_does_not_draw_the_others_conversations() -> None:
    """A closed loop of agents, 16 on each of four replicas: the clients of one replica
    finish together, and for a moment it has nothing in flight. The next turn of a
    conversation held on a busier replica stays there while that replica is within the
    conversation slack of the mean (16 against a mean of 8.25); over the least loaded
    replica, as before, it moved (and was recomputed whole)."""
    state = cluster("a", "b", "c", "d")
    policy = make_routing_policy("cache-aware", state)
    turn1 = SYSTEM + list(range(7, 39))             # 12 full pages
    turn2 = turn1 + [50, 51, 52, 53] + [60, 61]
    for replica in "abcd":                          # every replica caches the system prompt
        state.index.apply(replica, [stored(1, hashes(SYSTEM))])
    state.routed(request(turn1, "t1"), "a")
    state.finished("t1")
    state.index.apply("a", [stored(2, hashes(turn1 + [50, 51, 52, 53]))])
    state.settled("a", ["t1"])
    state.starts = dict.fromkeys("abcd", 0.0)
    state.in_flight = {"a": 16, "b": 14, "c": 0, "d": 3}
    assert policy.rank(request(turn2, "t2"), list("abcd"))[0] == "a"
    state.in_flight = {"a": 17, "b": 14, "c": 0, "d": 3}   # 8.5 over the mean: balance wins
    assert policy.rank(request(turn2, "t2"), list("abcd"))[0] == "c"
    # A request that only shares the system prompt goes to the least loaded replica.
    state.in_flight = {"a": 16, "b": 14, "c": 0, "d": 3}
    assert policy.rank(request(SYSTEM + [900, 901, 902, 903], "new"), list("abcd"))[0] == "c"


def test_a_burst_sharing_a_system_prompt_in_flight_gathers_by_what_follows_it() -> None:
    """Eight agents start together, alternating two toolsets after one system prompt, over four
    empty replicas. The system prompt in flight (4 of a prompt's 14 pages) does not draw the
    next agent after it (less than half the prompt): agents go by balance, and a replica
    computing an agent's system prompt and toolset (12 pages in flight) draws the next agent of
    that toolset. Each toolset is computed on two replicas; drawn by the system prompt in
    flight (`flight_match_rel=0`, the rule before), three replicas or more computed both."""
    toolsets = [list(range(1000, 1032)), list(range(2000, 2032))]   # 8 pages each

    def placements(config: CacheAwareConfig | None) -> dict[int, set[str]]:
        state = cluster("a", "b", "c", "d")
        policy = make_routing_policy("cache-aware", state, config=config)
        used: dict[int, set[str]] = {0: set(), 1: set()}
        for agent in range(8):
            prompt = SYSTEM + toolsets[agent % 2] + [3000 + agent] * 8   # 4 + 8 + 2 pages
            used[agent % 2].add(policy.choose(request(prompt, f"agent{agent}"), list("abcd")))
        return used

    gathered = placements(None)
    assert len(gathered[0]) == len(gathered[1]) == 2 and not gathered[0] & gathered[1]
    spread = placements(CacheAwareConfig(flight_match_rel=0.0))
    assert len(spread[0] & spread[1]) >= 3


def test_a_conversation_s_previous_turn_in_flight_draws_its_next_whatever_its_share() -> None:
    """A turn finished on a before a's events came in is still only in flight there. The next
    turn, with a long new message, more than doubles the prompt: the previous turn is less
    than half of it, but the prompt runs through it, so it is the conversation's own prefix,
    not a shared one, and the turn stays (moved, the conversation would be computed twice)."""
    state = cluster("a", "b", "c", "d")
    policy = make_routing_policy("cache-aware", state)
    state.routed(request(SYSTEM + [5000] * 8, "other"), "a")       # a has one other in flight
    turn1 = SYSTEM + list(range(7, 47))                               # 14 full pages
    state.routed(request(turn1, "t1"), "a")
    state.finished("t1")                                              # no events, no settle yet
    turn2 = turn1 + list(range(600, 680)) + [1, 2]                    # 34 full pages
    assert state.index.matched_pages("a", NS, hashes(turn2)) == 14
    assert state.index.matched_pages("a", NS, hashes(turn2), in_flight=False) == 0
    assert policy.rank(request(turn2, "t2"), list("abcd"))[0] == "a"
    # A prompt that shares only the system prompt in flight there still goes by balance.
    assert policy.rank(request(SYSTEM + list(range(800, 840)), "new"), list("abcd"))[0] != "a"


def test_share_counts_conversations_started_not_turns_continued() -> None:
    """A request that does not continue a conversation its replica holds is a start; starts
    decay by half over STARTS_HALF_LIFE starts; a replica first seen joins at the least
    share; a request routed again takes its start back."""
    state = cluster("a", "b")
    policy = make_routing_policy("cache-aware", state)
    turn1 = SYSTEM + [7, 8, 9, 10]
    assert policy.choose(request(turn1, "t1"), ["a", "b"]) == "a"
    assert (state.share("a"), state.share("b")) == (1.0, 0.0)
    state.finished("t1")
    state.index.apply("a", [stored(1, hashes(turn1 + [50, 51, 52, 53]))])
    state.settled("a", ["t1"])
    state.routed(request(turn1 + [50, 51, 52, 53, 60, 61, 62, 63], "t2"), "a")   # its next turn
    assert state.share("a") == 1.0
    state.routed(request(turn1, "t1-again"), "a")   # a repeat of a prompt held there: not a start
    assert state.share("a") == 1.0
    state.routed(request(SYSTEM + [90, 91, 92, 93], "s"), "a")   # the system prompt only: a start
    decay = 0.5 ** (1 / STARTS_HALF_LIFE)
    assert state.share("a") == pytest.approx(decay + 1.0)
    assert state.share("b") == 0.0
    assert state.share("c") == 0.0                 # joins at the least share
    state.routed(request(SYSTEM + [90, 91, 92, 93], "s"), "b")   # Serve sent it elsewhere after all
    assert state.share("a") == pytest.approx(decay)     # taken back; a move ages no other start
    assert state.share("b") == 1.0
    state.remove("b")
    assert "b" not in state.starts


def test_a_replica_ahead_in_conversations_draws_only_what_saves_prefill() -> None:
    """Replica a started 3 conversations lately, b none: a is ahead (3 > 0 * 1.1 + 1). To keep
    a request it must save `keep_pages(8, 0.1, prompt pages)` pages over b: 1 for a prompt of
    up to 10 pages, 2 for 11-20, ... 8 from 71. A new conversation whose system prompt both
    cache goes to b although a has more free pages; so does a turn of a long conversation
    that a holds only one page more of (1 of 28 pages to recompute on b). A turn saving 2 of
    6 pages, a conversation 8 pages past the system prompt and a prompt only a caches stay."""
    state = cluster("a", "b")
    state.reports["a"] = ReplicaReport(pages_free=200, pages_total=200)
    policy = make_routing_policy("cache-aware", state)
    early = SYSTEM + [7, 8, 9, 10]                   # 5 pages; its next turn has 6
    late = SYSTEM + list(range(300, 332))            # 12 pages: 8 past the system prompt
    hot = list(range(200, 240))                      # 10 pages cached on a alone
    shared = SYSTEM + list(range(400, 492))          # 27 pages, cached on both
    for seq, (tokens, rid) in enumerate([(early, "e"), (late, "l"), (hot, "h"), (shared, "x")]):
        state.routed(request(tokens, rid), "a")
        state.finished(rid)
        state.index.apply("a", [stored(seq, hashes(tokens + [50, 51, 52, 53]))])
        state.settled("a", [rid])
    state.index.apply("b", [stored(9, hashes(SYSTEM)), stored(10, hashes(shared))])
    state.starts = {"a": 3.0, "b": 0.0}
    stranger = SYSTEM + [90, 91, 92, 93]
    assert keep_pages(8, 0.1, 6) == 1 and keep_pages(8, 0.1, 28) == 3 and keep_pages(8, 0.1, 200) == 8
    assert keep_pages(8, float("inf"), 6) == 8 and keep_pages(8, 0.0, 6) == 1
    assert policy.rank(request(stranger, "s"), ["a", "b"])[0] == "b"
    assert policy.rank(request(shared + [50, 51, 52, 53, 60], "x2"), ["a", "b"])[0] == "b"
    assert policy.rank(request(early + [50, 51, 52, 53, 60], "e2"), ["a", "b"])[0] == "a"
    assert policy.rank(request(late + [50, 51, 52, 53, 60], "l2"), ["a", "b"])[0] == "a"
    assert policy.rank(request(hot + [1, 2, 3, 4], "h2"), ["a", "b"])[0] == "a"
    absolute = make_routing_policy("cache-aware", state, config=CacheAwareConfig(share_keep_rel=1.0))
    assert absolute.rank(request(early + [50, 51, 52, 53, 60], "e2"), ["a", "b"])[0] == "b"  # 2 < 6 pages
    assert absolute.rank(request(late + [50, 51, 52, 53, 60], "l2"), ["a", "b"])[0] == "a"  # 9 >= 8
    state.starts = {"a": 1.0, "b": 0.0}             # within the share slack: no longer ahead
    assert policy.rank(request(stranger, "s"), ["a", "b"])[0] == "a"
    assert policy.rank(request(shared + [50, 51, 52, 53, 60], "x2"), ["a", "b"])[0] == "a"


def test_a_replica_ahead_gets_the_tighter_cached_slack_and_a_queue_outranks_it() -> None:
    """Ahead, a prompt cached only there draws within 3 requests in flight over the least
    loaded (8 otherwise). Where nothing held draws a request, a replica not ahead wins
    unless its queue is past the cached slack."""
    state = cluster("a", "b")
    policy = make_routing_policy("cache-aware", state)
    hot = list(range(200, 240))
    state.index.apply("a", [stored(1, hashes(hot))])
    state.starts = {"a": 3.0, "b": 0.0}
    state.in_flight = {"a": 4, "b": 0}
    assert policy.rank(request(hot, "h"), ["a", "b"])[0] == "b"
    state.in_flight = {"a": 3, "b": 0}
    assert policy.rank(request(hot, "h"), ["a", "b"])[0] == "a"
    state.starts = {"a": 1.0, "b": 0.0}
    state.in_flight = {"a": 8, "b": 0}
    assert policy.rank(request(hot, "h"), ["a", "b"])[0] == "a"
    nothing = list(range(500, 520))                 # cached nowhere
    state.starts = {"a": 0.0, "b": 3.0}             # b is ahead, a is not
    state.in_flight = {"a": 8, "b": 0}
    assert policy.rank(request(nothing, "n"), ["a", "b"])[0] == "a"
    state.in_flight = {"a": 9, "b": 0}
    assert policy.rank(request(nothing, "n"), ["a", "b"])[0] == "b"


def test_routing_config_parses_from_the_command_line_form() -> None:
    config = parse_routing_config("cached_balance_abs=3, share_abs=inf,share_rel=0.5")
    assert config == CacheAwareConfig(cached_balance_abs=3, share_abs=float("inf"), share_rel=0.5)
    assert parse_routing_config("") == CacheAwareConfig()
    for bad, message in [("no_such=1", "expected field=value"), ("share_abs", "expected field=value"),
                         ("cached_balance_abs=1.5", "needs a number")]:
        with pytest.raises(ValueError, match=message):
            parse_routing_config(bad)


def test_prompt_ends_are_bounded_and_forgotten_with_their_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixserve.cluster.index as index_module

    monkeypatch.setattr(index_module, "PROMPT_ENDS_MEMORY", 2)
    index = CacheIndex()
    prompts = [SYSTEM + [i] * 4 for i in range(3)]
    index.apply("a", [stored(1, hashes(p)) for p in prompts])
    for p in prompts:
        index.add_prompt_end("a", NS, hashes(p))
    index.add_prompt_end("a", NS, [])  # shorter than a page: nothing to remember
    assert [index.continued_pages("a", NS, hashes(p)) for p in prompts] == [0, 5, 5]
    index.forget("a")
    index.apply("a", [stored(2, hashes(prompts[2]))])
    assert index.continued_pages("a", NS, hashes(prompts[2])) == 0


def test_a_replica_that_joins_does_not_draw_the_conversations_held_elsewhere() -> None:
    # 40 conversations of 8 turns minutes apart over a-d (nothing in flight between turns);
    # then Serve replaces d with e. e joins at the least count of requests routed lately:
    # had it joined at 0, every other replica would be past the hard limit next to it and
    # their conversations would move to e, each recomputed whole.
    view = ClusterView()
    view.set_replicas(["a", "b", "c", "d"])
    state = view.state
    pages: dict[int, int] = {}
    home: dict[int, str] = {}

    def turn(conv: int, number: int) -> str:
        pages[conv] = pages.get(conv, 0) + 4
        hs = [conv * 10_000 + p for p in range(pages[conv])]
        routed = RouteRequest(f"q{number}", NS, hs, pages[conv] * PAGE)
        target = view.rank(routed, sorted(view.replicas))[0]
        view.routed(routed, target)
        state.index.apply(target, [stored(number, hs)])  # served: cached, settled, finished
        state.settled(target, [routed.request_id])
        view.finished(routed.request_id)
        state.batch_applied(target)
        return target

    numbers = iter(range(1, 1000))
    for _ in range(8):
        for conv in range(40):
            home[conv] = turn(conv, next(numbers))
    view.set_replicas(["a", "b", "c", "e"])
    targets = {conv: turn(conv, next(numbers)) for conv in range(40)}
    assert {conv: targets[conv] for conv in home if home[conv] != "d"} == {
        conv: home[conv] for conv in home if home[conv] != "d"}
    assert sorted(targets[conv] for conv in home if home[conv] == "d") == list("aabbcceeee")


def test_cache_aware_without_a_match_takes_least_loaded_then_most_free() -> None:
    state = cluster("a", "b", "c")
    state.in_flight = {"a": 1, "b": 0, "c": 0}
    state.reports["c"].pages_free = 150
    policy = make_routing_policy("cache-aware", state)
    assert policy.rank(request(PROMPT), ["a", "b", "c"]) == ["c", "b", "a"]
    # One cached page is below min_match_pages=2: it does not count.
    state.index.apply("a", [stored(1, hashes(PROMPT)[:1])])
    strict = make_routing_policy("cache-aware", state, config=CacheAwareConfig(min_match_pages=2))
    assert strict.rank(request(PROMPT), ["a", "b", "c"])[0] == "c"


def test_session_sticks_while_its_replica_lives() -> None:
    state = cluster("a", "b")
    state.index.apply("a", [stored(1, hashes(PROMPT))])
    policy = make_routing_policy("cache-aware", state)
    turn = [1, 2, 3, 4, 5]
    # No match anywhere, equal load and free pages: the replica caching less, "b".
    assert policy.choose(request(turn, "t1", session_id="s"), ["a", "b"]) == "b"
    # "a" now caches the whole next turn and "b" is far past the guard: the session sticks.
    state.index.apply("a", [stored(2, hashes(turn + [6, 7, 8]))])
    state.in_flight["b"] = 50
    assert policy.choose(request(turn + [6, 7, 8], "t2", session_id="s"), ["a", "b"]) == "b"
    state.remove("b")
    assert (None, "s") not in state.sessions
    assert policy.choose(request(turn + [6, 7, 8], "t3", session_id="s"), ["a"]) == "a"
    assert state.sessions[(None, "s")][0] == "a"


def _tenant_request(tokens: list[int], request_id: str, tenant: str, session_id: str) -> RouteRequest:
    return RouteRequest(request_id, NS, hashes(tokens), len(tokens), session_id, tenant=tenant)


def test_a_session_id_pins_only_its_own_tenant_s_requests() -> None:
    state = cluster("x", "y")
    policy = make_routing_policy("cache-aware", state)
    state.index.apply("y", [stored(1, hashes(PROMPT))])  # tenant B's warmed prefix
    assert policy.choose(_tenant_request([1, 2, 3, 4, 5], "a1", "A", "chat-42"), ["x"]) == "x"
    # B guessing A's session id is routed by its own cache, as for an unused id: nothing
    # tells B that A holds "chat-42", and B's load is not pinned onto A's replica.
    assert policy.rank(_tenant_request(PROMPT, "b1", "B", "chat-42"), ["x", "y"])[0] == "y"
    assert policy.rank(_tenant_request(PROMPT, "b2", "B", "unused"), ["x", "y"])[0] == "y"
    assert policy.rank(_tenant_request(PROMPT, "a2", "A", "chat-42"), ["x", "y"])[0] == "x"
    assert list(state.sessions) == [("A", "chat-42")]


def test_sessions_are_forgotten_when_closed_idle_past_the_ttl_or_past_the_cap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    state = cluster("x", "y")
    state.clock = lambda: now[0]
    state.session_ttl_s = 600.0
    policy = make_routing_policy("cache-aware", state)
    state.index.apply("y", [stored(1, hashes(PROMPT))])
    assert policy.choose(_tenant_request([1, 2, 3, 4, 5], "r1", "A", "s1"), ["x"]) == "x"
    assert policy.choose(_tenant_request([1, 2, 3, 4, 5], "r2", "A", "s2"), ["x"]) == "x"
    now[0] = 300.0
    assert policy.choose(_tenant_request(PROMPT, "r3", "A", "s2"), ["x", "y"]) == "x"  # routed again: kept
    state.end_session("s1", "A")  # closed on its replica
    assert list(state.sessions) == [("A", "s2")]
    now[0] = 900.5  # 600.5 s since s2's last routing: the replicas have expired it
    assert policy.rank(_tenant_request(PROMPT, "r4", "A", "s2"), ["x", "y"])[0] == "y"
    assert len(state.sessions) == 0
    # The least recently routed go first past the cap.
    monkeypatch.setattr(cluster_state, "SESSION_MEMORY", 3)
    for i in range(5):
        state.routed(_tenant_request([1, 2, 3, 4, 5], f"c{i}", "A", f"c{i}"), "x")
    assert list(state.sessions) == [("A", "c2"), ("A", "c3"), ("A", "c4")]


def test_a_finished_request_stays_in_flight_until_its_replica_settles_it() -> None:
    """The completion can overtake the replica's events: between the two, a repeat of the
    prompt must still find it where it is being cached."""
    state = cluster("a", "b")
    policy = make_routing_policy("cache-aware", state)
    replica = policy.choose(request(PROMPT, "r1"), ["a", "b"])
    other = ({"a", "b"} - {replica}).pop()
    assert state.in_flight[replica] == 1 and state.routed_total[replica] == 1
    assert state.index.matched_pages(replica, NS, hashes(PROMPT)) == 5
    state.finished("r1")
    assert state.in_flight[replica] == 0 and state.routed_total[replica] == 1
    assert state.index.matched_pages(replica, NS, hashes(PROMPT)) == 5
    assert policy.rank(request(PROMPT, "r2"), ["a", "b"])[0] == replica
    state.settled(other, ["r1"])  # another replica cannot settle it
    assert state.index.matched_pages(replica, NS, hashes(PROMPT)) == 5
    state.index.apply(replica, [stored(1, hashes(PROMPT)[:3])])  # the replica cached 3 pages
    state.settled(replica, ["r1"])
    assert state.index.matched_pages(replica, NS, hashes(PROMPT)) == 3
    assert state.index.matched_pages(replica, NS, hashes(PROMPT), in_flight=False) == 3


def test_a_settle_may_come_before_the_completion_and_a_lost_one_expires() -> None:
    state = cluster("a")
    state.routed(RouteRequest("serve-1", NS, hashes(PROMPT), len(PROMPT), replica_request_id="cmpl-1"), "a")
    state.settled("a", ["cmpl-1"])  # the replica's own id, not Serve's
    assert state.index.matched_pages("a", NS, hashes(PROMPT)) == 0
    state.finished("serve-1")
    assert state.in_flight["a"] == 0 and state.index.matched_pages("a", NS, hashes(PROMPT)) == 0
    # Never settled (cancelled before the replica ran it): dropped after the grace batches.
    state.routed(RouteRequest("serve-2", NS, hashes(PROMPT), len(PROMPT), replica_request_id="cmpl-2"), "a")
    state.finished("serve-2")
    for _ in range(SETTLE_GRACE_BATCHES):
        state.batch_applied("a")
    assert state.index.matched_pages("a", NS, hashes(PROMPT)) == 5
    state.batch_applied("a")
    assert state.index.matched_pages("a", NS, hashes(PROMPT)) == 0
    assert state._unsettled == {} and state._placed == {}


def test_a_late_settle_from_the_first_replica_leaves_the_second_replica_s_grace() -> None:
    """A request moved from a to b, finished on b before b settles it, then a's settle
    arrives: the prompt stays in flight on b until b settles it or its grace ends (it was
    in flight forever when a's settle ended b's wait)."""
    state = cluster("a", "b")
    state.routed(request(PROMPT, "r1"), "a")
    state.routed(request(PROMPT, "r1"), "b")  # a retry moves it
    state.finished("r1")
    state.settled("a", ["r1"])
    assert state.index.matched_pages("b", NS, hashes(PROMPT)) == 5
    for _ in range(SETTLE_GRACE_BATCHES + 1):
        state.batch_applied("b")
    assert state.index.matched_pages("b", NS, hashes(PROMPT)) == 0
    assert state._unsettled == {} and state.index.in_flight_on("r1") is None


def test_routing_a_request_again_moves_it() -> None:
    """The router reserves a replica, Serve sends the request to another: it counts there."""
    state = cluster("a", "b")
    state.routed(request(PROMPT, "r1"), "a")
    state.routed(request(PROMPT, "r1"), "a")  # confirmed where reserved: no change
    state.routed(request(PROMPT, "r1"), "b")
    assert state.routed_total == {"a": 0, "b": 1} and state.in_flight == {"a": 0, "b": 1}
    assert state.index.in_flight_on("r1") == "b"
    assert state.index.matched_pages("a", NS, hashes(PROMPT)) == 0


def test_a_late_routing_report_of_a_finished_request_is_ignored() -> None:
    """Ray Serve may run a short request's completion callback before on_request_routed."""
    state = cluster("a", "b")
    state.finished("r1")
    state.routed(request(PROMPT, "r1"), "a")
    assert state.in_flight.get("a", 0) == 0 and state.routed_total.get("a", 0) == 0
    assert state.index.matched_pages("a", NS, hashes(PROMPT)) == 0


def test_a_retry_on_another_replica_keeps_its_prompt_there() -> None:
    """ClusterEngine retries a request whose replica died under a new Serve id: the first
    attempt's completion, and that replica's batches, do not end the retry's in-flight prompt."""
    for first_ends_before_the_retry in (False, True):
        state = cluster("a", "b")
        state.routed(RouteRequest("serve-1", NS, hashes(PROMPT), len(PROMPT), replica_request_id="cmpl-1"), "a")
        if first_ends_before_the_retry:
            state.finished("serve-1")
        state.routed(RouteRequest("serve-2", NS, hashes(PROMPT), len(PROMPT), replica_request_id="cmpl-1"), "b")
        state.finished("serve-1")
        for _ in range(SETTLE_GRACE_BATCHES + 1):
            state.batch_applied("a")
        assert state.index.in_flight_on("cmpl-1") == "b"
        assert state.index.matched_pages("b", NS, hashes(PROMPT)) == 5
        assert state.in_flight == {"a": 0, "b": 1}


# ---------------------------------------------------------------- baselines


def test_power_of_two_takes_the_less_loaded_of_two() -> None:
    state = cluster("a", "b")
    state.in_flight = {"a": 3, "b": 1}
    policy = make_routing_policy("power-of-two", state, seed=1)
    assert all(policy.rank(request(PROMPT), ["a", "b"]) == ["b", "a"] for _ in range(10))


def test_round_robin_cycles() -> None:
    policy = make_routing_policy("round-robin", cluster("a", "b", "c"))
    assert [policy.rank(request(PROMPT), ["c", "a", "b"])[0] for _ in range(4)] == ["a", "b", "c", "a"]


def test_prefix_affinity_follows_routing_history_not_the_cache() -> None:
    state = cluster("a", "b")
    policy = PrefixAffinityPolicy(state, page_size=PAGE)
    state.reports["b"].pages_free = 0
    assert policy.choose(request(PROMPT, "r1"), ["a", "b"]) == "a"  # tie on history size, load: a first
    state.finished("r1")
    # The cache of "b" holds the prompt, but history says "a".
    state.index.apply("b", [stored(1, hashes(PROMPT))])
    assert policy.choose(request(PROMPT + [1], "r2"), ["a", "b"]) == "a"
    # A different prompt matches nothing (< 10%): the replica with the least history, "b".
    assert policy.choose(request(list(range(500, 520)), "r3"), ["a", "b"]) == "b"


def test_unknown_router_and_imbalance() -> None:
    with pytest.raises(ValueError, match="router"):
        make_routing_policy("random", ClusterState())
    assert replica_imbalance([10, 15, 12]) == 1.5
    assert replica_imbalance([3, 0]) == float("inf")


# ---------------------------------------------------------------- the replica's feed


def test_feed_snapshot_plus_events_equals_the_engine_cache() -> None:
    engine = Engine(model="demo", page_size=PAGE, num_pages=24, debug_checks=True)
    feed = EventFeed(PAGE)
    engine.subscribe_events(feed.publish)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.generate([SYSTEM + [1, 2, 3, 4, 5]], params)

    async def run() -> CacheIndex:
        index = CacheIndex()
        stream = feed.subscribe(batch_interval_s=0.0, heartbeat_s=0.05)
        index.apply("r", (await anext(stream)).events)  # the snapshot
        assert index.page_set("r") == engine.cache_page_hashes()
        engine.generate([SYSTEM + [9, 9, 9, 9, 9, 9], list(range(300, 340))], params)
        engine.flush_cache()
        evicted = engine.stats()["cache_evicted_pages"]
        for start in (300, 400, 500, 600):  # 10 pages each, one by one: the 24-page pool evicts
            engine.generate([list(range(start, start + 40))], params)
        assert engine.stats()["cache_evicted_pages"] > evicted
        while True:
            batch = await asyncio.wait_for(anext(stream), 5)
            if not batch:
                break  # a heartbeat: everything published so far was delivered
            index.apply("r", batch.events)
        await stream.aclose()
        return index

    index = asyncio.run(run())
    assert index.page_set("r") == engine.cache_page_hashes() != set()
    assert feed._subscribers == []


def test_feed_settles_a_request_after_the_events_published_before_it() -> None:
    feed = EventFeed(PAGE)

    async def run() -> list:
        stream = feed.subscribe(batch_interval_s=0.0, heartbeat_s=0.05)
        assert not (await anext(stream)).settled  # the snapshot
        batches = []
        for seq in range(1, 4):
            feed.publish(stored(seq, hashes([seq] * 4)))
            feed.settle(f"r{seq}")
            batches.append(await asyncio.wait_for(anext(stream), 5))
        feed.publish(stored(9, hashes([9] * 4)))
        batches.append(await asyncio.wait_for(anext(stream), 5))
        await stream.aclose()
        return batches

    batches = asyncio.run(run())
    assert [([e.seq for e in b.events], b.settled) for b in batches] == [
        ([1], ["r1"]), ([2], ["r2"]), ([3], ["r3"]), ([9], [])]


def test_merge_stats_sums_counters_and_recomputes_rates() -> None:
    a = {"prompt_tokens": 100, "cached_tokens": 50, "hit_rate": 0.5, "pages_total": 10, "page_size": 16,
         "last_step_s": 0.2, "cache_lookup_tokens": 10, "cache_hit_tokens": 1, "name": "x",
         "histograms": {"h": {"buckets": [(1.0, 2), (float("inf"), 3)], "sum": 4.0, "count": 3}}}
    b = {"prompt_tokens": 300, "cached_tokens": 250, "hit_rate": 0.83, "pages_total": 30, "page_size": 16,
         "last_step_s": 0.5, "cache_lookup_tokens": 30, "cache_hit_tokens": 19,
         "histograms": {"h": {"buckets": [(1.0, 1), (float("inf"), 1)], "sum": 0.5, "count": 1}}}
    merged = merge_stats([a, b])
    assert merged["prompt_tokens"] == 400 and merged["cached_tokens"] == 300 and merged["hit_rate"] == 0.75
    assert merged["pages_total"] == 40 and merged["page_size"] == 16 and merged["last_step_s"] == 0.5
    assert merged["cache_hit_rate"] == 0.5 and "name" not in merged
    assert merged["histograms"] == {"h": {"buckets": [(1.0, 3), (float("inf"), 4)], "sum": 4.5, "count": 4}}


def test_replicas_without_ray_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    assert main(["serve", "--replicas", "2"]) == 2
    assert "pip install -e '.[cluster]'" in capsys.readouterr().err
    args = build_parser().parse_args(["serve"])
    assert (args.replicas, args.ray_address, args.router, args.replica_cpus) == (None, None, "cache-aware", 1.0)


def test_replicas_on_cuda_share_the_gpus_out_unless_tensor_parallel() -> None:
    """A replica that reserves no GPU sees every GPU, and every such replica took cuda:0."""
    from radixserve.cluster.cli import replica_gpus

    assert build_parser().parse_args(["serve"]).replica_gpus is None
    assert replica_gpus(None, None, 1, cluster_gpus=8, replicas=4) == 1.0  # auto device, enough GPUs
    assert replica_gpus(None, "cuda:0", 1, cluster_gpus=2, replicas=2) == 1.0
    assert replica_gpus(None, None, 1, cluster_gpus=2, replicas=3) == 0.5  # two to a GPU: all fit
    assert replica_gpus(None, None, 1, cluster_gpus=1, replicas=4) == 0.25
    assert replica_gpus(None, None, 1, cluster_gpus=0, replicas=2) == 0.0  # no GPU: none to reserve
    assert replica_gpus(None, "cuda", 1, cluster_gpus=0, replicas=2) == 0.0  # none reported: Ray could never place it
    assert replica_gpus(None, "cpu", 1, cluster_gpus=8, replicas=2) == 0.0
    assert replica_gpus(None, None, 2, cluster_gpus=8, replicas=2) == 0.0  # its ranks must see the GPUs
    assert replica_gpus(0.5, "cpu", 1, cluster_gpus=0, replicas=2) == 0.5  # --replica-gpus wins


def test_routing_reports_for_a_replica_gone_leave_no_state() -> None:
    # x dies while 50 requests are reserved on it; Serve's reports of them arrive later.
    view = ClusterView()
    view.set_replicas(["x", "y"])
    requests = [RouteRequest(f"r{i}", NS, [i, i + 1000], 8, replica_request_id=f"c{i}") for i in range(50)]
    for routed in requests:
        view.routed(routed, "x")
    view.replica_gone("x")
    assert view.rank(requests[0], ["x", "y"]) == ["y", "x"]  # x last, not looked up
    for routed in requests:
        view.routed(routed, "x")
        view.finished(routed.request_id)
    view.set_replicas(["y", "z"])
    state = view.state
    assert ("x" in state.in_flight, "x" in state.starts, "x" in state._recent) == (False, False, False)
    assert (state._unsettled, state.index._requests, state.index._prompt_ends.get("x")) == ({}, {}, None)
    assert state._routings == 50


def test_a_reservation_withdrawn_is_taken_back_whole() -> None:
    """The cache-aware router reserves a replica as it ranks; a request cancelled while Serve
    waits for a replica with room is reported neither routed nor completed: withdrawn, it
    leaves nothing behind, and a late report of it is ignored."""
    state = cluster("a", "b")
    state.routed(request(PROMPT, "r0"), "a")  # another request, finished: what stays is its
    state.finished("r0")

    def counts() -> list[dict[str, int]]:
        return [{r: n for r, n in counted.items() if n} for counted in (state.in_flight, state.routed_total)]

    before = counts()
    state.routed(request(PROMPT, "r1"), "b")
    assert state.in_flight["b"] == 1 and state.index.in_flight_on("r1") == "b"
    state.withdrawn(request(PROMPT, "r1"))
    assert counts() == before
    assert state.starts["b"] == pytest.approx(state.starts["a"])  # joined at the least share, its start taken back
    assert state.index.in_flight_on("r1") is None and state.recent_requests("b") == pytest.approx(0)
    assert state.index.matched_pages("b", NS, hashes(PROMPT), in_flight=True) == 0
    state.routed(request(PROMPT, "r1"), "b")  # late
    assert state.in_flight["b"] == 0
    state.withdrawn(request(PROMPT, "r9"))  # never reserved: nothing to do
