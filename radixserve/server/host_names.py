"""The host names a server answers for: its defence against DNS rebinding.

A web page the operator visits can make its own host name resolve to 127.0.0.1 (DNS
rebinding); the browser then treats the server as that page's origin and lets its scripts
read the answers of a server without keys: the cache views (other clients' prompts, with
--expose-cache-tokens), the metrics, the model's output, a flush. A server listening on a
loopback address (the default) is reached by every legitimate client under a loopback name,
so it answers only requests whose Host header names a loopback host (`localhost` and its
subdomains, 127.0.0.0/8, ::1) or a name given with --allowed-hosts. One listening on another
address is reached under names it cannot know: it checks none unless --allowed-hosts names
them.
"""

from __future__ import annotations

import ipaddress

from starlette.types import ASGIApp, Receive, Scope, Send

from radixserve.server.errors import APIError, error_response

ANY_HOST = "*"  # --allowed-hosts' value that turns the check off


def host_names(listen_host: str, allowed: list[str] | None) -> frozenset[str] | None:
    """The extra names a server listening on `listen_host` answers for beside the loopback
    ones (lower-cased), or None where it answers any (no --allowed-hosts and a listening
    address that is not loopback, or `*` among them)."""
    names = [name.strip().lower().rstrip(".") for name in allowed or ()]
    if ANY_HOST in names or (not names and not _is_loopback(listen_host.strip("[]"))):
        return None
    return frozenset(name.strip("[]") for name in names if name)


def requested_host(header: str) -> str:
    """The host name of a Host header's value, without its port, brackets or final dot,
    lower-cased ("[::1]:8000" -> "::1", "Example.COM.:80" -> "example.com")."""
    value = header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    name, _, port = value.rpartition(":")
    if name and port.isdigit() and ":" not in name:
        value = name
    return value.rstrip(".")


def _is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
                if not (_is_loopback(host) or host in self.names):
                    await error_response(_refusal(host))(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def _refusal(host: str) -> APIError:
    return APIError(400, f"This server answers for loopback host names and those given with --allowed-hosts, "
                         f"not {host[:100]!r} (a protection against DNS rebinding): start it with "
                         f"--allowed-hosts {host[:100] or '<name>'} to accept that name.",
                    param="Host", code="host_not_allowed")
