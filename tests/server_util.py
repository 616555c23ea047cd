"""Test helpers: a real uvicorn server on a free port in a thread, and an SSE parser."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette

STARTUP_TIMEOUT_S = 60.0


@contextmanager
def running_server(app: Starlette, *, log_level: str = "warning", send_buffer: int | None = None,
                   **uvicorn_options: Any) -> Iterator[str]:
    """Serves `app` with uvicorn on 127.0.0.1:<free port> in a thread; yields the base URL.

    The app's lifespan (engine start/stop) runs as in production; leaving the block shuts the
    server down and waits for it. `log_level` "info" turns uvicorn's access log on;
    `uvicorn_options` go to uvicorn.Config (the CLI's connection deadlines, say).
    `send_buffer` sets the kernel send buffer (SO_SNDBUF) of every connection, so that a client
    that does not read pushes back on the server after little output.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:  # accepted connections inherit it from the listening socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="on", log_level=log_level, timeout_graceful_shutdown=5, **uvicorn_options)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"uvicorn-{port}")
    thread.start()
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Polls `predicate` until it holds (True) or `timeout` seconds pass (its last value).

    For state that a server reaches on its own (stats published after a step): it waits,
    it never races a deadline that the test could miss on a loaded machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


async def wait_for_async(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """`wait_for` inside an event loop (an AsyncEngine's, whose thread publishes the stats):
    yields to the loop between polls."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def parse_sse(raw: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing strictly.

    Every event must be exactly one `data: ` line followed by a blank line; nothing else may
    appear. Returns the payload strings in order (the last one should be "[DONE]").
    """
    assert raw.endswith("\n\n"), f"stream does not end with a blank line: {raw[-40:]!r}"
    events = raw[:-2].split("\n\n")
    payloads = []
    for event in events:
        assert "\n" not in event, f"event spans several lines: {event!r}"
        assert event.startswith("data: "), f"event without 'data: ' prefix: {event!r}"
        payloads.append(event[len("data: "):])
    return payloads


def sse_chunks(raw: str) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body that ends with `data: [DONE]` (checked)."""
    payloads = parse_sse(raw)
    assert payloads[-1] == "[DONE]", f"last event is not [DONE]: {payloads[-1]!r}"
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]
