"""What a cluster's stop waits for, and what it refuses meanwhile: the ingress's POSTs.

The single server's stop closes its listening socket before the grace, so a request that
arrives during the grace finds no server and goes elsewhere at once. Serve's proxy keeps
taking requests until the app is deleted: without this gate, one that arrived during the
grace was started, then ended with the rest (a 503 after up to 4 s of work thrown away),
and a steady arrival kept the drain waiting for the whole grace.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.server.errors import APIError, error_response


@dataclass
class DrainGate:
    """The POST requests in flight, and whether new ones are still admitted (`closed`: a
    stop's drain began)."""

    in_flight: int = 0
    closed: bool = False


def shutting_down() -> APIError:
    """The 503 of a request that arrived after the stop began (not started: safe to retry)."""
    return APIError(503, "The server is shutting down and takes no new requests; retry on another "
                         "server or once this one is back.", code="server_shutting_down",
                    error_type="server_error", headers={"Retry-After": "1"})


class PostsInFlight:
    """ASGI middleware: counts the POST requests in flight (the generation routes and the
    short admin ones; not the GET streams of cache events, which never end on their own), each
    from its arrival to its response's end, streamed or not: what a stop's drain waits for.
    Once the gate is closed, a new POST is answered 503 `server_shutting_down` unread."""

    def __init__(self, app: ASGIApp, gate: DrainGate) -> None:
        self.app = app
        self.gate = gate  # shared with the ingress, which closes it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        if self.gate.closed:
            await error_response(shutting_down())(scope, receive, send)
            return
        self.gate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.gate.in_flight -= 1
