"""One OpenMP team per process: a thread's workers are released, and AsyncEngine.start does it.

A second team (the thread that loaded the model beside the engine thread) makes libgomp put
every waiting worker to sleep between parallel regions (native/openmp.py). These tests watch
the worker threads themselves (/proc/self/task), not timings.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from radixserve import AsyncEngine, Engine, SamplingParams
from radixserve.native.openmp import release_thread_workers

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or "OpenMP" not in torch.__config__.parallel_info(),
    reason="needs Linux and torch's OpenMP (libgomp) parallel backend")

WORKERS_GONE_WITHIN_S = 30.0  # a bound on waiting for threads to exit, not a speed target


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _parallel_region() -> None:
    """A torch op large enough for at::parallel_for to run a two-thread team on this thread."""
    torch.set_num_threads(2)
    (torch.arange(1 << 22, dtype=torch.float32) * 2.0).sum()


def _new_team() -> set[int]:
    """A fresh team on this thread, released once first so that its worker threads are the only
    new threads (torch starts a helper thread of its own at a thread's first parallel op)."""
    _parallel_region()
    assert release_thread_workers()
    before = _threads()
    _parallel_region()
    workers = _threads() - before
    assert workers, "a two-thread region started no worker thread"
    return workers


def _gone(tids: set[int]) -> bool:
    deadline = time.monotonic() + WORKERS_GONE_WITHIN_S
    while tids & _threads():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _on_a_fresh_thread(body: Callable[[], None]) -> None:
    """Runs `body` on a thread that has never run a parallel region (so its team is new)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as error:  # handed to the test's thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def test_releasing_ends_this_threads_team_and_a_later_region_starts_a_new_one() -> None:
    threads_before = torch.get_num_threads()

    def body() -> None:
        workers = _new_team()
        assert release_thread_workers()
        assert _gone(workers), "the released team's workers are still running"
        assert _new_team()  # a region after the release starts a new team
        assert release_thread_workers()

    try:
        _on_a_fresh_thread(body)
    finally:
        torch.set_num_threads(threads_before)


def test_async_engine_start_releases_the_workers_of_the_thread_that_built_the_engine(
        tiny_llama_dir: Path) -> None:
    threads_before = torch.get_num_threads()
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def body() -> None:
        engine = Engine(model=str(tiny_llama_dir), page_size=4, num_pages=64)
        expected = engine.generate([list(range(10, 30))], params)[0].token_ids
        workers = _new_team()  # this thread's team, as a model load leaves it

        async def serve() -> list[int]:
            async_engine = AsyncEngine(engine)
            await async_engine.start()
            try:
                assert _gone(workers), "AsyncEngine.start left the building thread's team running"
                tokens: list[int] = []
                async for delta in async_engine.generate(list(range(10, 30)), params, request_id="a"):
                    tokens += delta.token_ids
                return tokens
            finally:
                await async_engine.shutdown()

        assert asyncio.run(serve()) == expected

    try:
        _on_a_fresh_thread(body)
    finally:
        torch.set_num_threads(threads_before)
