"""Routing that holds on real arrivals: balance over time (requests routed lately, decayed
over the requests routed after them),
host-tier prefixes at a credit below one, the router's prediction of what a replica will
report cached, and the windowed imbalance the cluster simulation reports."""

from __future__ import annotations

import math

import pytest

from radixserve.cache.events import AllCleared, BlockRemoved
from radixserve.benchmark.cluster_sim import ClusterSimulator, windowed_imbalance
from radixserve.benchmark.simulate import SimConfig
from radixserve.benchmark.workloads import make_workload
from radixserve.cluster.routing import (
    RECENT_HALF_LIFE_ROUTINGS,
    CacheAwareConfig,
    ClusterState,
    ReplicaReport,
    STARTS_HALF_LIFE,
    RoutingPolicy,
    make_routing_policy,
)
from tests.test_cluster_routing import NS, SYSTEM, hashes, request, stored


def timed_cluster(*replicas: str, half_life: float = math.inf) -> ClusterState:
    """Replicas known to a router; requests routed lately halve over `half_life` routings
    (by default never: the guards' arithmetic on whole counts)."""
    state = ClusterState(recent_half_life=half_life)
    for r in replicas:
        state.index.apply(r, [])
        state.reports[r] = ReplicaReport(pages_free=100, pages_total=100)
    return state


def route_finished(state: ClusterState, tokens: list[int], rid: str, replica: str) -> None:
    """A request routed to `replica` that has finished: nothing of it is in flight any more."""
    state.routed(request(tokens, rid), replica)
    state.finished(rid)
    state.settled(replica, [rid])


def test_requests_routed_lately_halve_over_every_half_life_of_routings() -> None:
    """Each request counts 1 on its replica and halves over every `half_life` requests routed
    after it, anywhere: the same traffic at any arrival rate, whatever the clock says."""
    state = timed_cluster("a", "b", "c", half_life=4)
    assert ClusterState().recent_half_life == RECENT_HALF_LIFE_ROUTINGS
    for i in range(4):
        route_finished(state, SYSTEM + [i], f"r{i}", "a")
    assert state.requests_in_flight("a") == 0
    assert state.recent_requests("a") == pytest.approx(sum(0.5 ** (k / 4) for k in range(4)))
    for i in range(4):
        route_finished(state, SYSTEM + [50 + i], f"b{i}", "b")   # four routings elsewhere: a halves
    assert state.recent_requests("a") == pytest.approx(sum(0.5 ** (k / 4) for k in range(4, 8)))
    assert state.recent_requests("b") == pytest.approx(sum(0.5 ** (k / 4) for k in range(4)))
    assert state.recent_requests("c") == 0.0
    before = {r: state.recent_requests(r) for r in "abc"}
    state.routed(request(SYSTEM + [98], "moved"), "a")
    moved = {r: state.recent_requests(r) for r in "abc"}
    state.routed(request(SYSTEM + [98], "moved"), "c")  # Serve placed it elsewhere: taken back
    # The move is one request: a is as before, c counts it as a's did, nothing halved again.
    assert state.recent_requests("a") == pytest.approx(before["a"] * 0.5 ** 0.25)
    assert state.recent_requests("b") == pytest.approx(moved["b"])
    assert state.recent_requests("c") == pytest.approx(1.0)
    # Ray Serve's router reserves a replica, then confirms it (the same request routed to the
    # same replica again), and a completion can overtake a routing report: neither is a new
    # request, so neither ages the counts.
    state.routed(request(SYSTEM + [98], "moved"), "c")
    state.finished("moved")
    state.routed(request(SYSTEM + [98], "moved"), "c")
    assert {r: state.recent_requests(r) for r in "abc"} == pytest.approx(
        {"a": before["a"] * 0.5 ** 0.25, "b": moved["b"], "c": 1.0})


