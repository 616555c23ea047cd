"""Pacing for client addresses whose requests keep being refused (answered 4xx).

A refused request does no work in the engine, but reaching the refusal does: reading the
head and body, rendering the chat template, finding a spec among the refused grammars,
writing the answer and its log line. On 2 cores that is about 5 ms of the event loop and a
worker thread, and the engine thread waits for the interpreter lock meanwhile: one address
looping a regex that does not compile (277 refusals a second over 32 connections, its own
client on the same cores) cut another address's 32-token chats from 29 to 4-8 in 20 s.

`RefusalPacer` keeps a debt per address: each refusal adds one, and the debt drains at
`rate` a second. While an address's debt is over `burst`, the next bytes of each of its
connections are held, reading paused (the kernel keeps them; nothing runs for it), until the
debt is back under `burst`: the address gets its answers, `rate` refusals a second once its
burst is spent. A client refused now and then (a typo, an expired key, a prompt too long)
never comes near the burst; an overloaded server's 503s are not the client's doing and do
not count. Addresses are
connection_limits' `address_key` (IPv4, a global IPv6 /64) of the connection's peer: the
app charges the ASGI scope's client and the protocol holds the peer, which agree because
`uvicorn_options` turns uvicorn's forwarded headers off. Behind a proxy every client is one
address, so `--refusals-per-s 0` turns pacing off there, as the connection caps are.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from radixserve.server.connection_limits import address_key, closing_error_response

DEFAULT_REFUSALS_PER_S = 10.0
BURST_S = 5.0  # the burst an address may spend at once: this many seconds of its rate
MAX_HOLD_S = 8.0  # the longest a request is held; then a 429 with Retry-After
HEAD_DEADLINE_MARGIN_S = 0.05  # a hold ends this long before the head deadline would close it
# Addresses remembered with a debt; past this many (an attacker can vary its addresses) the
# ones whose debts have drained are forgotten, then the least indebted.
MAX_ADDRESSES = 4096


class RefusalPacer:
    """Each address's debt of refused requests (see the module docstring). The app's
    RequestGuard calls `refused` for every 4xx it answers; the HTTP protocol
    (`with_refusal_pacing`) asks `wait_s` before it hands a connection's bytes on."""

    def __init__(self, rate: float = DEFAULT_REFUSALS_PER_S, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        burst = max(1.0, BURST_S * rate) if burst is None else burst
        if rate <= 0 or burst < 1:
            raise ValueError(f"refusal pacing needs a rate > 0 and a burst >= 1, got {rate} and {burst}")
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.held = 0  # requests held since start (a metric)
        self.refused_holds = 0  # holds that ended in a 429 (a metric)
        self._debts: dict[str, tuple[float, float]] = {}  # address -> (debt, when it was that)

    def refused(self, address: str | None) -> None:
        """One more request from `address` was refused (None: a Unix socket, not paced)."""
        if address is None:
            return
        now = self.clock()
        debt = self._debt(address, now) + 1.0
        if address not in self._debts and len(self._debts) >= MAX_ADDRESSES:
            self._forget(now)
        self._debts[address] = (debt, now)

    def wait_s(self, address: str | None) -> float:
        """How long `address`'s next bytes wait: until its debt is back at the burst (0: none)."""
        if address is None or address not in self._debts:
            return 0.0
        over = self._debt(address, self.clock()) - self.burst
        return over / self.rate if over > 0 else 0.0

    def _debt(self, address: str, now: float) -> float:
        debt, then = self._debts.get(address, (0.0, now))
        return max(0.0, debt - (now - then) * self.rate)

    def _forget(self, now: float) -> None:
        """Keeps the most indebted half of the addresses (the ones drained to nothing first)."""
        debts = {address: self._debt(address, now) for address in self._debts}
        kept = sorted((address for address, debt in debts.items() if debt > 0), key=debts.__getitem__)
        self._debts = {address: (debts[address], now) for address in kept[-MAX_ADDRESSES // 2:]}


def with_refusal_pacing(base: type[asyncio.Protocol], pacer: RefusalPacer,
                        max_hold_s: float = MAX_HOLD_S) -> type[asyncio.Protocol]:
    """`base` (uvicorn's HTTP protocol with the deadlines: connections.py) holding the requests
    of connections from addresses `pacer` has in debt: new bytes while no request is under way
    (reading paused), and the start of a next request sent in the same bytes (pipelined:
    uvicorn starts it when a response completes; held per chunk alone, a thousand requests in
    one write were all answered at once). A hold that would last past `max_hold_s`, or past
    the connection's head deadline (which would close it unanswered; the deadline is never
    put off, so pieces of a head sent slowly cannot keep a connection open), ends in a 429
    `too_many_refusals` with Retry-After, and the connection is closed. Held bytes stop
    uvicorn's keep-alive timer, as bytes handed on would (it closed a reused connection's held
    request unanswered after 5 s)."""

    class Paced(base):  # type: ignore[valid-type, misc]
        """uvicorn's protocol, holding a refused address's next request until its debt drains."""

        _address: str | None = None
        _held_bytes: bytearray | None = None
        _held_completion = False  # a response completed; the next pipelined request waits
        _held_since = 0.0
        _release_handle: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._address = address_key(transport.get_extra_info("peername"))
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if self._held_bytes is not None:  # (bytes read before the pause took effect)
                self._held_bytes += data
            elif self._awaiting_head() and (self._release_handle is not None or self._in_debt()):
                self._held_bytes = bytearray(data)  # (mid-request, a body's bytes are never held)
                self.transport.pause_reading()
                self._unset_keepalive_if_required()
                self._hold()
            else:
                super().data_received(data)

        def on_response_complete(self) -> None:
            if self._pipelined() and (self._release_handle is not None or self._in_debt()):
                self._held_completion = True
                self._hold()
            else:
                super().on_response_complete()

        def _pipelined(self) -> bool:
            """Whether a next request, sent already, waits for this response to complete
            (httptools queues it parsed; h11 keeps its bytes)."""
            if getattr(self, "pipeline", None):
                return True
            conn = getattr(self, "conn", None)
            return conn is not None and bool(conn.trailing_data[0])

        def _in_debt(self) -> bool:
            return pacer.wait_s(self._address) > 0

        def _hold(self) -> None:
            if self._release_handle is None:
                pacer.held += 1
                self._held_since = self.loop.time()
                self._release_handle = self.loop.call_later(min(pacer.wait_s(self._address), self._hold_left()),
                                                            self._release)

        def _hold_left(self) -> float:
            """How much longer a hold may last: to `max_hold_s`, and to just before the head
            deadline, if one runs (a 429 then, not a close unanswered)."""
            now = self.loop.time()
            left = max_hold_s - (now - self._held_since)
            deadline = getattr(self, "_head_deadline", None)
            if deadline is not None:
                left = min(left, deadline.when() - now - HEAD_DEADLINE_MARGIN_S)
            return max(0.0, left)

        def _release(self) -> None:
            self._release_handle = None
            if self.transport.is_closing():
                self._held_bytes, self._held_completion = None, False
                return
            wait = pacer.wait_s(self._address)
            left = self._hold_left()
            if wait > 0 and left <= 0:
                self._refuse(wait)
                return
            if wait > 0:  # others of the address went first and spent the burst again
                self._release_handle = self.loop.call_later(min(wait, left), self._release)
                return
            if self._held_completion:  # the earlier request's end first: what was held came after it
                self._held_completion = False
                super().on_response_complete()
            if self._held_bytes is not None:
                data, self._held_bytes = bytes(self._held_bytes), None
                self.transport.resume_reading()
                super().data_received(data)

        def _refuse(self, wait: float) -> None:
            """Ends a hold that lasted `max_hold_s`: a 429 where no request is under way (its
            bytes were held before uvicorn read them), and the connection closed."""
            pacer.refused_holds += 1
            if not self._held_completion:
                self.transport.write(refusal_response(wait))
            self._held_bytes, self._held_completion = None, False
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._release_handle is not None:
                self._release_handle.cancel()
                self._release_handle = None
            self._held_bytes, self._held_completion = None, False
            super().connection_lost(exc)

    Paced.__name__ = Paced.__qualname__ = f"Paced{base.__name__}"
    return Paced


def refusal_response(wait_s: float) -> bytes:
    """The 429 that ends a hold of `max_hold_s`: the whole response, closing its connection."""
    message = ("too many of this address's requests were refused lately (4xx); "
               f"send fewer invalid requests, or retry in {math.ceil(wait_s)} s")
    return closing_error_response(429, "Too Many Requests", message, "rate_limit_error", "too_many_refusals",
                                  retry_after_s=math.ceil(wait_s))
