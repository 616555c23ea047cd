"""Async plumbing between the engine's delta streams and a response: first items, merging,
closing, and giving up when the client leaves."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import anyio
from starlette.requests import Request

from radixserve import StreamDelta
from radixserve.engine.async_engine import REFUSED_BATCH

_T = TypeVar("_T")
_END = object()
INBOX_ITEMS_PER_STREAM = 4  # deltas a batch's merged stream holds per request before pumps wait


async def first_of_each(streams: list[AsyncIterator[_T]]) -> list[_T | BaseException | None]:
    """The first item of every stream, awaited together (so a batch's requests are all queued
    before any of them has to produce a token); a stream's exception takes its item's place.
    Once one has failed (a refusal: bad input, a full queue), the others are given up at once
    and their places are None: the caller answers the error without their first tokens, and
    their requests leave the queue (they were queued and prefilled for nobody)."""
    tasks = [asyncio.ensure_future(anext(stream)) for stream in streams]
    try:
        _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # the caller was cancelled (its client left): so are the waits
        for task in tasks:
            task.cancel()
        raise
    for task in pending:
        task.cancel(REFUSED_BATCH)  # aborted as refused: counted apart, their prompts not as served
    if pending:
        await asyncio.wait(pending)
    return [_outcome(task) for task in tasks]


def _outcome(task: asyncio.Future[_T]) -> _T | BaseException | None:
    if task.cancelled():
        return None
    return task.exception() or task.result()


async def prepend(first: _T, rest: AsyncIterator[_T]) -> AsyncIterator[_T]:
    """`first`, then the items of `rest`; closing it closes `rest` (an engine stream: its
    request is aborted then, not whenever the garbage collector finalizes it)."""
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await close(rest)


async def close(stream: AsyncIterator[object]) -> None:
    """Closes an async generator even while the caller is being cancelled (closing an engine
    stream aborts its request and frees its pages, which must not be skipped)."""
    with anyio.CancelScope(shield=True):
        await stream.aclose()  # type: ignore[attr-defined]


async def merge_batch(streams: list[AsyncIterator[StreamDelta]], n: int) -> AsyncIterator[StreamDelta]:
    """The deltas of a batch's requests as they come, choice `j` of prompt `i` renumbered
    `i * n + j` (OpenAI's indices for a batch). Closing the merged stream closes every one.

    The inbox is bounded, so a reader that stops reading stops the pumps too, and each
    request's own output buffer then fills and pauses it (backpressure, output_buffer.py)."""
    if len(streams) == 1:
        try:
            async for delta in streams[0]:
                yield delta
        finally:
            await close(streams[0])
        return
    inbox: asyncio.Queue[tuple[int, object]] = asyncio.Queue(maxsize=INBOX_ITEMS_PER_STREAM * len(streams))

    async def pump(position: int, stream: AsyncIterator[StreamDelta]) -> None:
        try:
            async for delta in stream:
                await inbox.put((position, delta))
        except Exception as exc:  # handed to the consumer, which raises it
            await inbox.put((position, exc))
            return
        await inbox.put((position, _END))

    pumps = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(pumps)
        while remaining:
            position, item = await inbox.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                assert isinstance(item, StreamDelta)
                yield dataclasses.replace(item, index=position * n + item.index)
    finally:
        with anyio.CancelScope(shield=True):
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]


class ClientLeft(Exception):
    """The client disconnected while its request waited (`while_connected`): answered with
    a 499, which nobody reads."""


async def while_connected(request: Request, work: Awaitable[_T]) -> _T:
    """`unless_disconnected` for work that never returns None: ClientLeft if the client
    leaves first (a wait for a fair slot, then the work, for nobody, ends then)."""
    result = await unless_disconnected(request, work)
    if result is None:
        raise ClientLeft
    return result


async def unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """Awaits `work` unless the client disconnects first (then cancels it, returns None).

    Starlette notices a disconnect only while streaming; this covers the time before the first
    token and non-streaming requests, so a client that leaves never keeps the engine busy.
    """
    result: list[_T] = []
    error: Exception | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result.append(await work)
        except Exception as exc:  # re-raised below, not wrapped in the group's ExceptionGroup
            error = exc
        group.cancel_scope.cancel()
    if error is not None:
        raise error
    return result[0] if result else None
