"""Fair share between tenants (engine/fair_share.py): the Virtual Token Counter's accounting
and orders on their own, then through the engine: a flooding tenant beside an innocent one.

Latency is counted in engine steps, never in seconds.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams
from radixserve.engine.fair_share import INPUT_WEIGHT, OUTPUT_WEIGHT, PREEMPT_MARGIN, Claim, FairShare
from radixserve.engine.params import SamplingParams as Params
from radixserve.engine.request import Request, SequenceState

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def seq(tenant: str | None, arrival: float, num_tokens: int = 10, priority: int = 0,
        admin: bool = False) -> SequenceState:
    request = Request(f"{tenant}-{arrival}", list(range(num_tokens)), Params(), arrival, priority, tenant=tenant,
                      admin=admin)
    return SequenceState(request, 0, list(range(num_tokens)), None, None, None)  # type: ignore[arg-type]


def by_arrival(group: list[SequenceState]) -> list[SequenceState]:
    return sorted(group, key=lambda s: s.arrival_time)


def test_one_tenant_keeps_the_policys_order_exactly() -> None:
    fair = FairShare()
    waiting = [seq(None, t, priority=p) for t, p in ((3, 0), (1, 5), (2, 0))]
    policy = lambda group: sorted(group, key=lambda s: (-s.priority, -s.arrival_time))  # noqa: E731
    assert fair.order_waiting(waiting, policy) == policy(waiting)
    units = [[s] for s in waiting]
    key = lambda s: (-s.priority, s.arrival_time, s.seq_id)  # noqa: E731
    assert fair.order_running(units, key) == sorted(units, key=lambda u: key(u[0]))


def test_the_tenant_with_the_least_service_goes_next() -> None:
    fair = FairShare()
    fair.charge("flood", input_tokens=100)
    waiting = [seq("flood", t) for t in range(4)] + [seq("quiet", 10), seq("quiet", 11)]
    order = [(s.request.tenant, s.arrival_time) for s in fair.order_waiting(waiting, by_arrival)]
    # quiet is behind by 100 tokens: its two prompts of 10 go first, then the tenants alternate
    # as each taken prompt adds its tokens to its tenant's counter.
    assert order[:2] == [("quiet", 10), ("quiet", 11)]
    assert [t for t, _ in order[2:]] == ["flood"] * 4
    fair.charge("quiet", input_tokens=95)
    order = [s.request.tenant for s in fair.order_waiting(waiting, by_arrival)]
    assert order == ["quiet", "flood", "quiet", "flood", "flood", "flood"]
    assert FairShare(enabled=False).order_waiting(waiting, by_arrival)[0].request.tenant == "flood"


def test_a_newly_backlogged_tenant_is_lifted_to_the_least_active_counter() -> None:
    fair = FairShare()
    fair.arrive("a")
    fair.arrive("b")
    fair.charge("a", input_tokens=50)
    fair.charge("b", input_tokens=30, output_tokens=10)
    assert fair.counters["b"] == 30 * INPUT_WEIGHT + 10 * OUTPUT_WEIGHT
    fair.arrive("idle")  # it saved no credit by idling
    assert fair.counters["idle"] == min(fair.counters["a"], fair.counters["b"])
    fair.leave("a")
    fair.leave("b")
    fair.leave("idle")
    fair.charge("c", input_tokens=5)
    fair.arrive("c")  # nobody else backlogged: lifted to the last to leave ("idle", at 50)
    assert fair.counters["c"] == fair.counters["idle"] == 50 * INPUT_WEIGHT


def test_work_done_alone_is_not_held_against_the_tenant_that_did_it() -> None:
    """Bob works alone (nobody else asks) and leaves; alice arrives to an empty backlog, then bob
    comes back: they start level. Without the lift to the last to leave, alice was 64,000
    weighted tokens behind bob, and bob's sequences were preempted for hers until she had
    consumed them all (the margin is 2,048)."""
    fair = FairShare()
    fair.arrive("bob")
    fair.charge("bob", input_tokens=100, output_tokens=32_000)
    fair.leave("bob")
    fair.arrive("alice")
    assert fair.counters["alice"] == fair.counters["bob"]
    fair.charge("alice", input_tokens=3_000)
    fair.arrive("bob")  # lifted to the least backlogged: alice's
    assert fair.counters["bob"] == fair.counters["alice"]
    bob_waits = [seq("bob", 1.0)]
    alice_runs = [seq("alice", 2.0)]
    # Level: either one waiting keeps its first chunk in the next step, but nobody is preempted.
    assert fair.claimant(bob_waits, alice_runs) == Claim("bob", "alice", preempts=False)
    assert fair.claimant(alice_runs, bob_waits) == Claim("alice", "bob", preempts=False)
    fair.charge("bob", input_tokens=1)
    assert fair.claimant(bob_waits, alice_runs) is None  # bob is ahead now: no claim on alice
    fair.charge("alice", input_tokens=2 + PREEMPT_MARGIN)
    assert fair.claimant(bob_waits, alice_runs) == Claim("bob", "alice", preempts=True)


def test_a_lead_earned_while_nobody_waited_is_not_held_against_a_returning_tenant() -> None:
    """Bob streamed beside carol's one stream with nobody waiting (bob's lead was service
    nobody else asked for), bob left, then carol, far behind him. Alice arrives to an empty
    backlog: lifted to the greatest counter, bob's (to carol's, the last to leave, she was
    30,000 weighted tokens ahead of bob when he came back, and bob waited for her to use
    them). Bob comes back level with her."""
    fair = FairShare()
    for tenant in ("bob", "carol"):
        fair.arrive(tenant)
    fair.charge("bob", output_tokens=15_500)
    fair.charge("carol", output_tokens=500)
    fair.leave("bob")
    fair.leave("carol")
    fair.arrive("alice")
    assert fair.counters["alice"] == 15_500 * OUTPUT_WEIGHT
    fair.arrive("bob")
    assert fair.counters["bob"] == fair.counters["alice"]


def test_a_lead_earned_beside_backlogged_tenants_survives_leaving_and_coming_back() -> None:
    """Mallory sends one expensive request at a time beside alice's backlog: between two of
    them she is not backlogged, and comes back lifted at most, never lowered, so her lead
    (earned while alice asked too) still counts. Lowered to the greatest backlogged counter
    on each return (this session's first version), an address sending one 1,500-token prompt
    at a time got a third more service beside twenty looping ones."""
    fair = FairShare()
    fair.arrive("alice")
    fair.arrive("mallory")
    for _ in range(3):
        fair.charge("mallory", input_tokens=1_500)
        fair.charge("alice", output_tokens=100)
        fair.leave("mallory")
        fair.arrive("mallory")
    assert fair.counters["mallory"] == 4_500 * INPUT_WEIGHT
    assert fair.counters["alice"] == 300 * OUTPUT_WEIGHT
    waiting, running = [seq("mallory", 1.0)], [seq("alice", 0.0)]
    assert fair.claimant(waiting, running) is None  # far ahead: no claim on alice
    assert [s.request.tenant for s in fair.order_waiting([seq("alice", 2.0), *waiting], by_arrival)] == \
        ["alice", "mallory"]


def test_on_equal_counters_the_tenant_waiting_longest_goes_first() -> None:
    """Newcomers are lifted to one counter: the tie went by name, so addresses 127.0.0.10-19
    came before 127.0.0.2 whatever their arrival. Now the head that came first goes first."""
    fair = FairShare()
    late, early = seq("127.0.0.10", 2.0), seq("127.0.0.2", 1.0)
    assert fair.order_waiting([late, early], by_arrival) == [early, late]
    running = [seq("runner", 0.0)]
    fair.arrive("runner")
    fair.arrive("127.0.0.10")
    fair.arrive("127.0.0.2")
    assert fair.claimant([late, early], running) == Claim("127.0.0.2", "runner", preempts=False)


def test_clients_that_left_are_forgotten_past_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server without keys counts client addresses, which an attacker can vary: the counters
    of clients with nothing live are dropped past MAX_IDLE_COUNTERS, the backlogged and the
    last to leave kept (a dropped one comes back as a newcomer: lifted on arrival)."""
    from radixserve.engine import fair_share

    monkeypatch.setattr(fair_share, "MAX_IDLE_COUNTERS", 3)
    fair = FairShare()
    fair.arrive("live")
    fair.charge("live", input_tokens=7)
    for i in range(5):
        fair.arrive(i)
        fair.charge(i, input_tokens=100)
        fair.leave(i)
        assert len(fair.counters) <= 1 + 3 + 1
    assert "live" in fair.counters and 4 in fair.counters
    fair.arrive(0)  # forgotten: lifted to the backlog's least counter, as a newcomer
    assert fair.counters[0] == fair.counters["live"] == 7 * INPUT_WEIGHT


def test_a_request_of_a_tenant_is_shared_as_its_tenant_from_any_client() -> None:
    assert Request("r", [1], Params(), 0.0, tenant="acme", client=("address", "10.0.0.1")).fair_key == "acme"
    assert Request("r", [1], Params(), 0.0, client=("address", "10.0.0.1")).fair_key == ("address", "10.0.0.1")
    assert Request("r", [1], Params(), 0.0).fair_key is None


def test_priority_crosses_tenants_only_for_an_admin() -> None:
    fair = FairShare()
    fair.charge("a", input_tokens=1000)
    mine = [seq("a", 1, priority=10), seq("a", 2, priority=50)]
    other = [seq("b", 3)]
    policy = lambda group: sorted(group, key=lambda s: -s.priority)  # noqa: E731
    order = fair.order_waiting(mine + other, policy)
    assert [s.request.tenant for s in order] == ["b", "a", "a"]  # a's priorities order only a's
    assert order[1].priority == 50
    admin = seq("a", 4, priority=60, admin=True)  # first in a's queue, and an admin's: first of all
    assert fair.order_waiting(mine + other + [admin], policy)[0] is admin


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def engine_kwargs(tiny_llama_dir: Path) -> dict[str, object]:
    return dict(model=str(tiny_llama_dir), page_size=4, num_pages=96, max_running=16, max_batch_tokens=128,
                debug_checks=True)


def flood(engine: Engine, tenant: str | None, **kwargs: object) -> None:
    """The issue's attack scaled down: many prompts x n samples x many tokens at once."""
    rng = random.Random(0)
    for i in range(12):
        engine.add_request([rng.randrange(3, 300) for _ in range(20)],
                           SamplingParams(max_tokens=24, n=6, temperature=1.0, seed=i, ignore_eos=True),
                           tenant=tenant, **kwargs)


def innocent_run(engine: Engine, **kwargs: object) -> tuple[list[int], int, int]:
    """The innocent request's tokens, the steps until its first token and until its last."""
    request_id = engine.add_request(list(range(40, 60)), GREEDY, **kwargs)
    tokens: list[int] = []
    steps = first = last = 0
    while engine.has_work():
        deltas = engine.step()
        steps += 1
        for delta in deltas.get(request_id, []):
            tokens += delta.token_ids
            first = first or steps
            if delta.finish_reason is not None:
                last = steps
    return tokens, first, last


# Tenants; clients of the single tenant (a server without keys passes each one's address).
FLOODER_AND_INNOCENT = [(dict(tenant="flood"), dict(tenant="innocent")),
                        (dict(tenant=None, client=("address", "10.0.0.1")),
                         dict(tenant=None, client=("address", "10.0.0.2")))]


@pytest.mark.parametrize(("flooder", "innocent"), FLOODER_AND_INNOCENT, ids=["tenants", "clients"])
def test_a_flooding_tenant_neither_delays_nor_changes_an_innocent_one(engine_kwargs: dict[str, object],
                                                                      flooder: dict[str, object],
                                                                      innocent: dict[str, object]) -> None:
    alone = innocent_run(Engine(**engine_kwargs), **innocent)
    runs = {}
    for fair in (True, False):
        engine = Engine(fair_share=fair, **engine_kwargs)
        flood(engine, **flooder)
        engine.step()  # the flood is running when the innocent request arrives
        runs[fair] = innocent_run(engine, **innocent)
    for tokens, _, _ in runs.values():
        assert tokens == alone[0]
    (_, first, last), (_, unfair_first, _) = runs[True], runs[False]
    # It is admitted within a few steps, beside the flood: once the flood's counter is a
    # step's prefill (the preemption margin, 128 tokens here) ahead of its own, which the
    # flood's 16 running samples take 4 decode steps to reach; then a token a step.
    assert first <= alone[1] + 5 and last - first <= alone[2] - alone[1] + 2, (runs, alone)
    assert unfair_first > 4 * first  # without fair share it waits behind the flood


def test_one_tenants_long_prefill_does_not_hold_another_tenants_request(engine_kwargs: dict[str, object]) -> None:
    """A long prompt's prefill takes every step's whole token budget, chunk after chunk: a
    tenant's request that arrives meanwhile waited for all of them (15 steps here), since the
    claim of a tenant behind made room in slots and pages but left no tokens of the step; then
    until the long prompt's tenant was the preemption margin ahead (3 steps). A tenant not
    ahead claims its first chunk in the next step: its first token comes as soon as alone, its
    tokens unchanged, and the long prompt still finishes."""
    kwargs = {**engine_kwargs, "max_batch_tokens": 32, "num_pages": 160}
    alone = innocent_run(Engine(**kwargs), tenant="innocent")
    engine = Engine(**kwargs)
    engine.add_request([3 + (i * 7) % 290 for i in range(480)], GREEDY, tenant="long")
    engine.step()  # the long prompt's prefill is under way: 15 chunks of 32 tokens
    tokens, first, last = innocent_run(engine, tenant="innocent")
    assert tokens == alone[0]
    assert first == alone[1], (first, alone)
    # Then a token a step beside the prefill, but for one: served more than the long prompt's
    # tenant after its own prefill, its decode comes after that tenant's chunk in that step.
    assert last - first == alone[2] - alone[1] + 1
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0



@pytest.mark.parametrize(("flooder", "innocent"), FLOODER_AND_INNOCENT, ids=["tenants", "clients"])
def test_a_newcomer_takes_a_slot_from_a_tenant_holding_more_than_its_part(engine_kwargs: dict[str, object],
                                                                          flooder: dict[str, object],
                                                                          innocent: dict[str, object]) -> None:
    """Every slot held by one tenant's long generations, more of them waiting, and far from the
    preemption margin (4 rows earn 8 weighted tokens a step; the margin is 2,048): a newcomer
    waited for one of them to end (150 steps here; forty 300-token loops kept another
    address's chats over a second from a first token on SmolLM2). The tenant holds more than
    its part of the slots (4 > 4 // 2), so one of its decoding streams is preempted (its pages
    cached) and the newcomer's first token comes as alone. Everyone's tokens are unchanged."""
    kwargs = {**engine_kwargs, "max_running": 4}
    long = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    prompts = [[3 + (i * 11 + 5 * k) % 290 for i in range(20)] for k in range(6)]
    flood_alone = [list(o.token_ids) for o in Engine(**kwargs).generate(prompts, long)]
    alone = innocent_run(Engine(**kwargs), **innocent)
    engine = Engine(**kwargs)
    ids = [engine.add_request(prompt, long, **flooder) for prompt in prompts]
    flood_tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in range(3):  # four of them decoding, two waiting
        for rid, deltas in engine.step().items():
            flood_tokens[rid] += [t for d in deltas for t in d.token_ids]
    assert engine.stats()["running"] == 4
    request_id = engine.add_request(list(range(40, 60)), GREEDY, **innocent)
    tokens: list[int] = []
    steps = first = 0
    while engine.has_work():
        steps += 1
        for rid, deltas in engine.step().items():
            got = [t for d in deltas for t in d.token_ids]
            if rid == request_id:
                tokens += got
                first = first or (steps if got else 0)
            else:
                flood_tokens[rid] += got
    assert tokens == alone[0] and first == alone[1], (first, alone)
    assert [flood_tokens[rid] for rid in ids] == flood_alone
    assert engine.stats()["fair_preemptions"] == 1


def streams_beside_loops(engine_kwargs: dict[str, object], streams: int, stream_tokens: int,
                         loop_tokens: int) -> tuple[Engine, list[int]]:
    """One client's `streams` greedy streams beside eight clients looping short requests from
    step 3, four slots, the invariants checked every step; asserts the streams' tokens equal
    theirs alone, and returns the engine and each stream's largest gap between tokens (steps)."""
    kwargs = {**engine_kwargs, "max_running": 4, "num_pages": 400}
    long = SamplingParams(max_tokens=stream_tokens, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=loop_tokens, temperature=0.0, ignore_eos=True)
    prompts = [[3 + (i * 13 + 7 * k) % 290 for i in range(20)] for k in range(streams)]
    alone = [list(o.token_ids) for o in Engine(**kwargs).generate(prompts, long)]
    engine = Engine(**kwargs)
    tokens: dict[str, list[int]] = {engine.add_request(prompt, long, client="streams"): [] for prompt in prompts}
    last_token = dict.fromkeys(tokens, 0)
    gaps = dict.fromkeys(tokens, 0)
    loops: dict[str, int] = {}
    for step in range(1, 2000):
        if step == 3:  # the streams are decoding; the loops begin
            loops = {engine.add_request([40 + i, 41, 42] * 6, short, client=f"loop-{i}"): i for i in range(8)}
        for rid, deltas in engine.step().items():
            got = [t for d in deltas for t in d.token_ids]
            if rid in tokens and got:
                tokens[rid] += got
                gaps[rid] = max(gaps[rid], step - last_token[rid])
                last_token[rid] = step
            elif rid in loops and any(d.finish_reason for d in deltas):
                i = loops.pop(rid)
                loops[engine.add_request([40 + i, 41, 42] * 6, short, client=f"loop-{i}")] = i
        if all(len(got) == stream_tokens for got in tokens.values()):
            break
        engine.check_invariants()
    assert list(tokens.values()) == alone
    return engine, list(gaps.values())


def test_a_stream_that_lends_its_slot_gets_the_next_free_one(engine_kwargs: dict[str, object]) -> None:
    """One client's two long streams beside eight clients looping short requests, four slots:
    each newcomer with nothing running borrows a slot from the client holding more than its
    part, and the lender comes back at the next free slot, before any other waiting request.
    Preempted without the loan, a stream waited for its client's counter to be the least
    again, which the client's other stream, still running, kept it from: a stall mid-stream
    (55 s on SmolLM2 beside thirty looping addresses; 200 steps and more here)."""
    engine, gaps = streams_beside_loops(engine_kwargs, streams=2, stream_tokens=150, loop_tokens=12)
    assert max(gaps) <= 20, gaps
    assert engine.stats()["fair_preemptions"] >= 5  # the loans happened


def test_one_clients_streams_take_turns_in_its_slots(engine_kwargs: dict[str, object]) -> None:
    """One client's four 60-token streams beside eight clients looping 40-token requests, four
    slots: the client holds about one, and its streams lend it in turn. Lenders readmitted in
    the fair order (the client's oldest stream first, as the policy orders a client's own)
    stalled one after another (the last for 273 steps here; on SmolLM2, four streams beside
    forty addresses, 20.8 s); readmitted in the order they lent, every stream's largest gap
    stays near one loop request's length (41 steps)."""
    engine, gaps = streams_beside_loops(engine_kwargs, streams=4, stream_tokens=60, loop_tokens=40)
    assert max(gaps) <= 50, gaps
    assert engine.stats()["fair_preemptions"] >= 20  # the streams lent, again and again


def test_a_client_back_among_newcomers_is_served_as_one_of_them(engine_kwargs: dict[str, object]) -> None:
    """A heavy client's three streams beside a light one's, four slots, nobody waiting; the
    light one leaves last. Eight clients looping 20-token requests arrive (lifted to the light
    one's counter), then the heavy client asks again: lowered to their greatest counter, its
    first token comes within a few loop requests (40 steps); kept 400 weighted tokens ahead, it
    waited until each of the eight had caught up (440 steps)."""
    kwargs = {**engine_kwargs, "max_running": 4, "num_pages": 400}
    short = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = [60, 61, 62] * 6
    alone = list(Engine(**kwargs).generate([prompt], short)[0].token_ids)
    engine = Engine(**kwargs)
    for k in range(3):
        engine.add_request([3 + k, 5, 7] * 6, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
                           client="heavy")
    engine.add_request([9, 5, 7] * 6, SamplingParams(max_tokens=110, temperature=0.0, ignore_eos=True),
                       client="light")
    while engine.has_work():
        engine.step()
    loops = {engine.add_request([40 + i, 41, 42] * 6, short, client=f"loop-{i}"): i for i in range(8)}
    engine.step()
    request_id = engine.add_request(prompt, short, client="heavy")
    tokens: list[int] = []
    first = 0
    for step in range(1, 2000):
        for rid, deltas in engine.step().items():
            if rid == request_id:
                tokens += [t for d in deltas for t in d.token_ids]
                first = first or (step if tokens else 0)
            elif rid in loops and any(d.finish_reason for d in deltas):
                i = loops.pop(rid)
                loops[engine.add_request([40 + i, 41, 42] * 6, short, client=f"loop-{i}")] = i
        if len(tokens) == short.max_tokens:
            break
    assert tokens == alone
    assert first <= 3 * short.max_tokens, first


def test_a_newcomer_is_admitted_before_the_waiting_requests_of_the_tenant_it_claims_on(
        engine_kwargs: dict[str, object]) -> None:
    """The long prompts' tenant has three more waiting, level with the newcomer (lifted to its
    counter on arrival; a tie in the fair order goes by name): the tokens kept for the claim
    go to the claimant, not to the next long prompt."""
    kwargs = {**engine_kwargs, "max_batch_tokens": 32, "num_pages": 400}
    alone = innocent_run(Engine(**kwargs), tenant="b-innocent")
    engine = Engine(**kwargs)
    for k in range(4):
        engine.add_request([3 + ((i + 13 * k) * 7) % 290 for i in range(200)], GREEDY, tenant="a-long")
    engine.step()
    tokens, first, _ = innocent_run(engine, tenant="b-innocent")
    assert tokens == alone[0] and first == alone[1], (first, alone)


def test_claims_admit_a_tenant_with_nothing_running_not_more_of_one_being_served(
        engine_kwargs: dict[str, object]) -> None:
    """Two tenants with four 200-token prompts each, 32 tokens a step: a claim without
    preemption is for a tenant with nothing running. Where any tenant not ahead claimed,
    each step admitted one more prompt (8 prefilling at once by step 8) and the first tokens
    came at steps 19, 20, 29, ... instead of 13, 13, 25, ...: prefills shared the steps."""
    engine = Engine(**{**engine_kwargs, "max_batch_tokens": 32, "num_pages": 400})
    for tenant, offset in (("a", 0), ("b", 50)):
        for k in range(4):
            engine.add_request([3 + ((i + 13 * k + offset) * 7) % 290 for i in range(200)], GREEDY, tenant=tenant)
    running: list[int] = []
    first: dict[str, int] = {}
    while engine.has_work():
        deltas = engine.step()
        running.append(len(engine.scheduler.running))
        for request_id, ds in deltas.items():
            if any(d.token_ids for d in ds):
                first.setdefault(request_id, len(running))
    assert max(running[:12]) == 2
    assert sorted(first.values()) == [13, 13, 25, 26, 38, 39, 51, 52], sorted(first.values())


def test_a_claim_neither_stalls_on_a_deferred_request_nor_yields_to_the_floods_decodes(
        engine_kwargs: dict[str, object]) -> None:
    """The flood's 48 decodes alone exceed a step's 32 tokens. A tenant behind sends two
    requests over one 200-token prefix: the second waits for the first's prefill (shared
    prefix in flight). Tokens kept for a claim that admission would defer stalled everything
    (the first's prefill got none of the step); kept short of a token for every running
    sequence, the flood's included, they were none, and the tenant waited ~150 steps. Both
    first tokens now come within a few steps of the prefill's 7 chunks, unchanged."""
    kwargs = {**engine_kwargs, "max_running": 48, "max_batch_tokens": 32, "num_pages": 1600, "max_wait_s": 1e9}
    prefix = [3 + (i * 11) % 280 for i in range(200)]
    prompts = [prefix + [7, 8, 9, k] for k in range(2)]
    alone = [list(output.token_ids) for output in Engine(**kwargs).generate(prompts, GREEDY)]
    engine = Engine(**kwargs)
    for i in range(6):
        engine.add_request([10 + i, 11, 12, 13], SamplingParams(max_tokens=100, n=8, temperature=1.0, seed=i,
                                                                ignore_eos=True), tenant="flood")
    for _ in range(4):
        engine.step()
    ids = [engine.add_request(prompt, GREEDY, tenant="w") for prompt in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    first: dict[str, int] = {}
    for step in range(1, 400):
        for rid, deltas in engine.step().items():
            if rid in tokens:
                tokens[rid] += [t for d in deltas for t in d.token_ids]
                first.setdefault(rid, step)
        if all(len(t) == GREEDY.max_tokens for t in tokens.values()):
            break
    assert len(first) == 2 and max(first.values()) <= 14, first
    assert [tokens[rid] for rid in ids] == alone


def test_one_tenants_high_priority_does_not_jump_another_tenant(engine_kwargs: dict[str, object]) -> None:
    engine = Engine(**engine_kwargs)
    rng = random.Random(1)
    for _ in range(24):
        engine.add_request([rng.randrange(3, 300) for _ in range(20)], GREEDY, tenant="loud", priority=100)
    engine.step()
    _, first, _ = innocent_run(engine, tenant="quiet")
    assert first <= 3


@pytest.mark.parametrize(("max_batch_tokens", "num_pages", "max_running"), [(8, 20, 256), (16, 18, 256), (8, 20, 1)])
def test_two_tenants_whose_prompts_cannot_both_fit_both_finish(tiny_llama_dir: Path, max_batch_tokens: int,
                                                               num_pages: int, max_running: int) -> None:
    """Two tenants' 60-token prompts in a pool that holds one: charging recomputation as
    service, and preempting prefills, they preempted each other for ever (998 preemptions,
    47,864 of 47,984 tokens recomputed in 3,000 steps); a claim kept for a tenant whose
    admission then failed gave the running one no tokens, step after step. Both finish, with
    one tenant's tokens."""
    kwargs = dict(model=str(tiny_llama_dir), page_size=4, num_pages=num_pages, max_batch_tokens=max_batch_tokens,
                  max_running=max_running, debug_checks=True)
    prompts = [list(range(10, 70)), list(range(100, 160))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    alone = [list(o.token_ids) for o in Engine(**kwargs).generate(prompts, params)]
    engine = Engine(**kwargs)
    ids = [engine.add_request(prompt, params, tenant=tenant) for prompt, tenant in zip(prompts, "ab")]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in range(100):
        if not engine.has_work():
            break
        for rid, deltas in engine.step().items():
            tokens[rid] += [t for d in deltas for t in d.token_ids]
    assert not engine.has_work()
    assert [tokens[rid] for rid in ids] == alone
    assert engine.stats()["fair_preemptions"] <= 1


def test_a_claimant_whose_cached_prefix_is_all_that_is_evictable_does_not_stall_the_step(
        tiny_llama_dir: Path) -> None:
    """Page size 1, 40 pages: tenant b's second request extends its first, whose 12 cached
    pages are all the pool could evict. Counted as room (they were also its hit), the claim
    looked admissible, failed on taking them, and kept the step's tokens from tenant a's
    running request: nothing moved for 2,000 steps."""
    engine = Engine(model=str(tiny_llama_dir), page_size=1, num_pages=40, max_batch_tokens=4, max_running=4,
                    debug_checks=True)
    prompt = list(range(100, 112))
    engine.add_request(list(range(10, 20)), SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True), tenant="a")
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), tenant="b")
    while engine.pool.num_free > 2 or len(engine.scheduler.running) > 1:
        engine.step()
    engine.add_request(prompt + list(range(200, 208)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                       tenant="b")
    for _ in range(200):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work()
