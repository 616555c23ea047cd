"""Caps on open connections, per client address and in all, that uvicorn lacks.

Every open connection holds a file descriptor, and the process has a fixed number of them
(`ulimit -n`). One client that opens thousands of sockets (and re-opens them as the head
deadline closes them) takes them all: new connections fail to be accepted (asyncio then stops
accepting for a second at a time) and every other client's new connection is reset. Measured
on the demo model with `ulimit -n 4096`: one address holding 5,000 connections got all 20 of
an innocent client's chat requests reset; with the caps all 20 were served.

`with_connection_limits(base, limits)` subclasses uvicorn's HTTP protocol so that a connection
opened while its address already holds `per_address` connections, or while the server holds
`total`, is answered at once with a 429 (the address's cap) or a 503 (the server's), in
OpenAI's error shape with `Retry-After`, and closed; it never reaches the app. Addresses are
IPv4 addresses and global IPv6 addresses' /64 prefixes (see `address_key`); clients behind one
NAT, or sharing one /64, share a cap.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import resource
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field

import msgspec

from radixserve.server.protocol import ErrorBody, ErrorResponse

logger = logging.getLogger("radixserve.server")

# How long a refused connection may take to read its answer and close its end: its bytes
# are discarded meanwhile, so that the close is not a reset that loses the answer. At most
# MAX_LINGERING refused connections wait so (each holds a descriptor); past them a refused
# connection is closed at once, which may reset it (a client opening them by the hundred).
REFUSED_LINGER_S = 1.0
MAX_LINGERING = 64
# Descriptors kept for the process itself (model files, the engine's pipes, logs) when the
# total cap is derived from the descriptor limit.
RESERVED_FDS = 256
DEFAULT_PER_ADDRESS = 1024
MAX_RAISED_FDS = 1 << 20  # the soft limit raised to, where the hard limit is unlimited


def address_key(peername: object) -> str | None:
    """The address a connection counts against: an IPv4 address, a global IPv6 address's /64
    (one host is often given a whole /64), any other IPv6 address whole with its scope (an
    IPv4-mapped one as its IPv4 address), or None (a Unix socket)."""
    if not isinstance(peername, tuple) or not peername:
        return None
    try:
        address = ipaddress.ip_address(str(peername[0]).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        if address.is_global:
            return str(ipaddress.IPv6Network((address, 64), strict=False))
        # Link-local, unique-local, loopback: one network's hosts, which share a /64 (every
        # link-local address is in fe80::/64); each address counts alone, with its scope.
        return str(peername[0])
    return str(address)


def raise_descriptor_limit() -> int:
    """Raises the process's soft descriptor limit to its hard limit (many systems start a
    process at 1,024, which a few hundred idle clients exhaust); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_RAISED_FDS if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a kernel or container that refuses: keep what we were given
            pass
    return soft