def test_a_request_moved_after_other_routings_moves_its_decayed_share() -> None:
    """Moved later (Serve placing it elsewhere after others were routed), a request takes
    back from its old replica what it weighs there now, not a whole 1 (which would count that
    replica short of the requests it did get), and weighs as much on the new one: it is the
    same request, routed when it first was. Its conversation start moves alike, and its
    prompt end leaves the old replica (no conversation of that replica's)."""
    state = timed_cluster("a", "b", "c", half_life=4)
    state.routed(request(SYSTEM + [98], "moved"), "a")   # routing 1: a start on a
    for i in range(4):
        route_finished(state, [7000 + 16 * i + k for k in range(16)], f"b{i}", "b")  # four starts on b
    route_finished(state, [9000 + k for k in range(16)], "a1", "a")  # routing 6, a start on a
    b_before = state.recent_requests("b")
    moved = request(SYSTEM + [98], "moved")
    assert state.index.prompt_ends_through("a", NS, moved.page_hashes) == [1]
    state.routed(moved, "c")
    assert state.recent_requests("b") == b_before
    assert state.index.prompt_ends_through("a", NS, moved.page_hashes) == []
    assert state.index.prompt_ends_through("c", NS, moved.page_hashes) == [1]
    # a: only a1 now (routed last: 1); c: the moved request as it weighs after 5 routings.
    assert state.recent_requests("a") == pytest.approx(1.0, abs=1e-12)
    assert state.recent_requests("c") == pytest.approx(0.5 ** (5 / 4), abs=1e-12)
    # Starts: the moved one had aged 5 starts; a keeps a1 alone (nothing ages again), c gets
    # it as aged, on top of the least share (a's 1), at which a replica first routed to joins.
    decay = 0.5 ** (1 / STARTS_HALF_LIFE)
    assert state.starts["a"] == pytest.approx(1.0, abs=1e-12)
    assert state.starts["c"] == pytest.approx(1.0 + decay ** 5, abs=1e-12)


def _conversation_on_a(state: ClusterState, requests: int) -> list[int]:
    """`requests` routed to a lately (minutes apart: none in flight): `requests - 1` of other
    conversations, then a conversation's first turn, whose history a caches; returns that
    conversation's next prompt. For it, its own earlier turn does not count against a
    (`ClusterState.own_recent_requests`): a looks `requests - 1` deep to it, `requests` to others."""
    for i in range(requests - 1):
        route_finished(state, SYSTEM + [600 + i] * 8, f"o{i}", "a")
    prompt = SYSTEM + list(range(300, 428))  # 36 pages
    route_finished(state, prompt, "c0", "a")
    state.index.apply("a", [stored(1, hashes(prompt))])
    return prompt + [400] * 8


@pytest.mark.parametrize("router", ["cache-aware", "cache-aware-inflight"])
def test_turns_minutes_apart_do_not_pile_new_conversations_onto_one_replica(router: str) -> None:
    """a served 20 turns lately, b and c none, nothing in flight anywhere; all three cache the
    system prompt, and a has the most free pages. A new conversation goes to b or c: a is
    busy lately. Counting requests in flight alone (the rule before), a looks idle and wins."""
    state = timed_cluster("a", "b", "c")
    _conversation_on_a(state, 20)
    for r in ("b", "c"):
        state.index.apply(r, [stored(2, hashes(SYSTEM))])
    state.reports["a"].pages_free = 200
    state.starts = {"a": 0.0, "b": 0.0, "c": 0.0}  # conversations started look even
    chosen = make_routing_policy(router, state).rank(request(SYSTEM + [90, 91, 92, 93], "new"), ["a", "b", "c"])[0]
    assert (chosen != "a") == (router == "cache-aware")


