"""Sessions belong to tenants: keyed by (tenant, id), their token bound shared fairly between
tenants, and the retention several sessions raise over a shared prefix counted per holder.

The table's own choices (which session ends, which pages stay raised) are checked on
SessionTable with a manual clock; the engine tests check the same through the cache: what a
later turn finds cached.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from radixserve import Engine, SamplingParams
from radixserve.cache.retention import Retention
from radixserve.engine.sessions import MAX_OPEN_PER_TENANT, Held, SessionTable

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FILLER = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class Recorder:
    """The demote callback of a table under test: which sessions ended, keeping how many pages."""

    def __init__(self) -> None:
        self.ended: list[tuple[str | None, list[int], int]] = []

    def __call__(self, session: Held, keep_pages: int) -> None:
        self.ended.append((session.tenant, session.tokens, keep_pages))


def table(max_tokens: int, page_size: int = 1) -> tuple[SessionTable, Recorder]:
    ticks = iter(range(10**6))  # every call a later time: recency is call order
    recorder = Recorder()
    return SessionTable(1e9, max_tokens, recorder, clock=lambda: float(next(ticks)), page_size=page_size), recorder


def open_turn(sessions: SessionTable, tenant: str | None, session_id: str, tokens: list[int],
              namespace: object = "ns") -> None:
    _, end, _ = sessions.begin_turn(session_id, len(tokens), tenant)
    sessions.add(session_id, tokens[:end], namespace, tenant)


def test_the_sweep_ends_the_oldest_session_of_the_tenant_over_its_share() -> None:
    sessions, recorder = table(100)
    open_turn(sessions, "b", "x", [1] * 40)
    open_turn(sessions, "a", "a1", [2] * 30)
    open_turn(sessions, "a", "a2", [3] * 30)
    open_turn(sessions, "a", "a3", [4] * 30)  # 130 > 100: a holds 90 of them
    assert [(t, toks[0]) for t, toks, _ in recorder.ended] == [("a", 2)]
    open_turn(sessions, "a", "a4", [5] * 30)
    assert [(t, toks[0]) for t, toks, _ in recorder.ended] == [("a", 2), ("a", 3)]
    assert sessions.tenant_tokens("b") == 40 and sessions.tenant_tokens("a") == 60
    assert sessions.close("x", "b")


def test_the_requester_over_its_share_ends_its_own_sessions_first() -> None:
    sessions, recorder = table(100)
    open_turn(sessions, "a", "a1", [1] * 30)
    open_turn(sessions, "b", "b1", [2] * 30)
    open_turn(sessions, "b", "b2", [3] * 30)
    open_turn(sessions, "a", "a2", [4] * 30)  # a and b would hold 60 each: a, the requester, yields
    assert [(t, toks[0]) for t, toks, _ in recorder.ended] == [("a", 1)]


def test_a_turn_over_its_share_is_cut_to_it_and_pushes_out_no_tenant_within_its_share() -> None:
    sessions, recorder = table(100)
    open_turn(sessions, "b", "x", [1] * 40)
    assert sessions.begin_turn("big", 120, "a")[:2] == (0, 50)  # a's share: 50 of 100
    sessions.add("big", [2] * 50, "ns", "a")
    assert recorder.ended == [] and len(sessions) == 2
    assert sessions.tenant_tokens("a") == 50 and sessions.tenant_tokens("b") == 40 and sessions.tokens == 90
    open_turn(sessions, "b", "y", [3] * 20)  # b, over its share now, ends its own oldest
    assert [(t, toks[0]) for t, toks, _ in recorder.ended] == [("b", 1)]
    assert sessions.tenant_tokens("a") == 50 and sessions.tenant_tokens("b") == 20


def test_one_tenants_turn_longer_than_the_bound_is_raised_up_to_the_bound() -> None:
    sessions, recorder = table(100)
    assert sessions.begin_turn("s", 150, None)[:2] == (0, 100)  # its leading tokens
    sessions.add("s", list(range(100)), "ns", None)
    assert sessions.tokens == 100 and len(sessions) == 1 and recorder.ended == []
    none = SessionTable(1e9, 0, recorder)  # a bound of 0: nothing is raised, nothing opens
    assert none.begin_turn("s", 10)[:2] == (0, 0)
    none.add("s", [], "ns")
    assert len(none) == 0 and none.tokens == 0


def test_one_tenant_ends_its_least_recently_active_sessions_first() -> None:
    sessions, recorder = table(100)
    for i, sid in enumerate(["s1", "s2", "s3"]):
        open_turn(sessions, None, sid, [i + 1] * 30)
    open_turn(sessions, None, "s1", [9] * 30)  # a new turn of s1 ends its previous one only
    assert [toks[0] for _, toks, _ in recorder.ended] == [1]
    open_turn(sessions, None, "s4", [5] * 30)  # s2 is now the least recently active
    assert [toks[0] for _, toks, _ in recorder.ended] == [1, 2]
    open_turn(sessions, None, "huge", [6] * 500)  # longer than the bound: alone
    assert [toks[0] for _, toks, _ in recorder.ended] == [1, 2, 3, 9, 5] and len(sessions) == 1


def test_a_session_id_is_its_tenants_own() -> None:
    sessions, recorder = table(1000)
    open_turn(sessions, "a", "s", [1] * 10)
    open_turn(sessions, "b", "s", [2] * 10)  # the same id from another tenant: another session
    assert recorder.ended == [] and len(sessions) == 2
    assert not sessions.close("s", "c") and not sessions.close("s")
    assert sessions.close("s", "a") and not sessions.close("s", "a") and sessions.close("s", "b")


@pytest.mark.parametrize(("mine", "theirs", "kept"), [
    ([1] * 8 + [2] * 4, [1] * 8 + [3] * 4, 2),  # two shared pages, then each its own
    ([1] * 10 + [2] * 2, [1] * 10 + [3] * 2, 2),  # they part inside page 2: it is each one's own
    ([1] * 10, [1] * 16, 3),  # mine ends inside their page 2: that page holds mine too
    ([1] * 16, [1] * 10, 3),  # theirs ends inside my page 2: their partial turn is in it
    ([5] * 12, [1] * 12, 0),
])
def test_an_ended_session_keeps_the_pages_another_session_holds(mine: list[int], theirs: list[int],
                                                                 kept: int) -> None:
    sessions, recorder = table(1000, page_size=4)
    open_turn(sessions, "a", "mine", mine)
    open_turn(sessions, "a", "theirs", theirs)
    open_turn(sessions, "a", "elsewhere", theirs, namespace="other")  # another namespace holds nothing here
    assert sessions.close("mine", "a")
    assert recorder.ended == [("a", mine, kept)]


# ---------------------------------------------------------------- through the engine's cache

def make_engine(ckpt: Path, **kwargs: object) -> Engine:
    kwargs.setdefault("num_pages", 40)
    return Engine(model=str(ckpt), page_size=4, max_running=1, eviction_policy="priority", debug_checks=True,
                  **kwargs)


def run(engine: Engine, prompt: list[int], **kwargs: object) -> None:
    engine.add_request(prompt, GREEDY, **kwargs)
    while engine.has_work():
        engine.step()


def flood_cache(engine: Engine) -> None:
    """Ordinary one-off prompts enough to evict every page at the default priority."""
    rng = random.Random(0)
    engine.generate([[rng.randrange(3, 190) for _ in range(60)] for _ in range(6)], FILLER)


def cached(engine: Engine, prompt: list[int], tenant: str | None) -> int:
    engine.add_request(prompt, GREEDY, tenant=tenant)
    req = engine.scheduler.waiting[-1].request
    while engine.has_work():
        engine.step()
    return req.cached_tokens or 0


def test_closing_one_of_two_sessions_over_a_prefix_keeps_the_others_raised(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, max_session_tokens=10**6)
    system = list(range(200, 232))
    run(engine, system + [1, 2], session_id="s1", tenant="a")
    run(engine, system + [3, 4], session_id="s2", tenant="a")
    assert engine.close_session("s1", "a")
    flood_cache(engine)
    assert cached(engine, system + [5, 6], "a") == len(system)
    assert engine.close_session("s2", "a")


def test_another_tenants_session_is_neither_closed_nor_replaced(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, max_session_tokens=10**6)
    turn = list(range(250, 282))
    run(engine, turn, session_id="s", tenant="victim")
    assert not engine.close_session("s", "attacker")  # as for an unknown id
    run(engine, list(range(100, 132)), session_id="s", tenant="attacker")  # the same id: its own session
    assert engine.stats()["sessions_open"] == 2
    flood_cache(engine)
    assert cached(engine, turn + [1], "victim") == len(turn)
    assert engine.close_session("s", "victim") and engine.close_session("s", "attacker")


def test_a_tenant_opening_many_sessions_ends_only_its_own(tiny_llama_dir: Path) -> None:
    raised = 32 + GREEDY.max_tokens - 1  # computed tokens of one turn
    engine = make_engine(tiny_llama_dir, num_pages=64, max_session_tokens=3 * raised + 1)
    victim = list(range(250, 282))
    run(engine, victim, session_id="mine", tenant="victim")
    for i in range(6):
        run(engine, [100 + i] + list(range(140, 171)), session_id=f"flood-{i}", tenant="attacker")
    assert engine.sessions.tenant_tokens("victim") == raised
    assert engine.sessions.tenant_tokens("attacker") == 2 * raised
    flood_cache(engine)
    assert cached(engine, victim + [1], "victim") == len(victim)
    assert engine.close_session("mine", "victim")


# ---------------------------------------------------------------- tenants' raised retention

def test_a_held_span_is_cut_to_its_tenants_share_and_renewed_by_resending() -> None:
    sessions, recorder = table(100)
    open_turn(sessions, "b", "x", [1] * 30)
    pending = sessions.begin_holds([([2] * 80, Retention(100))], "ns", "a")  # a's share: 50 of 100
    assert [(len(hold.tokens), hold.span) for hold in pending] == [(50, (0, 50, Retention(100, 1e9)))]
    sessions.add_holds(pending, "ns")
    assert sessions.tenant_tokens("a") == 50 and sessions.held_spans == 1 and len(sessions) == 1
    again = sessions.begin_holds([([2] * 80, Retention(100, 5.0))], "ns", "a")  # the same span: renewed
    assert again[0].key == pending[0].key and again[0].retention == Retention(100, 5.0)
    assert recorder.ended == [("a", [2] * 50, 0)]
    sessions.add_holds(again, "ns")
    assert sessions.tenant_tokens("a") == 50 and sessions.held_spans == 1


def test_held_spans_and_sessions_share_one_bound_and_expire_by_their_own_duration() -> None:
    sessions, recorder = table(100)
    sessions.add_holds(sessions.begin_holds([([1] * 40, Retention(80, 5.0))], "ns", "a"), "ns")  # at tick 1
    open_turn(sessions, "a", "s", [2] * 40)
    sessions.add_holds(sessions.begin_holds([([3] * 40, Retention(60))], "ns", "a"), "ns")  # 120 > 100
    assert [toks[0] for _, toks, _ in recorder.ended] == [1]  # a's least recently active entry
    assert sessions.tenant_tokens("a") == 80 and len(sessions) == 1 and sessions.held_spans == 1
    sessions, recorder = table(1000)  # the clock reads 1, 2, 3, ... call by call
    span = [([1] * 8, Retention(80, 2.0))]
    sessions.add_holds(sessions.begin_holds(span, "ns", "a"), "ns")  # raised at 2: until 4
    sessions.add_holds(sessions.begin_holds(span, "ns", "a"), "ns")  # renewed at 4: until 6
    assert recorder.ended == [("a", [1] * 8, 0)]  # (a renewal ends it, and raises it again)
    sessions.expire()  # 5: past the first deadline, not the renewed one
    sessions.expire()  # 6
    assert len(recorder.ended) == 1 and sessions.held_spans == 1
    sessions.expire()  # 7: past it
    assert len(recorder.ended) == 2 and sessions.tokens == 0


def raise_and_hit(engine: Engine, attacker: dict, rounds: int = 5) -> list[int]:
    """The attacker sends 8 prompts at retention 100, then one more each round, in which the
    victim sends its working set of 2 prompts at the default; the victim's cached tokens per
    round after the first."""
    rng = random.Random(3)
    flood = [[rng.randrange(3, 190) for _ in range(28)] for _ in range(8 + rounds)]
    victim = [[rng.randrange(3, 190) for _ in range(21)] for _ in range(2)]
    for prompt in flood[:8]:
        run(engine, prompt, retention=Retention(100), **attacker)
    hits = []
    for prompt in flood[8:]:
        run(engine, prompt, retention=Retention(100), **attacker)
        hits.append(sum(cached(engine, prompt, "victim") for prompt in victim))
    engine.check_invariants()
    return hits[1:]


def test_a_tenants_raised_retention_pins_at_most_its_share_of_the_pool(tiny_llama_dir: Path) -> None:
    """On a 64-page pool, prompts at priority 100 pin it whole for an admin (the victim's
    working set is recomputed every round); from a tenant they are held within its share of
    the raised tokens (half the pool), and the victim's working set stays cached."""
    admin = raise_and_hit(make_engine(tiny_llama_dir, num_pages=64), {"tenant": "mallory", "admin": True})
    tenant_engine = make_engine(tiny_llama_dir, num_pages=64)
    held = raise_and_hit(tenant_engine, {"tenant": "mallory"})
    assert admin == [0, 0, 0, 0]
    assert held == [2 * 20] * 4
    assert tenant_engine.sessions.tenant_tokens("mallory") <= 64 * 4 // 2


def test_a_tenant_keeps_at_most_its_entry_bound_open_and_ends_only_its_own() -> None:
    """Ending an entry compares it with its tenant's others on the engine's thread: a tenant
    opening thousands of tiny sessions ends its own least recently active ones past
    MAX_OPEN_PER_TENANT, and another tenant's entries stay."""
    sessions, recorder = table(10**6)
    open_turn(sessions, "b", "mine", [7] * 8)
    for i in range(MAX_OPEN_PER_TENANT + 10):
        open_turn(sessions, "a", f"s{i}", [i, i + 1])
    assert [toks for _, toks, _ in recorder.ended] == [[i, i + 1] for i in range(10)]
    assert len(sessions) == MAX_OPEN_PER_TENANT + 1 and sessions.tenant_tokens("b") == 8
    sessions.add_holds(sessions.begin_holds([([5] * 4, Retention(80))], "ns", "a"), "ns")  # a held span counts too
    assert recorder.ended[-1][1] == [10, 11] and sessions.held_spans == 1
