"""One request or one tenant taking the engine (issue 22, items 3 and 5).

On a real server (real sockets): the issue's flood (many prompts x n=16 x many tokens) is a 400
in OpenAI's error shape before anything is queued, an unset max_tokens shrinks to the bound
instead, a priority outside the documented range is a 400, and closing an unknown session is
a 404. Between tenants, on the engine (the scheduler the server runs): a flooding
tenant beside an innocent one leaves the innocent's output unchanged and its time to first
token (in engine steps, never seconds, stepped by the test) within twice that beside an equal
number of benign requests; and it neither ends nor demotes any of the innocent's sessions.

Once API keys name tenants (a keys file), the tenant checks here belong on the real server
too: the flood and the innocent client each with its own key.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from server_util import running_server

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.server import create_app

MAX_REQUEST_TOKENS = 4096
INNOCENT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
INNOCENT_PROMPT = list(range(40, 60))


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    engine = AsyncEngine(Engine(model="demo", page_size=16, num_pages=256))
    with running_server(create_app(engine, max_request_tokens=MAX_REQUEST_TOKENS)) as url:
        yield SimpleNamespace(url=url, engine=engine)


def test_the_issues_flood_is_refused_before_anything_is_queued(server: SimpleNamespace) -> None:
    flood = {"prompt": ["flood the engine"] * 64, "n": 16, "max_tokens": 256, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        r = client.post("/v1/completions", json=flood)
        assert r.status_code == 400
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "max_tokens",
                                                                 "request_too_large")
        assert "262144" in error["message"] and str(MAX_REQUEST_TOKENS) in error["message"]
        assert server.engine.stats()["requests_finished"] == 0 and server.engine.stats()["waiting"] == 0
        # The same beam width or n with an unset max_tokens shrinks to fit instead.
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 16,
                                                      "ignore_eos": True})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["completion_tokens"] == MAX_REQUEST_TOKENS // 16 * 16
        r = client.post("/v1/completions", json={"prompt": "hi", "use_beam_search": True, "beam_width": 8,
                                                 "max_tokens": MAX_REQUEST_TOKENS // 8 + 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("priority", [-101, 101, 2**62])
def test_a_priority_outside_the_documented_range_is_a_400(server: SimpleNamespace, priority: int) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": priority})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "priority": 100}).status_code == 200


def test_closing_an_unknown_session_is_a_404(server: SimpleNamespace) -> None:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/sessions/nobody-has-this/close")
        assert r.status_code == 404
        assert r.json()["error"] == {"message": "No open session 'nobody-has-this'", "type": "invalid_request_error",
                                     "param": "session_id", "code": "session_not_found"}


# ---------------------------------------------------------------- between tenants

def engine_for(ckpt: Path, fair_share: bool = True) -> Engine:
    return Engine(model=str(ckpt), page_size=4, num_pages=96, max_running=16, max_batch_tokens=128,
                  fair_share=fair_share)


async def drain(stream) -> list[int]:  # type: ignore[no-untyped-def]
    tokens: list[int] = []
    async for delta in stream:
        tokens += delta.token_ids
    return tokens


def innocent_beside(engine: Engine, neighbour: list[tuple[list[int], SamplingParams]]) -> tuple[list[int], int]:
    """The innocent tenant's tokens and its time to first token in engine steps, with the
    `neighbour` tenant's requests running when it arrives. Stepped here, one step at a time,
    so the count is the scheduler's alone (a consumer starved of CPU beside an engine thread
    would count steps it did not wait for)."""
    try:
        for i, (prompt, params) in enumerate(neighbour):
            engine.add_request(prompt, params, request_id=f"n{i}", tenant="neighbour")
        while engine.stats()["running"] == 0:
            engine.step()
        engine.add_request(INNOCENT_PROMPT, INNOCENT, request_id="innocent", tenant="innocent")
        tokens: list[int] = []
        steps, first_at = 0, None
        while engine.has_work():
            new = engine.step().get("innocent", [])
            steps += 1
            tokens += [t for delta in new for t in delta.token_ids]
            first_at = steps if first_at is None and tokens else first_at
        assert first_at is not None
        return tokens, first_at
    finally:
        engine.close()


def neighbours(n: int, max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(0)
    return [([rng.randrange(3, 300) for _ in range(20)],
             SamplingParams(max_tokens=max_tokens, n=n, temperature=1.0, seed=i, ignore_eos=True)) for i in range(12)]


def test_a_flooding_tenant_leaves_an_innocent_ones_output_and_first_token(tiny_llama_dir: Path) -> None:
    benign = innocent_beside(engine_for(tiny_llama_dir), neighbours(n=1, max_tokens=4))
    flooded = innocent_beside(engine_for(tiny_llama_dir), neighbours(n=6, max_tokens=48))
    assert flooded[0] == benign[0]
    # Steps, not seconds; the few extra steps are the preemption margin (fair_share.py).
    assert flooded[1] <= 2 * benign[1] + 5, (flooded[1], benign[1])


def test_a_tenant_cannot_end_or_demote_another_tenants_sessions(tiny_llama_dir: Path) -> None:
    async def scenario() -> tuple[int, int, bool, int]:
        engine = AsyncEngine(Engine(model=str(tiny_llama_dir), page_size=4, num_pages=128, max_running=4,
                                    eviction_policy="priority", max_session_tokens=400))
        await engine.start()
        try:
            turn = list(range(250, 290))
            await drain(engine.generate(turn, INNOCENT, request_id="t1", tenant="victim", session_id="chat"))
            closed = await engine.close_session("chat", tenant="attacker")
            rng = random.Random(2)
            for i in range(40):  # the same id, then many: each its own session, all the attacker's
                sid = "chat" if i == 0 else f"flood-{i}"
                prompt = [rng.randrange(3, 300) for _ in range(40)]
                await drain(engine.generate(prompt, INNOCENT, request_id=f"a{i}", tenant="attacker", session_id=sid))
            before = engine.stats()["sessions_open"]
            rid = "t2"
            stream = engine.generate(turn + [1], INNOCENT, request_id=rid, tenant="victim")
            cached = (await stream.__anext__()).cached_tokens
            await drain(stream)
            return cached, before, closed, len(turn) + INNOCENT.max_tokens - 1
        finally:
            await engine.shutdown()

    cached, sessions_open, closed, _ = asyncio.run(scenario())
    assert not closed
    assert sessions_open >= 2
    assert cached == 40  # its whole turn is still there, above the attacker's sessions and filler