def test_a_busy_replica_keeps_a_long_conversation_and_an_overloaded_one_lets_it_go() -> None:
    state = timed_cluster("a", "b", "c")
    prompt = _conversation_on_a(state, 12)     # 12 requests routed to a lately, 11 of others
    policy = make_routing_policy("cache-aware", state, config=CacheAwareConfig(recent_keep_pages=16,
                                                                               recent_hard_rel=0.35, recent_abs=4.0))
    state.index.apply("b", [stored(2, hashes(SYSTEM))])
    for i in range(6):                         # b serves other work: a is busy, not overloaded
        route_finished(state, SYSTEM + [500 + i] * 4, f"b{i}", "b")
    # a, to the conversation: 11 > 6 * 1.15 + 4 = 10.9 (busy) but not > 6 * 1.35 + 4 = 12.1:
    # it saves 32 pages over b's 4 (36 of 38 held; >= 16 kept), so it stays.
    assert policy.rank(request(prompt, "next"), ["a", "b"])[0] == "a"
    short = SYSTEM + list(range(300, 308))     # only 2 pages past the system prompt: moves
    assert policy.rank(request(short, "short"), ["a", "b"])[0] == "b"
    # The default keeps `keep_pages(64, 0.5, 38)` = 19 pages, not 64: no 38-page prompt could
    # save 64, so an absolute count would move every turn of a busy replica's conversations.
    assert len(hashes(prompt)) == 38
    assert make_routing_policy("cache-aware", state).rank(request(prompt, "next"), ["a", "b"])[0] == "a"
    absolute = make_routing_policy("cache-aware", state, config=CacheAwareConfig(recent_keep_rel=2.0))  # 64
    assert absolute.rank(request(prompt, "next"), ["a", "b"])[0] == "b"
    for extra in ("x", "y"):                   # 13 of others > 12.1: overloaded
        route_finished(state, SYSTEM + [700] * 4, extra, "a")
    assert policy.rank(request(prompt, "next"), ["a", "b"])[0] == "b"
    state.recent_half_life = 1.0               # ten half-lives of requests routed to c: a and b
    for i in range(10):                        # decay toward 0 (within 4 of each other), a is not busy
        route_finished(state, SYSTEM + [800 + i] * 4, f"c{i}", "c")
    assert policy.rank(request(prompt, "next"), ["a", "b"])[0] == "a"


def _chat(state: ClusterState, policy: RoutingPolicy, name: str, turns: range) -> list[str]:
    """Turns `turns` of a conversation, each resending its history, routed by
    `policy`; the chosen replica caches the prompt. Returns where each turn went."""
    base = 300 + 1000 * len(name)
    history = SYSTEM + list(range(base, base + 40)) + [t for turn in range(turns.start) for t in [base + 500 + turn] * 8]
    placed = []
    for turn in turns:
        prompt, rid = history, f"{name}{turn}"
        replica = policy.choose(request(prompt, rid), ["a", "b", "c", "d"])
        state.finished(rid)
        state.settled(replica, [rid])
        state.index.apply(replica, [stored(turn, hashes(prompt))])
        placed.append(replica)
        history = prompt + [base + 500 + turn] * 8
    return placed


def test_a_lone_conversation_keeps_its_replica_and_two_on_one_replica_part() -> None:
    """A conversation's own earlier turns do not make its replica busy for it: alone on four
    idle replicas, a chat of 30 turns a minute apart stays on one replica (counting its own
    turns, its replica was overloaded after 7 and the chat hopped between two replicas 5
    times, recomputing its history each time). Two chats on one replica are each other's
    load: the other's turns there make the replica overloaded for the first, which moves
    once and stays."""
    state = timed_cluster("a", "b", "c", "d", half_life=RECENT_HALF_LIFE_ROUTINGS)
    policy = make_routing_policy("cache-aware", state)
    assert len(set(_chat(state, policy, "lone", range(30)))) == 1
    state = timed_cluster("a", "b", "c", "d", half_life=RECENT_HALF_LIFE_ROUTINGS)
    policy = make_routing_policy("cache-aware", state)
    first = _chat(state, policy, "one", range(6))
    for turn in range(6):                   # another chat's turns, on the first one's replica
        route_finished(state, SYSTEM + list(range(9000, 9040)) + [9500] * 8 * turn, f"two{turn}", first[0])
    later = _chat(state, policy, "one", range(6, 10))
    assert len(set(first)) == 1 and later[0] != first[0] and len(set(later)) == 1


