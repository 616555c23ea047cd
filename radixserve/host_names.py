"""The host names a server answers for: its defence against DNS rebinding.

(No heavy imports: the command line reads it before it decides to serve; the check itself
is server/host_check.py's middleware.)

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

ANY_HOST = "*"  # --allowed-hosts' value that turns the check off


def host_names(listen_host: str, allowed: list[str] | None) -> frozenset[str] | None:
    """The extra names a server listening on `listen_host` answers for beside the loopback
    ones (lower-cased), or None where it answers any (no --allowed-hosts and a listening
    address that is not loopback, or `*` among them)."""
    names = [name.strip().lower().rstrip(".") for name in allowed or ()]
    if ANY_HOST in names or (not names and not is_loopback(listen_host.strip("[]"))):
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


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, without brackets) always means this machine."""
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
