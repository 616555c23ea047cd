"""What a browser may make a server do: the host check (radixserve/host_names.py says why), and
a key-less server's POSTs refused to pages of other origins. Both are ASGI middlewares in front
of every route."""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.datastructures import Headers
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


class SameOriginPosts:
    """ASGI middleware of a server without keys: a POST that a browser sent from a page of
    another origin is answered 403 `cross_origin`. Any web page the operator visits may
    send such a request (a form, a no-cors fetch: no preflight, and the server parses the
    body whatever its type), and would so make the server generate for it, or flush its
    cache; it could not read the answer, and no page can call the server to read one
    either (it sends no CORS headers), so nothing legitimate is refused. A key stops it as
    well (the page does not know it): servers with keys do not check. Clients that are not
    browsers (curl, the SDKs) send neither header and are unaffected."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and from_another_origin(Headers(scope=scope)):
            refusal = APIError(403, "A page of another origin may not send requests to a server without keys: "
                                    "call it from a client that is not a browser, or give the server a key",
                               code="cross_origin", error_type="permission_error")
            await error_response(refusal)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def from_another_origin(headers: Headers) -> bool:
    """Whether a browser sent the request from a page of another origin: its `Sec-Fetch-Site`
    (what every current browser sends) is not "same-origin", or, from a browser without it,
    its `Origin` is not this server's host. A request with neither (curl, an SDK) is not."""
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site != "same-origin"
    origin = headers.get("origin")
    if origin is None:
        return False
    return origin == "null" or urlsplit(origin).netloc.lower() != headers.get("host", "").lower()
