"""Connection deadlines uvicorn lacks: a request head must arrive, and what the server writes
must be read, within time limits.

uvicorn closes a keep-alive connection that stays idle after a response, but a connection
that sends part of a request head and then nothing ("slow loris") stays open for as long as
its client likes, holding a socket and a file descriptor each. Nor does it give up on a
client that stops reading: a whole (non-streaming) response is written to the transport at
once, and a client that never reads keeps it in the server's memory for good (a closing
transport still waits to flush it; TCP probes a zero window for ever). `with_deadlines(base)`
subclasses one of uvicorn's HTTP/1.1 protocols so that a connection whose request head is not
complete `head_timeout_s` after it opened (or after its previous response) is closed, and one
whose writes are paused (the transport's buffer over its high-water mark) while the client
reads nothing of it for `write_timeout_s` is aborted, its buffer dropped; a client that
reads, however slowly, keeps its connection. The body has its own deadline
where the app reads it (app.py), answered with a 408.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import h11

from radixserve.server.connection_limits import ConnectionLimits, with_connection_limits
from radixserve.server.head_limits import MAX_HEAD_BYTES, with_head_limits
from radixserve.server.refusal_pacing import RefusalPacer, with_refusal_pacing

DEFAULT_HEAD_TIMEOUT_S = 10.0


def with_deadlines(base: type[asyncio.Protocol], head_timeout_s: float,
                   write_timeout_s: float | None = None) -> type[asyncio.Protocol]:
    """`base` (uvicorn's httptools or h11 protocol) with the request-head deadline and, unless
    `write_timeout_s` is None, the write deadline."""

    class Deadlines(base):  # type: ignore[valid-type, misc]
        """uvicorn's protocol, closing connections whose request head is late and aborting
        those that read nothing of what they are sent."""

        _head_deadline: asyncio.TimerHandle | None = None
        _write_deadline: asyncio.TimerHandle | None = None
        _unread = 0  # the transport's buffer when the write deadline was armed

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_head_deadline()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head_deadline()
            self._disarm_write_deadline()
            super().connection_lost(exc)

        # The transport calls these as its buffer crosses its high-water mark and drains again.
        def pause_writing(self) -> None:
            super().pause_writing()
            if write_timeout_s is not None and self._write_deadline is None:
                self._arm_write_deadline()

        def _arm_write_deadline(self) -> None:
            assert write_timeout_s is not None
            self._unread = self.transport.get_write_buffer_size()
            self._write_deadline = self.loop.call_later(write_timeout_s, self._not_read)

        def resume_writing(self) -> None:
            self._disarm_write_deadline()
            super().resume_writing()

        def _disarm_write_deadline(self) -> None:
            if self._write_deadline is not None:
                self._write_deadline.cancel()
                self._write_deadline = None

        def _not_read(self) -> None:
            self._write_deadline = None
            # Paused, nothing more is written: a smaller buffer means the client read some.
            # A slow reader of a large body stays paused throughout, and is not a gone one.
            if self.transport.get_write_buffer_size() < self._unread:
                self._arm_write_deadline()
                return
            # abort, not close: a close waits to flush the buffer the client does not read. And
            # a zero linger, so that the kernel too drops what it holds (up to its send buffer,
            # megabytes, kept for a minute in FIN-WAIT-1 by a plain close) and resets.
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._awaiting_head():  # the next request's head, on a kept-alive connection
                self._arm_head_deadline()

        def _awaiting_head(self) -> bool:
            """No request is under way or parsed and waiting (pipelined): the connection now
            waits for a head. (A pipelined request already sent its head: no deadline.)"""
            if getattr(self, "pipeline", None):  # httptools: parsed requests waiting their turn
                return False
            cycle = getattr(self, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                return False
            their_state = getattr(getattr(self, "conn", None), "their_state", h11.IDLE)  # h11
            return their_state is h11.IDLE

        # httptools calls this when a head is complete.
        def on_headers_complete(self) -> None:
            self._disarm_head_deadline()
            super().on_headers_complete()

        # h11 has no such callback: a head is complete once the peer's state leaves IDLE.
        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:
                self._disarm_head_deadline()

        def _arm_head_deadline(self) -> None:
            self._disarm_head_deadline()
            if not self.transport.is_closing():
                self._head_deadline = self.loop.call_later(head_timeout_s, self._head_too_late)

        def _disarm_head_deadline(self) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
                self._head_deadline = None

        def _head_too_late(self) -> None:
            self._head_deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    Deadlines.__name__ = Deadlines.__qualname__ = f"Deadlines{base.__name__}"
    return Deadlines


def http_protocol(head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S, write_timeout_s: float | None = None,
                  limits: ConnectionLimits | None = None, pacer: RefusalPacer | None = None) -> type[asyncio.Protocol]:
    """uvicorn's fastest available HTTP/1.1 protocol (httptools, bounded by head_limits.py,
    else h11), with the deadlines and, when given, the pacing of refused addresses and the
    caps on open connections."""
    base: type[asyncio.Protocol]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        base = with_head_limits(HttpToolsProtocol)
    except ImportError:  # h11 bounds a head by itself (uvicorn_options)
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    protocol = with_deadlines(base, head_timeout_s, write_timeout_s)
    if pacer is not None:
        protocol = with_refusal_pacing(protocol, pacer)
    return protocol if limits is None else with_connection_limits(protocol, limits)


def uvicorn_options(head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S, keep_alive_s: float = 5.0,
                    write_timeout_s: float | None = None, limits: ConnectionLimits | None = None,
                    pacer: RefusalPacer | None = None) -> dict[str, Any]:
    """uvicorn.Config keyword arguments for the connection deadlines, caps, the pacing of
    refused addresses (given the app's pacer) and the bound on a request head (head_limits.py;
    h11's own bound set to the same). WebSockets are off: the API has none, and an upgraded
    connection would leave the deadlines and caps. Forwarded headers are not read: a client
    is its connection's address (behind a proxy, the proxy)."""
    return {"http": http_protocol(head_timeout_s, write_timeout_s, limits, pacer), "timeout_keep_alive": keep_alive_s,
            "ws": "none", "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
            # A client's address is its connection's: uvicorn otherwise takes X-Forwarded-For
            # from 127.0.0.1 as the client, and a local process could then name any address
            # (another's fair share, its refusals charged to an innocent address).
            "proxy_headers": False}
