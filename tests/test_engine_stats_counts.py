"""What the engine's request counters count: prompt (and cached) tokens of admitted requests only;
a request given up before it ran adds none, and one given up because another prompt of its batch
was refused counts as refused, not as aborted."""

from __future__ import annotations

import asyncio
from pathlib import Path

from server_util import wait_for_async

from radixserve import AsyncEngine, Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
A = list(range(10, 50))  # 40 tokens
B = list(range(60, 90))  # 30 tokens


def make_engine(ckpt: Path) -> Engine:
    return Engine(model=str(ckpt), page_size=4, num_pages=64, max_running=1, debug_checks=True)


def counts(engine: Engine) -> tuple[int, int, int, int, int]:
    s = engine.stats()
    return (s["prompt_tokens"], s["cached_tokens"], s["requests_finished"], s["requests_aborted"],
            s.get("requests_refused"))


def finish(engine: Engine) -> None:
    while engine.has_work():
        engine.step()


def test_a_request_given_up_before_it_was_admitted_adds_no_prompt_tokens(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    engine.add_request(A, GREEDY, request_id="a")
    engine.add_request(B, GREEDY, request_id="waits")  # max_running 1: it waits behind a
    engine.step()
    assert engine.stats()["waiting"] == 1
    engine.abort("waits")  # its client left: aborted, but nothing of it ran
    finish(engine)
    assert counts(engine) == (40, 0, 1, 1, 0)
    engine.add_request(A, GREEDY, request_id="again")  # a hit: the hit rate is over what ran
    finish(engine)
    stats = engine.stats()
    assert counts(engine) == (80, 39, 2, 1, 0) and stats["hit_rate"] == 39 / 80  # (its last token runs)


def test_a_request_refused_with_its_batch_counts_apart_whether_or_not_it_ran(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    engine.add_request(A, GREEDY, request_id="running")
    engine.add_request(B, GREEDY, request_id="waiting")
    engine.step()
    engine.abort("waiting", refused=True)
    engine.abort("running", refused=True)  # admitted and prefilled, then given up with its batch
    assert counts(engine) == (0, 0, 0, 0, 2)
    engine.add_request(B, GREEDY, request_id="admitted")
    engine.step()
    engine.abort("admitted")  # admitted, then its client left: aborted, its prompt counted
    assert counts(engine) == (30, 0, 0, 1, 2)
    assert not engine.has_work() and engine.stats()["pages_locked"] == 0


def test_an_async_stream_cancelled_as_refused_is_counted_refused(tiny_llama_dir: Path) -> None:
    from radixserve.engine.async_engine import REFUSED_BATCH

    engine = make_engine(tiny_llama_dir)

    async def scenario() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.pause()  # no steps: every stream waits for its first delta
        await async_engine.start()
        try:
            early = asyncio.ensure_future(anext(async_engine.generate(A, GREEDY, request_id="early")))
            await asyncio.sleep(0)
            early.cancel(REFUSED_BATCH)  # while its add is queued
            queued = asyncio.ensure_future(anext(async_engine.generate(B, GREEDY, request_id="queued")))
            left = asyncio.ensure_future(anext(async_engine.generate(A + B, GREEDY, request_id="left")))
            assert await wait_for_async(lambda: async_engine.stats()["waiting"] == 2)
            queued.cancel(REFUSED_BATCH)  # while it waits for its first delta
            left.cancel()  # a client that left
            await asyncio.gather(early, queued, left, return_exceptions=True)
            assert await wait_for_async(lambda: async_engine.stats()["waiting"] == 0)
        finally:
            await async_engine.shutdown()

    asyncio.run(scenario())
    assert counts(engine) == (0, 0, 0, 1, 2)