def test_one_earlier_prompt_ending_in_a_shared_document_is_not_the_requests_own_turn() -> None:
    """a was routed 13 requests lately, b 6: a is overloaded (13 > 6 * 1.35 + 4). One of a's
    requests was a document alone (its last page the document's), which any question on it
    runs through. That one prompt is no turn of the question's own (many questions share the
    document), so a stays overloaded for it and the question goes to b; counted as its own,
    a would keep it (12 left, and 8 pages saved over b)."""
    state = timed_cluster("a", "b")
    document = SYSTEM + list(range(2000, 2032))                # 12 pages
    route_finished(state, document, "doc", "a")
    for i in range(12):
        route_finished(state, SYSTEM + [600 + i] * 8, f"o{i}", "a")
    state.index.apply("a", [stored(1, hashes(document))])
    state.index.apply("b", [stored(2, hashes(SYSTEM))])
    for i in range(6):
        route_finished(state, SYSTEM + [500 + i] * 4, f"b{i}", "b")
    question = request(document + list(range(3000, 3008)), "question")
    assert state.index.prompt_ends_through("a", NS, question.page_hashes) == [1]  # the first routing
    assert make_routing_policy("cache-aware", state).rank(question, ["a", "b"])[0] == "b"


def test_requests_routed_lately_closer_than_a_batch_are_not_a_pile_up() -> None:
    """A closed loop: a replica whose clients were served first sends their next turns first,
    so for a moment it has been routed more requests lately than the others by up to a batch.
    While the difference is within the replicas' mean in flight (not either replica's count)
    the replica is not busy, and even a request that saves only a short prefix there (6 pages,
    2 past the system prompt b holds too) stays; with nothing in flight it moves."""
    state = timed_cluster("a", "b")
    prompt = _conversation_on_a(state, 12)
    policy = make_routing_policy("cache-aware", state, config=CacheAwareConfig(recent_keep_pages=16,
                                                                               recent_hard_rel=0.35, recent_abs=4.0))
    state.index.apply("b", [stored(2, hashes(SYSTEM))])
    for i in range(6):
        route_finished(state, SYSTEM + [500 + i] * 4, f"b{i}", "b")
    short = SYSTEM + list(range(300, 308))     # 12 > 6 * 1.15 + 4: busy, and 2 pages saved < 16
    assert policy.rank(request(short, "short"), ["a", "b"])[0] == "b"
    state.in_flight = {"a": 6, "b": 6}         # 12 <= 6 * 1.15 + 6: one batch's timing
    assert policy.rank(request(short, "short"), ["a", "b"])[0] == "a"
    state.in_flight = {"a": 4, "b": 5}         # 12 > 6 * 1.15 + 4.5: busy again
    assert policy.rank(request(short, "short"), ["a", "b"])[0] == "b"
    state.in_flight = {"a": 3, "b": 6}         # the mean, 4.5, not b's 6: busy
    assert policy.rank(request(short, "short"), ["a", "b"])[0] == "b"
    state.in_flight = {"a": 10, "b": 2}        # 12 <= 6 * 1.15 + 6 (not a's 10 or b's 2)
    assert policy.rank(request(short, "short"), ["a", "b"])[0] == "a"
    for extra in ("x", "y"):                   # 14 > 6 * 1.15 + 6: busy, not past 6 * 1.35 + 6
        route_finished(state, SYSTEM + [700] * 4, extra, "a")
    state.in_flight = {"a": 6, "b": 6}
    assert policy.rank(request(short, "short"), ["a", "b"])[0] == "b"
    assert policy.rank(request(prompt, "next"), ["a", "b"])[0] == "a"   # saves 32 pages >= 16