def connection_limits(per_address: int | None, total: int | None) -> ConnectionLimits | None:
    """The caps of `radixserve serve`'s flags, or None when both are off (0). `total` None:
    the descriptor limit less `RESERVED_FDS` (a quarter of it, if more); `per_address` None:
    `DEFAULT_PER_ADDRESS`, or a quarter of the total where that is less (so that one address
    cannot take them all)."""
    if total is None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        total = 0 if soft == resource.RLIM_INFINITY else max(soft - RESERVED_FDS, soft // 4)
    if per_address is None:
        per_address = min(DEFAULT_PER_ADDRESS, max(total // 4, 1)) if total else DEFAULT_PER_ADDRESS
    return ConnectionLimits(per_address, total) if per_address or total else None


@dataclass
class ConnectionLimits:
    """The caps (0: none) and the counts of open connections they are checked against."""

    per_address: int
    total: int
    open_by_address: Counter[str] = field(default_factory=Counter)
    open_total: int = 0
    refused: Counter[int] = field(default_factory=Counter)  # connections refused since start, by status
    lingering: int = 0  # refused connections waiting for their client to close
    _refusals: dict[int, bytes] = field(default_factory=dict, repr=False, compare=False)

    def admit(self, key: str | None) -> int | None:
        """Counts a new connection from `key` in, or returns the status that refuses it."""
        if self.per_address and key is not None and self.open_by_address[key] >= self.per_address:
            return 429
        if self.total and self.open_total >= self.total:
            return 503
        self.open_total += 1
        if key is not None:
            self.open_by_address[key] += 1
        return None

    def release(self, key: str | None) -> None:
        """Counts a closed connection (one `admit` let in) out."""
        self.open_total -= 1
        if key is not None:
            self.open_by_address[key] -= 1
            if not self.open_by_address[key]:
                del self.open_by_address[key]

    def first_refusal_note(self, key: str | None, status: int) -> str:
        """What the operator is told at the first refusal of each kind: a proxy in front is
        one address, and its clients' connections are refused at the cap."""
        if status == 429:
            return (f"a connection from {key} refused (429): the address holds {self.per_address:,} open "
                    "connections; if it is a proxy, give --max-connections-per-client 0 and cap clients there")
        return f"a connection from {key} refused (503): the server holds {self.total:,} open connections"

    def refusal(self, status: int) -> bytes:
        """The whole HTTP response that refuses a connection with `status` (built once: a
        flood asks for it thousands of times a second)."""
        if status not in self._refusals:
            self._refusals[status] = self._build_refusal(status)
        return self._refusals[status]

    def _build_refusal(self, status: int) -> bytes:
        if status == 429:
            message = (f"too many open connections from this address (at most {self.per_address:,}); "
                       "reuse connections or retry later")
            return closing_error_response(429, "Too Many Requests", message, "rate_limit_error",
                                          "too_many_connections", retry_after_s=1)
        message = f"the server holds as many open connections as it may ({self.total:,}); retry later"
        return closing_error_response(503, "Service Unavailable", message, "server_overloaded",
                                      "too_many_connections", retry_after_s=1)


def closing_error_response(status: int, reason: str, message: str, error_type: str, code: str,
                           retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape that closes its connection, as bytes
    to write to a transport below the app (a refused connection, a head over its bounds)."""
    payload = msgspec.json.encode(ErrorResponse(error=ErrorBody(message=message, type=error_type, param=None,
                                                                code=code)))
    retry = f"retry-after: {retry_after_s}\r\n" if retry_after_s is not None else ""
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"{retry}content-length: {len(payload)}\r\n\r\n")
    return head.encode("ascii") + payload


def with_connection_limits(base: type[asyncio.Protocol], limits: ConnectionLimits) -> type[asyncio.Protocol]:
    """`base` (uvicorn's HTTP protocol, deadlines included) refusing connections over `limits`."""

    class Limited(base):  # type: ignore[valid-type, misc]
        """uvicorn's protocol, answering a connection over the caps with 429/503 and closing it."""

        _key: str | None = None
        _counted = False
        _refused: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._key = address_key(transport.get_extra_info("peername"))
            status = limits.admit(self._key)
            if status is None:
                self._counted = True
                super().connection_made(transport)
                return
            # Refused before uvicorn sees it: no request state, no deadline, no app.
            if not limits.refused[status]:  # once a cap, so that a flood does not flood the log too
                logger.warning("%s (logged once)", limits.first_refusal_note(self._key, status))
            limits.refused[status] += 1
            transport.write(limits.refusal(status))
            if limits.lingering >= MAX_LINGERING or not transport.can_write_eof():
                transport.close()
                return
            limits.lingering += 1
            self._refused = transport
            transport.write_eof()
            asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self._drop_refused)

        def _drop_refused(self) -> None:
            transport = self._refused
            if transport is None:
                return
            sock = transport.get_extra_info("socket")
            if sock is not None:  # a reset: nothing of it lingers in the kernel either
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()

        def data_received(self, data: bytes) -> None:
            if self._counted:
                super().data_received(data)

        def eof_received(self) -> bool | None:
            if self._counted:
                return super().eof_received()
            if self._refused is not None:
                self._refused.close()  # the client read its answer and closed its end
            return None

        def handle_websocket_upgrade(self, *args: object) -> None:
            # uvicorn hands the transport to its WebSocket protocol, and this one hears no
            # more of it (no connection_lost): the connection leaves the count here, as it
            # leaves uvicorn's own set of connections. (`radixserve serve` serves no
            # WebSockets: uvicorn_options turns them off, and an upgrade is a plain request.)
            if self._counted:
                self._counted = False
                limits.release(self._key)
            super().handle_websocket_upgrade(*args)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused is not None:
                self._refused = None
                limits.lingering -= 1
            if self._counted:
                self._counted = False
                limits.release(self._key)
                super().connection_lost(exc)

    Limited.__name__ = Limited.__qualname__ = f"Limited{base.__name__}"
    return Limited
