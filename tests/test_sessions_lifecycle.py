"""A session's life: a close wins over its turns then in flight, expiry shows in the stats without
traffic, a turn is raised at most up to its tenant's share, and the deadline heap stays bounded
by the open entries however often they are renewed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from server_util import wait_for_async

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.engine.sessions import SessionTable

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TURN = list(range(200, 232))


def make_engine(ckpt: Path, **kwargs: object) -> Engine:
    kwargs.setdefault("num_pages", 40)
    return Engine(model=str(ckpt), page_size=4, max_running=4, debug_checks=True, **kwargs)


def finish(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def start_turn(engine: Engine, session_id: str, tenant: str | None = None, prompt: list[int] = TURN) -> str:
    """Adds a turn and runs one step: its prompt is computed, its output still to come."""
    request_id = engine.add_request(prompt, GREEDY, session_id=session_id, tenant=tenant)
    engine.step()
    assert engine.has_work()
    return request_id


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def with_fake_clock(engine: Engine) -> FakeClock:
    clock = FakeClock()
    engine.sessions._clock = clock
    engine.sessions.last_sweep = clock.now
    return clock


# ---------------------------------------------------------------- a close and the turns in flight

def test_a_close_wins_over_the_turns_in_flight_and_a_later_turn_opens_the_session_again(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    start_turn(engine, "s", "a")
    assert engine.close_session("s", "a")  # its first turn runs: the close takes it
    finish(engine)
    assert engine.stats()["sessions_open"] == 0 and engine.sessions.tokens == 0
    start_turn(engine, "s", "a")  # a later turn opens it again
    finish(engine)
    assert engine.stats()["sessions_open"] == 1
    start_turn(engine, "s", "a", TURN + [5])
    assert engine.close_session("s", "a")  # open, and its second turn running
    finish(engine)
    assert engine.stats()["sessions_open"] == 0 and engine.sessions.tokens == 0
    assert not engine.close_session("s", "a")


def test_a_close_of_another_tenants_session_touches_none_of_its_turns(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    start_turn(engine, "s", "a")
    assert not engine.close_session("s", "b")  # another tenant's id: as for an unknown one
    finish(engine)
    assert engine.stats()["sessions_open"] == 1 and engine.close_session("s", "a")


# ---------------------------------------------------------------- expiry without traffic

def test_the_stats_show_an_expired_session_ended_without_a_step(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, session_ttl_s=5.0)
    clock = with_fake_clock(engine)
    start_turn(engine, "s")
    finish(engine)
    steps = engine.stats()["steps"]
    assert engine.stats()["sessions_open"] == 1
    clock.now += 4.0
    assert engine.stats()["sessions_open"] == 1  # idle 4 s of its 5
    clock.now += 1.5
    stats = engine.stats()
    assert stats["sessions_open"] == 0 and stats["steps"] == steps and engine.sessions.tokens == 0
    assert not engine.close_session("s")


def test_an_idle_async_engine_publishes_the_expiry(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, session_ttl_s=5.0)
    clock = with_fake_clock(engine)

    async def scenario() -> None:
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        try:
            async for _ in async_engine.generate(TURN, GREEDY, request_id="t", session_id="s"):
                pass
            assert await wait_for_async(lambda: async_engine.stats()["sessions_open"] == 1)
            clock.now += 6.0  # no request follows: the idle loop's publications sweep
            assert await wait_for_async(lambda: async_engine.stats()["sessions_open"] == 0)
        finally:
            await async_engine.shutdown()

    asyncio.run(scenario())



# ---------------------------------------------------------------- a turn over the share

def test_a_turn_longer_than_the_bound_raises_only_its_leading_tokens(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)  # 40 pages of 4 tokens: sessions raise at most 80
    prompt = list(range(100, 200))
    engine.add_request(prompt, GREEDY, session_id="big")
    finish(engine)  # 111 tokens computed: the first 80 are raised
    assert engine.sessions.max_tokens == 80 and engine.sessions.tokens == 80
    assert engine.stats()["sessions_open"] == 1


# ---------------------------------------------------------------- the deadline heap

def test_the_deadline_heap_stays_within_twice_the_open_entries() -> None:
    clock = FakeClock()
    ended: list[list[int]] = []
    sessions = SessionTable(10.0, 10**6, lambda held, keep: ended.append(held.tokens), clock=clock)

    def turn(session_id: str, token: int) -> None:
        sessions.begin_turn(session_id, 3)
        sessions.add(session_id, [token] * 3, "ns")

    turn("other", 9)
    sizes = []
    for i in range(200):  # one session renewed 200 times within its TTL
        clock.now += 0.01
        turn("s", i)
        sizes.append(len(sessions._deadlines))
    # Rebuilt to the 2 open entries once past 2 * 2 + 64 (DEADLINE_SLACK) = 68: at turns 68 and 135.
    assert max(sizes) == 68 and sizes[-1] == 67 and [i + 1 for i, n in enumerate(sizes) if n == 2] == [1, 68, 135]
    assert len(sessions) == 2 and len(ended) == 199  # each renewal ended the turn before
    clock.now = 1000.0 + 10.5  # past the first session's deadline, not the renewed one's
    sessions.expire()
    assert len(sessions) == 1 and ended[-1] == [9] * 3
    clock.now += 2.0 + 10.0
    sessions.expire()
    assert len(sessions) == 0 and ended[-1] == [199] * 3 and sessions.tokens == 0