def test_a_prefix_on_the_host_tier_counts_at_its_credit() -> None:
    state = timed_cluster("a", "b")
    prompt = SYSTEM + list(range(300, 332))    # 12 pages
    h = hashes(prompt)
    state.index.apply("a", [stored(1, h[:6])])                       # 6 pages on the device
    state.index.apply("b", [stored(1, h[:4]), stored(2, h, tier="host")])  # 4 on the device, 8 more on the host
    assert state.index.tiered_pages("b", NS, h) == (4, 8)
    assert state.index.tiered_pages("a", NS, h) == (6, 0)
    assert state.index.matched_pages("b", NS, h) == 4                 # the device alone by default
    assert state.index.matched_pages("b", NS, h, host_credit=0.75) == pytest.approx(4 + 0.75 * 8)
    assert make_routing_policy("cache-aware", state).rank(request(prompt), ["a", "b"])[0] == "b"
    assert make_routing_policy("cache-aware-inflight", state).rank(request(prompt), ["a", "b"])[0] == "a"
    state.index.apply("b", [stored(3, h[4:5])])                      # loaded back: on both tiers
    assert state.index.tiered_pages("b", NS, h) == (5, 7)
    state.index.apply("b", [BlockRemoved(seq=4, namespace=NS, tier="host", hashes=h[8:])])
    assert state.index.tiered_pages("b", NS, h) == (5, 3)
    state.index.apply("b", [AllCleared(seq=5, tier="host")])
    assert state.index.tiered_pages("b", NS, h) == (5, 0)
    assert make_routing_policy("cache-aware", state).rank(request(prompt), ["a", "b"])[0] == "a"


def test_windowed_imbalance_sees_what_the_whole_run_hides() -> None:
    alternating = [0, 1] * 1000
    assert windowed_imbalance(alternating, 2) == 1.0
    blocks = [0] * 1000 + [1] * 1000                 # even over the run, one-sided in every half
    assert windowed_imbalance(blocks, 2) == float("inf")
    assert windowed_imbalance(blocks, 2, window=2000) == 1.0
    assert windowed_imbalance([0, 0, 1], 2) == 2.0     # shorter than a window: the whole run
    skewed = ([0, 0, 1] * 400) + ([0, 1] * 400)
    assert windowed_imbalance(skewed, 2) == pytest.approx(667 / 333)  # the first window: 2 to 1


def test_the_router_predicts_what_replicas_report_cached_with_a_host_tier() -> None:
    """Conversations whose turns come 30 s or more apart, on small devices over large host
    tiers: by its next turn a conversation's history has mostly left the device. The
    router's prediction (device pages, then the host pages continuing them, at routing) is
    within a page of the cached tokens each replica reports for nearly every request."""
    workload = make_workload("gapped-chat", num_conversations=60)
    cluster = ClusterSimulator(workload, SimConfig(8_000, host_capacity_tokens=200_000), 2, "cache-aware")
    out = cluster.run().to_dict()
    from_host = sum(int((sim.host_hits > sim.config.page_size).sum()) for sim in cluster.sims.values())
    assert from_host >= 0.3 * len(workload.requests)
    assert out["predicted_within_page"] >= 0.95


def test_a_prompt_end_keeps_its_latest_routing_and_is_dropped_only_by_its_own() -> None:
    """Prompts ending on the same page (a shared system prompt) share one end: a request moved
    there late brings its first routing's number, which must not age the end; a move away
    drops the end only if it is still that request's."""
    state = timed_cluster("a")
    ends = request(SYSTEM, "x").page_hashes
    state.index.add_prompt_end("a", NS, ends, 4)
    state.index.add_prompt_end("a", NS, ends, 1)   # moved here, routed first at 1
    assert state.index.prompt_ends_through("a", NS, ends) == [4]
    state.index.drop_prompt_end("a", NS, ends, 1)  # moved away again: not its end any more
    assert state.index.prompt_ends_through("a", NS, ends) == [4]
    state.index.drop_prompt_end("a", NS, ends, 4)
    assert state.index.prompt_ends_through("a", NS, ends) == []
