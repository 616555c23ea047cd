"""The host check (radixserve/host_names.py says why): an ASGI middleware in front of every route."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.host_names import is_loopback, requested_host
from radixserve.server.errors import APIError, error_response


class HostCheck:
    """ASGI middleware: a request whose Host header names neither a loopback host nor one of
    `names` (or that carries two Host headers, or one that is no host[:port]) is answered 400
    `host_not_allowed` (OpenAI's error shape) before anything else sees it: it is not the
    server's to count, nor its client's to be paced for (refusal_pacing.py: every local
    client shares 127.0.0.1 with the attacker's page). A request without a Host header
    (HTTP/1.0; no browser sends one) passes."""

    def __init__(self, app: ASGIApp, *, names: frozenset[str]) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = [value for key, value in scope["headers"] if key == b"host"]
            if len(headers) > 1:  # which one a proxy in front read is anyone's guess
                await error_response(_refusal(None))(scope, receive, send)
                return
            if headers:
                host = requested_host(headers[0].decode("latin-1"))
                if not (is_loopback(host) or host in self.names):
                    await error_response(_refusal(host))(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _refusal(host: str | None) -> APIError:
    if host is None:
        return APIError(400, "The request must carry one Host header naming a host (host[:port]).",
                        param="Host", code="host_not_allowed")
    return APIError(400, f"This server answers for loopback host names and those given with --allowed-hosts, "
                         f"not {host[:100]!r} (a protection against DNS rebinding): start it with "
                         f"--allowed-hosts {host[:100] or '<name>'} to accept that name.",
                    param="Host", code="host_not_allowed")
