"""AsyncEngine: streamed deltas add up to the offline result; a closed stream frees its pages."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from radixserve import AsyncEngine, Engine, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tiny_llama_dir: Path) -> Path:
    return tiny_llama_dir


def test_stream_matches_generate_and_early_close_aborts(ckpt: Path) -> None:
    prompt = list(range(30, 70))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    expected = Engine(model=str(ckpt), page_size=4, num_pages=128).generate([prompt], params)[0]

    async def scenario() -> None:
        engine = AsyncEngine(Engine(model=str(ckpt), page_size=4, num_pages=128, debug_checks=True))
        await engine.start()
        try:
            tokens: list[int] = []
            text = ""
            async for delta in engine.generate(prompt, params, request_id="a"):
                tokens += delta.token_ids
                text += delta.text
                last = delta
            assert tokens == expected.token_ids and text == expected.text
            assert last.finish_reason == "length" and last.prompt_tokens == len(prompt)

            stream = engine.generate(prompt + [5], SamplingParams(max_tokens=400, temperature=0.0,
                                                                  ignore_eos=True), request_id="b")
            first = await stream.__anext__()
            assert first.cached_tokens == len(prompt)
            await stream.aclose()  # the client went away
            for _ in range(100):
                await asyncio.sleep(0.02)
                stats = engine.stats()
                if stats["running"] == 0 and stats["pages_locked"] == 0:
                    break
            assert stats["running"] == 0 and stats["pages_locked"] == 0 and stats["requests_aborted"] == 1
            assert await engine.flush_cache() > 0
            assert engine.stats()["pages_free"] == 128
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_cancel_before_first_delta_duplicate_ids_and_shutdown_end_every_stream(ckpt: Path) -> None:
    long = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def scenario() -> None:
        engine = AsyncEngine(Engine(model=str(ckpt), page_size=4, num_pages=128, debug_checks=True))
        await engine.start()
        # A client that leaves while its request is still being queued: the request is aborted.
        waiter = asyncio.ensure_future(engine.generate(list(range(10, 30)), long, request_id="gone").__anext__())
        await asyncio.sleep(0)
        waiter.cancel()
        # A duplicate id is refused and does not disturb the first stream.
        first = engine.generate(list(range(40, 60)), long, request_id="dup")
        await first.__anext__()
        with pytest.raises(ValueError, match="request_id"):
            await engine.generate([5, 6], long, request_id="dup").__anext__()
        # n > 1 before its fork, and a plain stream: shutdown ends both with "abort".
        many = engine.generate(list(range(70, 90)), SamplingParams(max_tokens=300, n=3, ignore_eos=True),
                               request_id="many")
        many_task = asyncio.ensure_future(_collect(many))
        await asyncio.sleep(0.05)
        await engine.shutdown()
        rest = await asyncio.wait_for(_collect(first), timeout=5)
        assert rest[-1].finish_reason == "abort"
        finals = [d for d in await asyncio.wait_for(many_task, timeout=5) if d.finish_reason]
        assert sorted(d.index for d in finals) == [0, 1, 2]
        stats = engine.engine.stats()
        assert stats["running"] == 0 and stats["pages_locked"] == 0
        assert stats["requests_aborted"] == 3  # gone, dup, many

    asyncio.run(scenario())


async def _collect(stream) -> list:
    return [delta async for delta in stream]


def test_watchdog_sees_a_stuck_step_and_shutdown_does_not_wait_for_it(ckpt: Path) -> None:
    entered, release = threading.Event(), threading.Event()

    def stuck_step() -> None:  # holds the engine thread inside its first step
        entered.set()
        release.wait()

    async def scenario() -> None:
        engine = AsyncEngine(Engine(model=str(ckpt), page_size=4, num_pages=64, debug_checks=True),
                             stall_timeout_s=0.2, step_hook=stuck_step)
        assert engine.health() == "the engine thread is not running"
        await engine.start()
        assert engine.health() is None and engine.stats()["stalled"] == 0
        stream = engine.generate(list(range(10, 30)), SamplingParams(max_tokens=5, temperature=0.0),
                                 request_id="held")
        first = asyncio.ensure_future(stream.__anext__())
        assert await asyncio.to_thread(entered.wait, 30)
        for _ in range(600):
            if engine.health() is not None:
                break
            await asyncio.sleep(0.05)
        assert "has not completed a step" in engine.health() and "bound: 0.2 s" in engine.health()
        stats = engine.stats()
        assert stats["stalled"] == 1 and stats["seconds_since_last_step"] > 0.2
        assert await engine.shutdown(timeout_s=0.1) is False  # the stuck thread is left behind
        release.set()  # the step completes; the thread sees the stop, aborts what is left, ends
        deltas = [await first] + await asyncio.wait_for(_collect(stream), timeout=30)
        assert deltas[-1].finish_reason == "abort"
        assert await engine.shutdown() is True
        assert engine.health() == "the engine thread is not running"
        stats = engine.engine.stats()
        assert stats["running"] == 0 and stats["pages_locked"] == 0

    try:
        asyncio.run(scenario())
    finally:
        release.set()


def test_pause_keeps_taking_commands_but_runs_no_step(ckpt: Path) -> None:
    async def scenario() -> None:
        engine = AsyncEngine(Engine(model=str(ckpt), page_size=4, num_pages=64), stall_timeout_s=0.2)
        await engine.start()
        try:
            engine.pause()
            stream = engine.generate(list(range(10, 30)), SamplingParams(max_tokens=3, temperature=0.0),
                                     request_id="paused")
            first = asyncio.ensure_future(stream.__anext__())
            for _ in range(600):
                if engine.stats()["waiting"] == 1 and engine.health() is not None:
                    break
                await asyncio.sleep(0.05)
            assert "has not completed a step" in engine.health()
            # A command round-trips through the engine thread: had it stepped, it would have
            # done so before taking the command.
            await engine.flush_cache()
            assert engine.stats()["waiting"] == 1 and engine.stats()["steps"] == 0
            assert not first.done()
            engine.resume()
            deltas = [await first] + await asyncio.wait_for(_collect(stream), timeout=30)
            assert sum(len(d.token_ids) for d in deltas) == 3 and deltas[-1].finish_reason == "length"
            for _ in range(100):
                if engine.health() is None:
                    break
                await asyncio.sleep(0.05)
            assert engine.health() is None
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_stats_follow_every_step_that_moves_the_load(ckpt: Path) -> None:
    """Stats are rebuilt after a step only when it ends a stream or moves the engine's load
    (waiting, running, free pages), else every 50 ms: a request's first token must never come
    with stats that still show it waiting (read right away, no polling)."""

    async def scenario() -> None:
        engine = AsyncEngine(Engine(model=str(ckpt), page_size=4, num_pages=128, debug_checks=True))
        await engine.start()
        try:
            for round_ in range(5):  # each after the last finished: one stream at a time
                stream = engine.generate(list(range(30, 40 + round_)), SamplingParams(
                    max_tokens=60, temperature=0.0, ignore_eos=True), request_id=f"r{round_}")
                await stream.__anext__()
                stats = engine.stats()
                assert (stats["waiting"], stats["running"]) == (0, 1), round_
                async for delta in stream:
                    last = delta
                assert last.finish_reason == "length"
                stats = engine.stats()  # the finishing step published, whatever the time
                assert (stats["running"], stats["pages_locked"]) == (0, 0), round_
        finally:
            await engine.shutdown()

    asyncio.run(scenario())


def test_a_closed_output_buffer_takes_no_late_delivery() -> None:
    """A step's deltas already on their way to the loop when the reader left land after
    `close`: they must not pause the request or arm a read timeout for nobody (a review saw
    streams_paused stay at 1 for good and a false read timeout 2 s later)."""
    from radixserve.engine.output_buffer import OutputBuffer
    from radixserve.engine.params import StreamDelta

    async def run() -> list[str]:
        calls: list[str] = []
        buffer = OutputBuffer(asyncio.get_running_loop(), limit=4, read_timeout_s=0.01,
                              pause=lambda: calls.append("pause"), resume=lambda: calls.append("resume"),
                              on_timeout=lambda: calls.append("timeout"))
        buffer.close()
        buffer.put([StreamDelta(0, list(range(8)), "x", None, None, 1, 0)])
        await asyncio.sleep(0.05)
        assert buffer.queue.empty() and buffer.buffered == 0 and not buffer.paused
        return calls

    assert asyncio.run(run()) == []
