"""The host check (radixserve/host_names.py says why): an ASGI middleware in front of every route."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.host_names import is_loopback, requested_host
from radixserve.server.errors import APIError, error_response


class HostCheck:
    """ASGI middleware: a request whose Host header names neither a loopback host nor one of
    `names` is answered 400 `host_not_allowed` (OpenAI's error shape) before any route sees
    it. A request without a Host header (HTTP/1.0; no browser sends one) passes."""

    def __init__(self, app: ASGIApp, *, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = next((value for key, value in scope["headers"] if key == b"host"), None)
            if header is not None:
                host = requested_host(header.decode("latin-1"))
                if not (is_loopback(host) or host in self.names):
                    await error_response(_refusal(host))(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _refusal(host: str) -> APIError:
    return APIError(400, f"This server answers for loopback host names and those given with --allowed-hosts, "
                         f"not {host[:100]!r} (a protection against DNS rebinding): start it with "
                         f"--allowed-hosts {host[:100] or '<name>'} to accept that name.",
                    param="Host", code="host_not_allowed")
